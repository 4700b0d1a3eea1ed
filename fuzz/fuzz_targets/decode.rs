//! Fuzzes frame decoding: parse never panics; parse → emit → parse round-trips to the same
//! frame and the same bytes. See `kvpipe_fuzz::check_decode`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpipe_fuzz::check_decode(data);
});
