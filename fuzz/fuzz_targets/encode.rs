//! Fuzzes frame encoding: any frame value is either refused with a typed error or emitted as
//! bytes that decode to the same frame. See `kvpipe_fuzz::check_encode`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpipe_fuzz::check_encode(data);
});
