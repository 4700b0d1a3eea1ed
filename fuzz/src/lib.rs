//! The checks behind kvpipe's fuzz targets. Each target in `fuzz_targets/` is a thin wrapper
//! around a function here, so the same checks run as ordinary tests over the committed seed
//! corpus (`fuzz/seeds/`) on stable Rust.

pub mod session;
