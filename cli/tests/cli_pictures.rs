//! The pictures of `kvpipe demo --timeline`, `kvpipe bench pipeline --timeline` and
//! `--sweep-chunk-tokens … --plot`, and the demo's monolithic baseline row, end to end at small
//! sizes: each SVG is read as XML and its named elements checked against the run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// One `kvpipe` at a time: several at once on a small shared machine skew each other's timings.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn kvpipe(args: &[&str]) -> (bool, String, String) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_kvpipe"))
        .args(args)
        .output()
        .expect("kvpipe runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// A file in the test's own temporary folder.
fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpipe-pictures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    dir.join(name)
}

/// Five chunks per request (200 tokens in chunks of 48), each completing blocks of 16.
const SMALL: [&str; 12] = [
    "--model",
    "llama3-70b-tp8",
    "--prompt-tokens",
    "200",
    "--chunk-tokens",
    "48",
    "--tokens-per-block",
    "16",
    "--requests",
    "2",
    "--prefill-ms-per-chunk",
    "4",
];

/// A named element of a picture.
#[derive(Debug)]
struct Named {
    element: String,
    class: String,
    attrs: BTreeMap<String, String>,
    title: String,
}

impl Named {
    fn data(&self, key: &str) -> &str {
        self.attrs
            .get(&format!("data-{key}"))
            .unwrap_or_else(|| panic!("{self:?} has no data-{key}"))
    }

    fn ms(&self, key: &str) -> f64 {
        self.data(key).parse().expect("a number of ms")
    }

    fn px(&self, key: &str) -> f64 {
        self.attrs[key].parse().expect("a number of pixels")
    }
}

/// Every element with a class, and every text, of the SVG document `svg`.
fn read_svg(svg: &str) -> (Vec<Named>, Vec<String>) {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let named = doc
        .descendants()
        .filter(|n| n.is_element() && n.has_attribute("class"))
        .map(|n| Named {
            element: n.tag_name().name().to_string(),
            class: n.attribute("class").unwrap_or_default().to_string(),
            attrs: n
                .attributes()
                .map(|a| (a.name().to_string(), a.value().to_string()))
                .collect(),
            title: n
                .children()
                .find(|c| c.tag_name().name() == "title")
                .and_then(|t| t.text())
                .unwrap_or_default()
                .to_string(),
        })
        .collect();
    let texts = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "text")
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    (named, texts)
}

/// The elements of `class` in `panel`'s lane of `request`, by chunk.
fn lane<'a>(named: &'a [Named], panel: &str, request: u64, class: &str) -> Vec<&'a Named> {
    let mut v: Vec<&Named> = named
        .iter()
        .filter(|n| n.class == class)
        .filter(|n| n.attrs.get("data-panel").map(String::as_str) == Some(panel))
        .filter(|n| n.data("request") == request.to_string())
        .collect();
    v.sort_by_key(|n| n.attrs.get("data-chunk").map(|c| c.parse::<u32>().unwrap()));
    v
}

