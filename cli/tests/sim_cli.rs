//! `kvpipe sim`: one JSON object whose first fields are the documented ones, in order; the exit
//! status says whether a bug was found.

use std::process::Command;

fn kvpipe_sim(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpipe"))
        .arg("sim")
        .args(args)
        .output()
        .expect("kvpipe runs");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn sim_cli_prints_one_json_object_with_the_contract_fields_first() {
    let (ok, stdout, stderr) = kvpipe_sim(&[
        "--requests",
        "150",
        "--seed",
        "4",
        "--faults",
        "all",
        "--json",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(stdout.trim().lines().count(), 1, "{stdout}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let contract = [
        "requests",
        "completed",
        "failed",
        "cancelled",
        "hung",
        "corrupted",
        "leaked",
        "virtual_ms",
    ];
    // A parsed object does not keep the key order: check it on the text.
    let mut at = 0;
    for key in contract {
        assert!(keys.contains(&key), "{key} missing: {stdout}");
        let pos = stdout[at..]
            .find(&format!("\"{key}\":"))
            .unwrap_or_else(|| panic!("{key} out of order: {stdout}"));
        at += pos;
    }
    assert_eq!(v["requests"], 150);
    for bug in ["hung", "corrupted", "leaked"] {
        assert_eq!(v[bug], 0, "{stdout}");
    }
    let total: u64 = ["completed", "failed", "cancelled"]
        .iter()
        .map(|k| v[k].as_u64().unwrap())
        .sum();
    assert_eq!(total, 150);
    // The same seed gives the same run.
    let (_, again, _) = kvpipe_sim(&[
        "--requests",
        "150",
        "--seed",
        "4",
        "--faults",
        "all",
        "--json",
    ]);
    assert_eq!(again, stdout);
}

#[test]
fn sim_cli_refuses_an_unknown_fault_kind() {
    let (ok, _, stderr) = kvpipe_sim(&["--requests", "5", "--faults", "loss,gremlins"]);
    assert!(!ok);
    assert!(stderr.contains("gremlins"), "{stderr}");
}

#[test]
fn sim_cli_table_names_every_count() {
    let (ok, stdout, _) = kvpipe_sim(&["--requests", "20", "--seed", "2"]);
    assert!(ok, "{stdout}");
    for name in [
        "completed",
        "failed",
        "cancelled",
        "hung",
        "corrupted",
        "leaked",
    ] {
        assert!(stdout.contains(name), "{name}: {stdout}");
    }
}
