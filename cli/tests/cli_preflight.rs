//! The `kvpipe` program's flag checks, by running the binary: a chunk longer than the rest of
//! the prompt is the rest (no wrapping of token counts), and flags a command cannot honour or
//! values that cannot work are refused up front, naming the flag, instead of being ignored or
//! failing after the run.

mod support;

use std::time::{Duration, Instant};
use support::{finish, run, turn};

const KVPIPE: &str = env!("CARGO_BIN_EXE_kvpipe");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Chunks of u32::MAX tokens: the first chunk is the whole prompt after the prefix.
const HUGE_CHUNKS: [&str; 10] = [
    "--prompt-tokens",
    "100",
    "--sender-prefix",
    "10",
    "--chunk-tokens",
    "4294967295",
    "--prefill-ms-per-chunk",
    "0",
    "--requests",
    "1",
];

#[test]
fn a_chunk_past_the_largest_token_count_is_the_rest_of_the_prompt() {
    let _turn = turn();
    for extra in [&[][..], &["--sender-tp", "2"][..]] {
        let mut args = vec!["demo", "--json"];
        args.extend(HUGE_CHUNKS);
        args.extend(extra);
        let out = run(&args, Duration::from_secs(120));
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn a_chunk_past_the_largest_token_count_crosses_processes_whole() {
    let _turn = turn();
    let (serve, addr, mut err) = support::spawn_serve(
        KVPIPE,
        &[
            "--json",
            "--accept-timeout-s",
            "60",
            "--prompt-tokens",
            "100",
            "--requests",
            "1",
        ],
    );
    // Keep reading what serve says, so that its writes to stderr do not fail.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let mut args = vec!["demo", "--transport", "tcp", "--connect", &addr, "--json"];
    args.extend(HUGE_CHUNKS);
    let demo = run(&args, Duration::from_secs(120));
    assert!(demo.status.success(), "demo: {}", text(&demo.stderr));
    let prefill: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(prefill["completed"], 1, "{prefill}");
    assert_eq!(prefill["chunks"], 1, "{prefill}");
    let out = finish(serve, Duration::from_secs(120), "serve");
    assert!(out.status.success(), "serve: {}", text(&out.stdout));
}

/// Each of `cases` (arguments, then what the message must say) ends at once with status 1 and
/// a one-line `kvpipe: …` message naming it, before anything ran.
fn refused(cases: &[(Vec<&str>, &str)]) {
    let _turn = turn();
    for (args, expected) in cases {
        let start = Instant::now();
        let out = run(args, Duration::from_secs(60));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("kvpipe: "), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
        assert!(start.elapsed() < Duration::from_secs(30), "{args:?}");
    }
}

#[test]
fn demo_connect_refuses_the_flags_it_cannot_honour() {
    // A port nothing listens on: a refusal comes before any connect.
    let connect = ["demo", "--transport", "tcp", "--connect", "127.0.0.1:9"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        connect.iter().chain(extra).copied().collect()
    };
    refused(&[
        (
            with(&["--monolithic"]),
            "--monolithic is not supported with --connect",
        ),
        (
            with(&["--ranks", "2"]),
            "--ranks 2 is not supported with --connect",
        ),
        (with(&["--sender-tp", "2"]), "not supported with --connect"),
        (
            with(&["--receiver-tp", "2"]),
            "not supported with --connect",
        ),
        (
            with(&["--receiver-pp", "2"]),
            "not supported with --connect",
        ),
        (
            with(&["--receiver-prefix", "64"]),
            "--receiver-prefix 64 is the decode side's: give it to `kvpipe serve`",
        ),
        (with(&["--timeline", "t.svg"]), "--timeline"),
    ]);
}

#[test]
fn a_simulated_compute_that_cannot_run_is_refused() {
    refused(&[
        (
            vec!["demo", "--compute", "gpu"],
            "--compute gpu keeps the pools' GPU busy: it needs --memory device",
        ),
        (
            vec!["demo", "--compute", "gpu-fenced"],
            "--compute gpu-fenced keeps the pools' GPU busy: it needs --memory device",
        ),
        (
            vec!["demo", "--compute", "fast"],
            "--compute \"fast\": use sleep, gpu or gpu-fenced",
        ),
        (
            vec!["demo", "--compute", "sleep", "--sender-tp", "2"],
            "--compute is not available with --sender-tp/--receiver-tp/--receiver-pp: the \
             heterogeneous split waits out each chunk's compute",
        ),
    ]);
}

#[test]
fn a_picture_that_cannot_be_written_is_refused_before_the_run() {
    let missing = std::env::temp_dir().join(format!("kvpipe-no-such-dir-{}", std::process::id()));
    let file = missing.join("t.svg");
    let file = file.to_str().unwrap();
    let dir = std::env::temp_dir();
    let dir = dir.to_str().unwrap();
    refused(&[
        (vec!["demo", "--timeline", file], "--timeline"),
        (vec!["demo", "--timeline", dir], "it is a directory"),
        (vec!["bench", "pipeline", "--timeline", file], "--timeline"),
        (
            vec![
                "bench",
                "pipeline",
                "--sweep-chunk-tokens",
                "256,512",
                "--plot",
                file,
            ],
            "--plot",
        ),
    ]);
    assert!(!missing.exists());
}

#[test]
fn the_picture_check_leaves_no_file_behind() {
    // Checked writable, then refused for its memory: no empty picture is left.
    let file = std::env::temp_dir().join(format!("kvpipe-preflight-{}.svg", std::process::id()));
    let path = file.to_str().unwrap();
    refused(&[(
        vec!["demo", "--timeline", path, "--prompt-tokens", "100000000"],
        "lower --prompt-tokens",
    )]);
    assert!(!file.exists());
}

#[test]
fn bench_flags_that_measure_nothing_are_refused() {
    let tcp = |flag: &'static str, v: &'static str| {
        vec!["bench", "transfer", "--transport", "tcp", flag, v]
    };
    refused(&[
        (
            tcp("--socket-write-bytes", "0"),
            "--socket-write-bytes must be at least 4096 (got 0)",
        ),
        (
            tcp("--socket-write-bytes", "2"),
            "--socket-write-bytes must be at least 4096",
        ),
        (
            tcp("--socket-read-bytes", "0"),
            "--socket-read-bytes must be at least 4096",
        ),
        (
            vec!["bench", "transfer", "--runs", "0"],
            "--runs must be at least 1",
        ),
        (
            vec!["bench", "pipeline", "--runs", "0"],
            "--runs must be at least 1",
        ),
        (
            vec!["bench", "fragments", "--runs", "0"],
            "--runs must be at least 1",
        ),
        (
            vec!["bench", "transfer", "--driver-wait", "nonsense"],
            "--driver-wait must be poll or block",
        ),
    ]);
}

#[test]
fn bench_flags_outside_their_mode_are_refused_not_ignored() {
    let transfer = |extra: &[&'static str]| -> Vec<&'static str> {
        ["bench", "transfer"].iter().chain(extra).copied().collect()
    };
    refused(&[
        (
            transfer(&["--connections", "3"]),
            "--connections applies to --transport tcp; this run has --transport mem and \
             --memory host",
        ),
        (
            transfer(&["--driver-wait", "block"]),
            "--driver-wait applies to --memory device",
        ),
        (
            transfer(&["--transport", "tcp", "--staging-slots", "4"]),
            "--staging-slots applies to --transport tcp --memory device",
        ),
        (
            transfer(&["--socket-write-bytes", "65536"]),
            "--socket-write-bytes applies to --transport tcp",
        ),
        (
            transfer(&["--device", "rxe0"]),
            "--device applies to --transport verbs",
        ),
        (transfer(&["--gpu", "1"]), "--gpu applies to --peer-gpu"),
        (
            transfer(&[
                "--transport",
                "tcp",
                "--socket-write-bytes",
                "18446744073709551615",
            ]),
            "--socket-write-bytes must be at most 1073741824",
        ),
        (
            vec!["bench", "pipeline", "--connections", "3"],
            "--connections applies to --transport tcp; this run has --transport mem",
        ),
    ]);
}

#[test]
fn sim_refuses_to_simulate_no_request() {
    refused(&[(
        vec!["sim", "--requests", "0"],
        "--requests must be at least 1 (got 0)",
    )]);
}

#[test]
fn serve_refuses_one_address_for_its_listener_and_its_metrics() {
    let same = "127.0.0.1:17502";
    refused(&[(
        vec!["serve", "--listen", same, "--metrics", same],
        "--listen and --metrics both name 127.0.0.1:17502",
    )]);
}

#[test]
fn a_pipeline_split_past_the_models_layers_is_refused() {
    let demo = |model: &'static str, pp: &'static str| {
        vec![
            "demo",
            "--model",
            model,
            "--prompt-tokens",
            "64",
            "--receiver-pp",
            pp,
        ]
    };
    refused(&[
        (demo("llama3-8b", "33"), "--receiver-pp must be at most 32"),
        (
            demo("llama3-70b-tp8", "81"),
            "--receiver-pp must be at most 80",
        ),
        (demo("gemma3-swa", "41"), "--receiver-pp must be at most 40"),
    ]);
}

#[test]
fn plan_names_the_flag_out_of_range_first() {
    let plan = |extra: &[&'static str]| -> Vec<&'static str> {
        [
            "plan",
            "--prompt-tokens",
            "32",
            "--tokens-per-block",
            "8",
            "--chunks",
            "0:32",
        ]
        .iter()
        .chain(extra)
        .copied()
        .collect()
    };
    refused(&[
        (
            plan(&["--sender-prefix", "40"]),
            "--sender-prefix 40 is longer than the prompt (32 tokens)",
        ),
        (
            plan(&["--receiver-prefix", "33"]),
            "--receiver-prefix 33 is longer than the prompt (32 tokens)",
        ),
        (plan(&["--window", "0"]), "--window must be at least 1"),
    ]);
}

/// `bench pipeline --layers-per-slice N` names the last range's real size (the last range of 32
/// layers in ranges of 3 is 2 layers) and says when N is more than the model has.
/// `demo`, `bench fragments` and `bench pipeline` say what `--layers-per-slice N` did: the
/// last range's real layers, and when N is more than the model has (each chunk then goes out
/// whole); their JSON says it in `last_range_layers` and `layers_per_slice_exceeds_model`.
#[test]
fn demo_and_benches_say_how_layers_per_slice_fell_on_the_model() {
    let _turn = turn();
    let demo = |n: &'static str| -> Vec<&'static str> {
        let mut args = vec!["demo", "--layers-per-slice", n, "--no-baseline"];
        args.extend([
            "--prompt-tokens",
            "512",
            "--chunk-tokens",
            "256",
            "--requests",
            "1",
            "--prefill-ms-per-chunk",
            "1",
        ]);
        args
    };
    let fragments = |n: &'static str| -> Vec<&'static str> {
        vec![
            "bench",
            "fragments",
            "--layers-per-slice",
            n,
            "--fragments",
            "1600",
            "--runs",
            "1",
        ]
    };
    let pipeline = |n: &'static str| -> Vec<&'static str> {
        vec![
            "bench",
            "pipeline",
            "--layers-per-slice",
            n,
            "--prompt-tokens",
            "512",
            "--chunk-tokens",
            "256",
            "--prefill-ms-per-chunk",
            "1",
            "--runs",
            "1",
        ]
    };
    // (arguments, the human line's start, what it must say, last range's layers, exceeds)
    let cases = [
        (demo("3"), "mode", "(last range: 2 layers)", 2, false),
        (
            demo("100"),
            "mode",
            "(last range: 32 layers, --layers-per-slice 100 is more than the model's 32 layers)",
            32,
            true,
        ),
        (fragments("3"), "", "(last range: 2 layers)", 2, false),
        (
            fragments("100"),
            "",
            "(last range: 80 layers, --layers-per-slice 100 is more than the model's 80 layers)",
            80,
            true,
        ),
        (pipeline("3"), "last range alone", "(2 layers)", 2, false),
        (
            pipeline("100"),
            "last range alone",
            "(32 layers, --layers-per-slice 100 is more than the model's 32 layers)",
            32,
            true,
        ),
    ];
    for (args, starts, says, last_range, exceeds) in cases {
        let out = run(&args, Duration::from_secs(120));
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let line = stdout
            .lines()
            .find(|l| l.starts_with(starts) && l.contains("layers"))
            .unwrap_or_else(|| panic!("{args:?}: no {starts:?} line in {stdout}"));
        assert!(line.contains(says), "{args:?}: {line}");
        let mut json_args = args.clone();
        json_args.push("--json");
        let out = run(&json_args, Duration::from_secs(120));
        assert!(out.status.success(), "{json_args:?}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["last_range_layers"], last_range, "{json_args:?}: {v}");
        assert_eq!(
            v["layers_per_slice_exceeds_model"], exceeds,
            "{json_args:?}: {v}"
        );
    }
}

/// `bench pipeline --sweep-chunk-tokens` with `--layers-per-slice N` says that its pipelined
/// runs went out in layer slices: in the header, the tail's column and the JSON; without it,
/// none of them does.
#[test]
fn a_layered_sweep_says_it_is_layered() {
    let _turn = turn();
    for layered in [true, false] {
        let mut args = vec![
            "bench",
            "pipeline",
            "--sweep-chunk-tokens",
            "256,512",
            "--prompt-tokens",
            "512",
            "--chunk-tokens",
            "256",
            "--prefill-ms-per-chunk",
            "1",
            "--runs",
            "1",
        ];
        if layered {
            args.extend(["--layers-per-slice", "3"]);
        }
        let out = run(&args, Duration::from_secs(120));
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let mut lines = stdout.lines();
        let (header, columns) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
        assert_eq!(
            header.contains("pipelined in layer slices of 3 (last range: 2 layers)"),
            layered,
            "{header}"
        );
        assert_eq!(
            columns.contains("tail, 3-layer slices"),
            layered,
            "{columns}"
        );
        assert_eq!(columns.contains("exposed tail"), !layered, "{columns}");
        args.push("--json");
        let out = run(&args, Duration::from_secs(120));
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let expected = if layered {
            serde_json::json!(3)
        } else {
            serde_json::Value::Null
        };
        assert_eq!(v["layers_per_slice"], expected, "{v}");
    }
}

/// With an even count of requests the p50 the demo prints is the median its JSON reports
/// (`exposed_tail_ms`, the mean of the middle two), not the nearest-rank 50th percentile (the
/// smaller of two): in the in-process demo and in the heterogeneous split.
#[test]
fn the_demos_p50_is_its_median_for_an_even_request_count() {
    let _turn = turn();
    for extra in [&[][..], &["--sender-tp", "2"][..]] {
        let mut args = vec![
            "demo",
            "--json",
            "--no-baseline",
            "--requests",
            "2",
            "--prompt-tokens",
            "512",
            "--chunk-tokens",
            "256",
            "--prefill-ms-per-chunk",
            "1",
        ];
        args.extend(extra);
        let out = run(&args, Duration::from_secs(120));
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            v["exposed_tail_p50_ms"], v["exposed_tail_ms"],
            "{args:?}: {v}"
        );
    }
}

/// A flag of another transport, memory or mode than the run's is refused, naming what it
/// applies to, instead of being ignored; given where it applies, it is taken.
#[test]
fn flags_outside_their_mode_are_refused_not_ignored() {
    let _turn = turn();
    let cases: &[(&[&str], &str)] = &[
        (
            &["demo", "--connections", "1"],
            "--connections applies to --transport tcp",
        ),
        (
            &["demo", "--transport", "verbs", "--connections", "1"],
            "--connections applies to",
        ),
        (
            &["demo", "--device", "rxe0"],
            "--device applies to --transport verbs",
        ),
        (
            &["demo", "--transport", "tcp", "--device", "rxe0"],
            "--device applies to",
        ),
        (&["demo", "--gpu", "1"], "--gpu applies to --memory device"),
        (
            &["demo", "--data-path", "socket"],
            "--data-path applies to --connect over",
        ),
        (
            &["demo", "--transport", "tcp", "--data-path", "socket"],
            "--data-path applies to",
        ),
        (
            &["serve", "--listen", "127.0.0.1:0", "--device", "rxe0"],
            "--device applies to --transport verbs",
        ),
        (
            &["serve", "--listen", "127.0.0.1:0", "--gpu", "1"],
            "--gpu applies to --memory device",
        ),
        (
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--transport",
                "verbs",
                "--data-path",
                "socket",
            ],
            "--data-path applies to --transport tcp",
        ),
        (
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-linger-s",
                "5",
            ],
            "--metrics-linger-s applies to --metrics",
        ),
    ];
    for (args, says) in cases {
        let out = run(args, Duration::from_secs(30));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("listening"), "{args:?}: {err}");
    }
    // Where they apply they are taken: tcp with --connections runs and verifies.
    let out = run(
        &[
            "demo",
            "--transport",
            "tcp",
            "--connections",
            "1",
            "--prompt-tokens",
            "256",
            "--requests",
            "1",
            "--prefill-ms-per-chunk",
            "0",
            "--json",
        ],
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("\"verified\":true"));
}

/// The flags `demo --connect` refuses, as `demo --help` and docs/CLI.md list them ("…
/// --receiver-prefix goes to `serve`, and FLAGS are refused"): every flag of `demo`, given
/// with --connect to a port nothing listens on, is either refused before any connect (and
/// listed) or gets as far as connecting (and is not).
#[test]
fn demo_connect_refuses_exactly_the_flags_its_help_and_cli_md_list() {
    let _turn = turn();
    // A value for every flag of `demo` that works without --connect (--help, --connect and
    // --transport aside).
    let samples: &[(&str, Option<&str>)] = &[
        ("--model", Some("gemma3-swa")),
        ("--prompt-tokens", Some("1024")),
        ("--chunk-tokens", Some("256")),
        ("--tokens-per-block", Some("16")),
        ("--window", Some("512")),
        ("--sender-prefix", Some("64")),
        ("--receiver-prefix", Some("64")),
        ("--requests", Some("1")),
        ("--ranks", Some("2")),
        ("--sender-tp", Some("2")),
        ("--receiver-tp", Some("2")),
        ("--receiver-pp", Some("2")),
        ("--prefill-ms-per-chunk", Some("1")),
        ("--monolithic", None),
        ("--layers-per-slice", Some("4")),
        ("--no-baseline", None),
        ("--timeline", Some("connect-refusal.svg")),
        ("--device", Some("rxe0")),
        ("--connections", Some("1")),
        ("--memory", Some("host")),
        ("--gpu", Some("0")),
        ("--data-path", Some("socket")),
        ("--compute", Some("sleep")),
        ("--json", None),
    ];
    let help = text(&run(&["demo", "--help"], Duration::from_secs(30)).stdout);
    // The flags' own lines (their descriptions are indented further).
    let flags: Vec<&str> = help
        .lines()
        .filter(|l| l.len() - l.trim_start().len() < 8)
        .filter_map(|l| l.trim_start().split(' ').find(|w| w.starts_with("--")))
        .filter(|f| !["--help", "--connect", "--transport"].contains(f))
        .collect();
    let mut sampled: Vec<&str> = samples.iter().map(|(f, _)| *f).collect();
    sampled.sort_unstable();
    let mut listed_flags = flags.clone();
    listed_flags.sort_unstable();
    assert_eq!(sampled, listed_flags, "give every flag of `demo` a sample");

    let mut refused = std::collections::BTreeSet::new();
    for (flag, value) in samples {
        let mut args = vec![
            "demo",
            "--transport",
            "tcp",
            "--connect",
            "127.0.0.1:9",
            flag,
        ];
        args.extend(value);
        let out = run(&args, Duration::from_secs(60));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        // Reaching the connect, or refused as a flag of another transport or memory (the
        // sample's --device is a verbs device, its --gpu needs --memory device): not a flag
        // --connect refuses.
        if err.starts_with("kvpipe: connect to 127.0.0.1:9")
            || err.starts_with(&format!("kvpipe: {flag} applies to"))
        {
            continue;
        }
        assert!(err.contains(flag), "{args:?}: {err}");
        refused.insert(flag.to_string());
    }
    // The flags named after "goes to `serve`, and" up to "are refused", --receiver-prefix
    // (which goes to `serve`) with them.
    let listed = |doc: &str| -> std::collections::BTreeSet<String> {
        let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        let (before, after) = doc
            .split_once("goes to `serve`, and ")
            .unwrap_or_else(|| panic!("no refusals in {doc}"));
        let list = after.split(" are refused").next().unwrap();
        let mut flags: std::collections::BTreeSet<String> = list
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("--"))
            .map(str::to_string)
            .collect();
        assert!(before.contains("--receiver-prefix"), "{before}");
        flags.insert("--receiver-prefix".into());
        flags
    };
    let connect_help: String = help
        .split("--connect <CONNECT>")
        .nth(1)
        .and_then(|rest| rest.split("\n      --").next())
        .unwrap_or_else(|| panic!("no --connect in {help}"))
        .to_string();
    assert_eq!(listed(&connect_help), refused, "demo --help");
    let cli_md =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CLI.md")).unwrap();
    let row = cli_md
        .lines()
        .find(|l| l.starts_with("| `--connect ADDR` |"))
        .expect("docs/CLI.md has the --connect row");
    assert_eq!(listed(row), refused, "docs/CLI.md");
}