/// One compute bar and one write-batch bar per chunk, in time order, on the page and in ms;
/// the last chunk's computed moment, the completion and the tail marked.
fn check_pipelined_lane(named: &[Named], request: u64, chunks: usize) {
    let compute = lane(named, "pipelined", request, "compute");
    let transfer = lane(named, "pipelined", request, "transfer");
    assert_eq!(compute.len(), chunks, "compute bars of request {request}");
    assert_eq!(
        transfer.len(),
        chunks,
        "write-batch bars of request {request}"
    );
    for (k, (c, t)) in compute.iter().zip(&transfer).enumerate() {
        assert_eq!(c.element, "rect");
        assert_eq!(t.element, "rect");
        assert_eq!(c.data("chunk"), k.to_string());
        assert_eq!(t.data("chunk"), k.to_string(), "the batch of chunk {k}");
        assert!(c.ms("start-ms") <= c.ms("end-ms"));
        assert!(
            t.ms("start-ms") >= c.ms("end-ms"),
            "chunk {k}'s batch was issued before its compute finished: {c:?} {t:?}"
        );
        assert!(t.ms("start-ms") <= t.ms("end-ms"));
        // The write batch's bar lies under its compute bar's end, not before it.
        assert!(t.px("x") + 2.0 >= c.px("x") + c.px("width"), "{c:?} {t:?}");
        assert!(
            t.px("y") > c.px("y"),
            "the batch bar is under the compute bar"
        );
        assert!(c.title.contains(&format!("chunk {k}")), "{}", c.title);
    }
    for w in compute.windows(2) {
        assert!(w[1].ms("start-ms") >= w[0].ms("end-ms"), "{w:?}");
        assert!(w[1].px("x") > w[0].px("x"), "{w:?}");
    }
    for w in transfer.windows(2) {
        assert!(w[1].ms("start-ms") >= w[0].ms("start-ms"), "{w:?}");
        assert!(w[1].px("x") >= w[0].px("x"), "{w:?}");
    }
    let last = lane(named, "pipelined", request, "last-computed");
    let done = lane(named, "pipelined", request, "completed");
    let tail = lane(named, "pipelined", request, "tail");
    assert_eq!((last.len(), done.len(), tail.len()), (1, 1, 1));
    assert_eq!(last[0].ms("start-ms"), compute[chunks - 1].ms("end-ms"));
    assert!(done[0].ms("start-ms") >= transfer[chunks - 1].ms("end-ms"));
    assert_eq!(tail[0].ms("start-ms"), last[0].ms("start-ms"));
    assert_eq!(tail[0].ms("end-ms"), done[0].ms("start-ms"));
}

#[test]
fn demo_timeline_draws_every_chunk_and_the_monolithic_run_beside() {
    let path = temp("demo.svg");
    let mut args = vec!["demo", "--json", "--timeline", path.to_str().unwrap()];
    args.extend(SMALL);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    // The baseline ran in the same process: its tail and the ratio are in the JSON.
    assert!(v["monolithic_tail_ms"].as_f64().unwrap() > 0.0);
    assert!(v["monolithic_over_pipelined"].as_f64().unwrap() > 0.0);
    assert_eq!(v["monolithic_verified"], true);

    let svg = std::fs::read_to_string(&path).expect("the picture was written");
    let (named, texts) = read_svg(&svg);
    for request in [1, 2] {
        check_pipelined_lane(&named, request, 5);
        // Beside it the monolithic run: the same compute, one write batch after the last chunk.
        let compute = lane(&named, "monolithic", request, "compute");
        let transfer = lane(&named, "monolithic", request, "transfer");
        assert_eq!(compute.len(), 5);
        assert_eq!(transfer.len(), 1);
        assert_eq!(transfer[0].data("chunk"), "4");
        assert!(transfer[0].ms("start-ms") >= compute[4].ms("end-ms"));
        assert_eq!(lane(&named, "monolithic", request, "tail").len(), 1);
    }
    // The tails are written on the picture in ms, per lane and per panel.
    let labels: Vec<&String> = texts
        .iter()
        .filter(|t| t.starts_with("exposed tail") && t.ends_with(" ms"))
        .collect();
    assert_eq!(labels.len(), 4, "{texts:?}");
    assert!(
        texts.iter().any(|t| t.starts_with("request 1")),
        "{texts:?}"
    );
    assert!(
        texts.iter().any(|t| t.starts_with("pipelined:")),
        "{texts:?}"
    );
    assert!(
        texts.iter().any(|t| t.starts_with("monolithic:")),
        "{texts:?}"
    );
    assert_eq!(named.iter().filter(|n| n.class == "legend").count(), 5);
}

