//! What an observer makes of an endpoint's events and counters: metrics in the installed
//! recorder (read back as Prometheus text) and spans and events in the installed subscriber.

use std::io::Write;
use std::sync::{Arc, Mutex};

use kvpipe_core::session::{
    CancelOrigin, Event, LocalHello, Output, ReceiverConfig, Registration, RequestTimings, Wait,
};
use kvpipe_core::wire::{Role, Topology, TransferStatus};
use kvpipe_core::{
    AnchoredRun, BlockId, InstanceId, Instant, LayerGroupLayout, PeerId, PoolLayout, Receiver,
    RegionId, RequestId,
};
use kvpipe_observe::Observer;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// A subscriber's output, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// Runs `f` with a Prometheus recorder and a debug-level subscriber installed on this thread;
/// returns the rendered metrics and the log.
fn observed(level: &str, f: impl FnOnce(&PrometheusHandle)) -> (String, String) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(level))
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || f(&handle))
    });
    (handle.render(), log.text())
}

fn timings(ms: &[u64; 4]) -> RequestTimings {
    let at = Instant::from_millis;
    RequestTimings {
        started: at(ms[0]),
        first_byte: Some(at(ms[1])),
        last_byte: Some(at(ms[2])),
        last_chunk: Some(at(ms[2])),
        last_burst: Some(at(ms[2])),
        ended: at(ms[3]),
        writes: 3,
        ..RequestTimings::default()
    }
}

fn completed(request: u64, t: RequestTimings) -> Output {
    Output::Event(Event::Completed {
        request: RequestId(request),
        bytes_written: 4096,
        aux: None,
        timings: t,
    })
}

fn quiesced(request: u64) -> Output {
    Output::Event(Event::Quiesced {
        request: RequestId(request),
    })
}

#[test]
fn outcomes_are_counted_by_cause_and_completions_feed_the_histograms() {
    let (metrics, _) = observed("off", |_| {
        let mut obs = Observer::new(Role::Sender, "mem");
        let now = Instant::from_millis(50);
        obs.output(now, &completed(1, timings(&[0, 10, 30, 42])));
        obs.output(now, &quiesced(1));
        let failed = Output::Event(Event::Failed {
            request: RequestId(2),
            cause: TransferStatus::PeerLost,
            peer: Some(PeerId(7)),
            sender_slice: None,
            receiver_slice: None,
        });
        obs.output(now, &failed);
        let timed_out = Output::Event(Event::TimedOut {
            request: RequestId(3),
            waiting_for: Wait::Registration,
        });
        obs.output(now, &timed_out);
        let cancelled = Output::Event(Event::Cancelled {
            request: RequestId(4),
            origin: CancelOrigin::Peer(PeerId(7)),
        });
        obs.output(now, &cancelled);
        for r in 2..=4 {
            obs.output(now, &quiesced(r));
        }
        assert_eq!(
            obs.open_spans(),
            0,
            "every quiesced request's span is closed"
        );
    });
    for line in [
        r#"kvpipe_requests_total{role="sender",transport="mem",outcome="completed",cause="none"} 1"#,
        r#"kvpipe_requests_total{role="sender",transport="mem",outcome="failed",cause="peer_lost"} 1"#,
        r#"kvpipe_requests_total{role="sender",transport="mem",outcome="timed_out",cause="registration"} 1"#,
        r#"kvpipe_requests_total{role="sender",transport="mem",outcome="cancelled",cause="peer"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    // The sender's tail: last chunk (30 ms) → its completion (42 ms); transfer 10 → 30 ms.
    assert!(
        metrics.contains(r#"kvpipe_exposed_tail_seconds_sum{view="sender",transport="mem"} 0.012"#)
            || metrics.contains(
                r#"kvpipe_exposed_tail_seconds{view="sender",transport="mem",quantile="0.5"} 0.012"#
            ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"kvpipe_transfer_seconds_sum{view="sender",transport="mem"} 0.02"#),
        "{metrics}"
    );
}

fn one_group() -> Vec<LayerGroupLayout> {
    vec![LayerGroupLayout {
        layers: 2,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 4,
        elem_bytes: 2,
        tokens_per_block: 4,
        window: None,
        block_layout: Default::default(),
        shard: Default::default(),
        pools: [PoolLayout {
            region: RegionId(2),
            layer_begin: 0,
            layers: 2,
            slot_bytes: 128,
        }]
        .into_iter()
        .collect(),
    }]
}

#[test]
fn gauges_follow_sessions_and_pinned_blocks_and_are_taken_back_on_drop() {
    let (metrics, _) = observed("off", |handle| {
        let hello = LocalHello::new(InstanceId(2), Topology::default(), one_group());
        let mut rx = Receiver::new(ReceiverConfig::new(hello, 7)).unwrap();
        let mut obs = Observer::new(Role::Receiver, "tcp");
        let mut other = Observer::new(Role::Receiver, "tcp");
        let ids: Vec<BlockId> = (0..5).map(BlockId).collect();
        rx.register(
            Instant::ZERO,
            Registration {
                request: RequestId(1),
                prompt_len: 20,
                groups: vec![AnchoredRun::from_ids(0, &ids)],
                writers: [PeerId(1)].into_iter().collect(),
                aux_capacity: 64,
                expected_part: None,
            },
        )
        .unwrap();
        obs.counters(&rx);
        other.counters(&rx);
        let both = handle.render();
        assert!(
            both.contains(GAUGES[0].replace('N', "2").as_str()),
            "{both}"
        );
        assert!(
            both.contains(GAUGES[1].replace('N', "10").as_str()),
            "{both}"
        );
        drop(other);
        obs.counters(&rx);
        // One observer of one session of 5 blocks left: the dropped one took its share back.
        let one = handle.render();
        assert!(one.contains(GAUGES[0].replace('N', "1").as_str()), "{one}");
        assert!(one.contains(GAUGES[1].replace('N', "5").as_str()), "{one}");
    });
    assert!(
        metrics.contains(GAUGES[0].replace('N', "0").as_str()),
        "{metrics}"
    );
    assert!(
        metrics.contains(GAUGES[1].replace('N', "0").as_str()),
        "{metrics}"
    );
}

const GAUGES: [&str; 2] = [
    r#"kvpipe_open_sessions{role="receiver",transport="tcp"} N"#,
    r#"kvpipe_pinned_blocks{role="receiver",transport="tcp"} N"#,
];

#[test]
fn each_request_gets_one_span_with_its_id_and_failures_name_their_cause() {
    let (_, log) = observed("kvpipe=debug", |_| {
        let mut obs = Observer::new(Role::Receiver, "mem");
        let now = Instant::from_millis(5);
        let failed = Output::Event(Event::Failed {
            request: RequestId(9),
            cause: TransferStatus::WriteFailed,
            peer: Some(PeerId(3)),
            sender_slice: None,
            receiver_slice: None,
        });
        obs.output(now, &failed);
        obs.output(now, &quiesced(9));
        obs.output(now, &completed(11, timings(&[0, 1, 2, 3])));
        obs.output(now, &quiesced(11));
    });
    let closes: Vec<&str> = log.lines().filter(|l| l.contains(" close ")).collect();
    assert_eq!(closes.len(), 2, "{log}");
    assert!(
        closes[0].contains("request{request=9 role=\"receiver\""),
        "{log}"
    );
    assert!(closes[0].contains("peer=peer#3"), "{log}");
    assert!(
        closes[1].contains("request{request=11 role=\"receiver\""),
        "{log}"
    );
    assert!(log.contains("cause=write failed"), "{log}");
    assert!(log.contains("quiesced"), "{log}");
}
