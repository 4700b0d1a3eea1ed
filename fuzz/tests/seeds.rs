//! Runs every fuzz check over its committed seed corpus, and keeps the seeds in step with the
//! golden frames.
//!
//! Regenerate the golden seeds after a (deliberate) wire change with
//! `KVPIPE_REGENERATE_SEEDS=1 cargo test --test seeds golden_seeds`.

use std::fs;
use std::path::{Path, PathBuf};

use kvpipe_core::wire::samples::golden_frames;
use kvpipe_core::wire::Frame;

fn seed_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target)
}

/// The generated seeds: every golden frame, plus a data write followed by its payload.
fn generated_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds: Vec<(String, Vec<u8>)> = golden_frames()
        .into_iter()
        .map(|(name, frame)| (name, frame.to_vec().expect("golden frames encode")))
        .collect();
    let with_payload = seeds
        .iter()
        .find(|(name, _)| name == "data_write")
        .map(|(_, bytes)| {
            let mut b = bytes.clone();
            b.extend_from_slice(&[0xab; 64]);
            b
        })
        .expect("a golden data write");
    seeds.push(("data_write_with_payload".into(), with_payload));
    seeds
}

#[test]
fn golden_seeds_match_the_golden_frames() {
    let dir = seed_dir("decode");
    let regenerate = std::env::var_os("KVPIPE_REGENERATE_SEEDS").is_some();
    if regenerate {
        fs::create_dir_all(&dir).unwrap();
    }
    for (name, bytes) in generated_seeds() {
        let path = dir.join(&name);
        if regenerate {
            fs::write(&path, &bytes).unwrap();
        }
        let stored = fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run KVPIPE_REGENERATE_SEEDS=1 cargo test --test seeds)",
                path.display()
            )
        });
        assert_eq!(
            stored,
            bytes,
            "{} differs from the golden frame",
            path.display()
        );
    }
}

#[test]
fn decode_check_passes_on_every_seed() {
    let dir = seed_dir("decode");
    let mut count = 0;
    let mut decoded = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = fs::read(&path).unwrap();
        kvpipe_fuzz::check_decode(&data);
        if Frame::parse(&data).is_ok() {
            decoded += 1;
        }
        count += 1;
    }
    assert!(
        count >= generated_seeds().len(),
        "only {count} seeds in {}",
        dir.display()
    );
    assert!(
        decoded >= generated_seeds().len(),
        "only {decoded} seeds decode"
    );
}

/// The encode seeds are inputs the fuzzer found and minimized (`cargo fuzz cmin encode`), kept
/// small: they reach every frame kind and the encoder's refusals.
#[test]
fn encode_check_passes_on_every_seed() {
    let dir = seed_dir("encode");
    let mut count = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let data = fs::read(entry.unwrap().path()).unwrap();
        kvpipe_fuzz::check_encode(&data);
        count += 1;
    }
    assert!(count > 0, "no seeds in {}", dir.display());
}
