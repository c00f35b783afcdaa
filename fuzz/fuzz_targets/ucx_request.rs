#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| remote_dram::fuzz::ucx_request(data));
