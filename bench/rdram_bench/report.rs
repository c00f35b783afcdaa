//! Results: the markdown table or JSON lines on stdout, and per run the standard
//! percentile-distribution files (.hgrm, values in µs) and a latency-by-percentile plot.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use hdrhistogram::Histogram;
use plotters::prelude::*;

/// Latencies are recorded in nanoseconds.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

/// Figures of one (op, value size) pair.
pub struct Run {
    pub op: String,
    pub size: u64,
    pub ops: u64,
    pub elapsed: Duration,
    pub hist: Histogram<u64>,
}

impl Run {
    pub fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    fn us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
    /// File stem: `get-4096`, `mix-put-8`.
    fn stem(&self) -> String {
        format!("{}-{}", self.op.replace(':', "-"), self.size)
    }
}

pub const TABLE_HEADER: &str =
    "| op | size | ops/s | MB/s | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs |\n|---|---|---|---|---|---|---|---|---|";

pub fn print(r: &Run, json: bool) {
    let ops_s = r.ops_per_s();
    let mb_s = ops_s * r.size as f64 / 1e6;
    let max = r.hist.max() as f64 / 1000.0;
    if json {
        let line = serde_json::json!({"op": r.op, "size": r.size, "ops_per_s": ops_s, "mb_per_s": mb_s,
            "p50_us": r.us(0.5), "p90_us": r.us(0.9), "p99_us": r.us(0.99), "p999_us": r.us(0.999), "max_us": max});
        println!("{line}");
    } else {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} |",
            r.op,
            r.size,
            ops_s,
            mb_s,
            r.us(0.5),
            r.us(0.9),
            r.us(0.99),
            r.us(0.999),
            max
        );
    }
}

/// HdrHistogram's percentile distribution format (as `outputPercentileDistribution`
/// writes it), so the standard plotters and tools read it.
pub fn write_hgrm(r: &Run, dir: &Path) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join(format!("{}.hgrm", r.stem())))?);
    writeln!(f, "{:>12} {:>14} {:>10} {:>14}\n", "Value", "Percentile", "TotalCount", "1/(1-Percentile)")?;
    let mut total = 0u64;
    for v in r.hist.iter_quantiles(5) {
        total += v.count_since_last_iteration();
        let q = v.quantile_iterated_to();
        let value = v.value_iterated_to() as f64 / 1000.0;
        if q < 1.0 {
            writeln!(f, "{value:12.3} {q:2.12} {total:10} {:14.2}", 1.0 / (1.0 - q))?;
        } else {
            writeln!(f, "{value:12.3} {q:2.12} {total:10}")?;
        }
    }
    let h = &r.hist;
    writeln!(f, "#[Mean    = {:12.3}, StdDeviation   = {:12.3}]", h.mean() / 1000.0, h.stdev() / 1000.0)?;
    writeln!(f, "#[Max     = {:12.3}, Total count    = {:12}]", h.max() as f64 / 1000.0, h.len())?;
    writeln!(f, "#[Buckets = {:12}, SubBuckets     = {:12}]", h.buckets(), sub_buckets(h))?;
    f.flush()
}

/// One SVG per run: latency (log scale) against percentile, x = log10(1/(1-p)) as in
/// HdrHistogram's plots, one line per (op, size).
pub fn write_plot(runs: &[Run], path: &Path, title: &str) -> Result<(), String> {
    let curves: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .filter(|r| !r.hist.is_empty())
        .map(|r| {
            let points = r
                .hist
                .iter_quantiles(5)
                .map(|v| v.quantile_iterated_to())
                .filter(|&q| q < 1.0)
                .map(|q| ((1.0 / (1.0 - q)).log10(), r.hist.value_at_quantile(q).max(1) as f64 / 1000.0))
                .collect();
            (format!("{} {} B", r.op, r.size), points)
        })
        .collect();
    let x_max = curves.iter().flat_map(|(_, p)| p.iter().map(|p| p.0)).fold(1.0f64, f64::max).ceil();
    let y_max = curves.iter().flat_map(|(_, p)| p.iter().map(|p| p.1)).fold(1.0f64, f64::max) * 1.5;
    let y_min = curves.iter().flat_map(|(_, p)| p.iter().map(|p| p.1)).fold(y_max, f64::min) / 1.5;

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .x_labels(x_max as usize + 1)
        .x_label_formatter(&|x| {
            // x = 3 is 99.9%: as many decimals as nines after the second.
            let decimals = (x.round() as i64 - 2).max(0) as usize;
            format!("{:.*}%", decimals, 100.0 * (1.0 - 10f64.powf(-x)))
        })
        .draw()
        .map_err(err)?;
    for (i, (label, points)) in curves.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// HdrHistogram's sub-bucket count for the histogram's precision (2048 for 3 digits).
fn sub_buckets(h: &Histogram<u64>) -> u64 {
    let single_unit_resolution = 2 * 10u64.pow(h.sigfig() as u32);
    single_unit_resolution.next_power_of_two()
}
