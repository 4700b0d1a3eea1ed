//! `include/kvpipe.h` is what cbindgen makes of `src/` now. After changing the ABI, regenerate
//! it with `KVPIPE_REGENERATE_HEADER=1 cargo test -p kvpipe-c --test header`.

use std::path::Path;

#[test]
fn header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = crate_dir.join("include/kvpipe.h");
    if std::env::var_os("KVPIPE_REGENERATE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("include/kvpipe.h is writable");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "bindings/c/include/kvpipe.h is stale: the C ABI in src/ changed. Regenerate it with \
         `KVPIPE_REGENERATE_HEADER=1 cargo test -p kvpipe-c --test header` and commit it."
    );
}