#[test]
fn demo_table_shows_the_monolithic_tail_unless_no_baseline() {
    let mut args = vec!["demo"];
    args.extend(SMALL);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("monolithic tail"))
        .unwrap_or_else(|| panic!("no monolithic row: {out}"));
    assert!(
        row.contains(" ms median") && row.contains("× the pipelined tail"),
        "{row}"
    );
    // Right under the pipelined tail.
    let rows: Vec<&str> = out.lines().collect();
    let at = rows
        .iter()
        .position(|l| l.starts_with("exposed tail"))
        .unwrap();
    assert!(rows[at + 1].starts_with("monolithic tail"), "{out}");

    args.push("--no-baseline");
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    assert!(out.contains("exposed tail"), "{out}");
    assert!(!out.contains("monolithic"), "{out}");
    args.push("--json");
    let (ok, out, _) = kvpipe(&args);
    assert!(ok);
    assert!(json(&out).get("monolithic_tail_ms").is_none(), "{out}");
}

#[test]
fn demo_timeline_of_several_ranks_has_a_lane_per_rank_and_request() {
    let path = temp("ranks.svg");
    let mut args = vec![
        "demo",
        "--no-baseline",
        "--ranks",
        "2",
        "--timeline",
        path.to_str().unwrap(),
    ];
    args.extend(SMALL);
    let (ok, _, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let (named, texts) = read_svg(&std::fs::read_to_string(&path).unwrap());
    for rank in ["0", "1"] {
        for request in ["1", "2"] {
            let bars = named
                .iter()
                .filter(|n| n.class == "compute" && n.attrs.contains_key("data-rank"))
                .filter(|n| n.data("rank") == rank && n.data("request") == request)
                .count();
            assert_eq!(bars, 5, "rank {rank} request {request}");
        }
    }
    assert!(texts.iter().any(|t| t == "rank 1 · req 2"), "{texts:?}");
    // Without the baseline there is no monolithic panel.
    assert!(!named
        .iter()
        .any(|n| n.attrs.get("data-panel").map(String::as_str) == Some("monolithic")));
}

#[test]
fn bench_pipeline_draws_its_median_run_and_the_chunk_size_sweep() {
    let path = temp("bench.svg");
    let bench = [
        "bench",
        "pipeline",
        "--json",
        "--prompt-tokens",
        "256",
        "--chunk-tokens",
        "64",
        "--prefill-ms-per-chunk",
        "4",
        "--runs",
        "1",
    ];
    let mut args = bench.to_vec();
    args.extend(["--timeline", path.to_str().unwrap()]);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    assert_eq!(json(&out)["verified"], true);
    let (named, _) = read_svg(&std::fs::read_to_string(&path).unwrap());
    check_pipelined_lane(&named, 1, 4);
    assert_eq!(lane(&named, "monolithic", 1, "transfer").len(), 1);

    let plot = temp("sweep.svg");
    let mut args = bench.to_vec();
    args.extend([
        "--sweep-chunk-tokens",
        "64,128",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    let rows = v["sweep"].as_array().expect("one row per chunk size");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["chunk_tokens"], 64);
    assert_eq!(rows[0]["chunks"], 4);
    assert_eq!(rows[1]["chunks"], 2);
    // The compute grows with the chunk: the prompt takes the same time at every size.
    assert_eq!(rows[0]["prefill_ms_per_chunk"], 4.0);
    assert_eq!(rows[1]["prefill_ms_per_chunk"], 8.0);
    let (named, _) = read_svg(&std::fs::read_to_string(&plot).unwrap());
    for figure in ["tail", "transfer"] {
        for series in ["pipelined", "monolithic"] {
            let points: Vec<&Named> = named
                .iter()
                .filter(|n| n.class == "point")
                .filter(|n| n.data("figure") == figure && n.data("series") == series)
                .collect();
            assert_eq!(points.len(), 2, "{figure} {series}");
            assert!(points[0].px("cx") < points[1].px("cx"));
            let key = match (figure, series) {
                ("tail", "pipelined") => "exposed_tail_ms",
                ("tail", _) => "monolithic_tail_ms",
                (_, "pipelined") => "transfer_ms",
                _ => "monolithic_transfer_ms",
            };
            for (p, row) in points.iter().zip(rows) {
                let ms = row[key].as_f64().unwrap();
                assert!((p.ms("ms") - ms).abs() < 1e-3, "{key}: {p:?} against {ms}");
            }
            assert_eq!(
                named
                    .iter()
                    .filter(|n| n.class == "series" && n.data("figure") == figure)
                    .filter(|n| n.data("series") == series)
                    .count(),
                1
            );
        }
    }
}

#[test]
fn pictures_refuse_what_they_cannot_draw() {
    let (ok, _, err) = kvpipe(&[
        "demo",
        "--transport",
        "tcp",
        "--connect",
        "127.0.0.1:9",
        "--timeline",
        "x.svg",
    ]);
    assert!(!ok);
    assert!(err.contains("--timeline"), "{err}");
    let (ok, _, err) = kvpipe(&["bench", "pipeline", "--plot", "x.svg"]);
    assert!(!ok);
    assert!(err.contains("--sweep-chunk-tokens"), "{err}");
}

#[test]
fn demo_timeline_draws_every_layer_range_of_every_chunk() {
    let path = temp("demo-layers.svg");
    // llama3-70b-tp8 has 80 layers: ranges of 32 are 0–32, 32–64 and 64–80.
    let mut args = vec![
        "demo",
        "--json",
        "--no-baseline",
        "--layers-per-slice",
        "32",
        "--timeline",
        path.to_str().unwrap(),
    ];
    args.extend(SMALL);
    let (ok, out, err) = kvpipe(&args);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["mode"], "pipelined, layer slices of 32");
    // 5 chunks of 2 requests, 3 ranges each, each its own write batch.
    assert_eq!(v["write_batches"], 30);
    let svg = std::fs::read_to_string(&path).expect("the picture was written");
    let (named, texts) = read_svg(&svg);
    assert!(
        texts.iter().any(|t| t.contains("layer ranges of 32")),
        "{texts:?}"
    );
    for request in [1, 2] {
        let compute = lane(&named, "pipelined", request, "compute");
        let transfer = lane(&named, "pipelined", request, "transfer");
        assert_eq!(
            (compute.len(), transfer.len()),
            (15, 15),
            "request {request}"
        );
        for chunk in 0..5 {
            let ranges: Vec<(&str, &str)> = compute
                .iter()
                .filter(|c| c.data("chunk") == chunk.to_string())
                .map(|c| (c.data("layer-begin"), c.data("layer-end")))
                .collect();
            assert_eq!(ranges, [("0", "32"), ("32", "64"), ("64", "80")]);
        }
        // Every range's batch leaves after the range was computed, and the ranges of a chunk
        // are computed one after the other.
        for c in &compute {
            let t = transfer
                .iter()
                .find(|t| {
                    t.data("chunk") == c.data("chunk")
                        && t.data("layer-begin") == c.data("layer-begin")
                })
                .expect("each range has its batch");
            assert!(t.ms("start-ms") >= c.ms("end-ms"), "{c:?} {t:?}");
        }
        for w in compute.windows(2) {
            assert!(w[1].ms("start-ms") >= w[0].ms("end-ms") - 1e-3, "{w:?}");
        }
        // The exposed tail starts when the last chunk's last range was computed.
        let last = lane(&named, "pipelined", request, "last-computed");
        assert_eq!(last[0].ms("start-ms"), compute[14].ms("end-ms"));
    }
}

#[test]
fn layers_per_slice_is_refused_where_it_cannot_apply() {
    for (extra, says) in [
        (&["--layers-per-slice", "0"][..], "--layers-per-slice"),
        (
            &["--layers-per-slice", "4", "--monolithic"][..],
            "--monolithic",
        ),
        (
            &["--layers-per-slice", "4", "--receiver-tp", "2"][..],
            "--layers-per-slice is not available with --sender-tp/--receiver-tp/--receiver-pp: \
             the heterogeneous split submits each chunk whole",
        ),
    ] {
        let mut args = vec!["demo"];
        args.extend(extra);
        args.extend(SMALL);
        let (ok, _, err) = kvpipe(&args);
        assert!(!ok, "{extra:?} was accepted");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}
