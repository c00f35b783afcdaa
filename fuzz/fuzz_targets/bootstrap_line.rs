#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| remote_dram::fuzz::bootstrap_line(data));
