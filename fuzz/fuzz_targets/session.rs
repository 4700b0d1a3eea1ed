//! Fuzz target `session`: arbitrary engine inputs, network events and time steps on a connected
//! sender/receiver pair; the rules are in `kvpipe_fuzz::session`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvpipe_fuzz::session::check(data));