/// `--layers-per-slice`, `--compute` and `--timeline` are refused with --connect and with the
/// split flags for what those runs lack: each chunk goes out whole, no GPU kernel runs, and no
/// timeline is recorded.
#[test]
fn the_engine_models_flags_are_refused_for_what_the_other_runs_lack() {
    let connect = ["demo", "--transport", "tcp", "--connect", "127.0.0.1:9"];
    let split = ["demo", "--sender-tp", "2"];
    let with = |base: &[&'static str], extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    let layers = ["--layers-per-slice", "4"];
    let compute = ["--compute", "sleep"];
    let timeline = ["--timeline", "t.svg"];
    refused(&[
        (
            with(&split, &layers),
            "--layers-per-slice is not available with --sender-tp/--receiver-tp/--receiver-pp: \
             the heterogeneous split submits each chunk whole, never in layer ranges",
        ),
        (
            with(&connect, &layers),
            "--layers-per-slice is not available with --connect: the prefill side of --connect \
             submits each chunk whole",
        ),
        (
            with(&split, &compute),
            "the heterogeneous split waits out each chunk's compute on its own thread, with no \
             GPU kernel to run",
        ),
        (
            with(&connect, &compute),
            "--compute is not available with --connect",
        ),
        (
            with(&split, &timeline),
            "--timeline is not available with --sender-tp/--receiver-tp/--receiver-pp: the \
             heterogeneous split records no timeline to draw",
        ),
        (
            with(&connect, &timeline),
            "--timeline is not available with --connect",
        ),
    ]);
}
