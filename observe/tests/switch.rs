//! `set_enabled(false)` silences every observer (its own test binary: the switch is global).

use kvpipe_core::session::{Event, Output, RequestTimings};
use kvpipe_core::wire::Role;
use kvpipe_core::{Instant, RequestId};
use kvpipe_observe::Observer;
use metrics_exporter_prometheus::PrometheusBuilder;

#[test]
fn nothing_is_recorded_while_observers_are_off() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let completed = Output::Event(Event::Completed {
        request: RequestId(1),
        bytes_written: 1,
        aux: None,
        timings: RequestTimings {
            last_chunk: Some(Instant::ZERO),
            ..RequestTimings::default()
        },
    });
    metrics::with_local_recorder(&recorder, || {
        let mut obs = Observer::new(Role::Sender, "mem");
        kvpipe_observe::set_enabled(false);
        obs.output(Instant::ZERO, &completed);
        assert_eq!(obs.open_spans(), 0);
        kvpipe_observe::set_enabled(true);
    });
    let off = handle.render();
    assert!(!off.contains("kvpipe_requests_total"), "{off}");
    metrics::with_local_recorder(&recorder, || {
        let mut obs = Observer::new(Role::Sender, "mem");
        obs.output(Instant::ZERO, &completed);
        assert_eq!(obs.open_spans(), 1, "on again: the request has its span");
    });
    let on = handle.render();
    assert!(on.contains("kvpipe_requests_total"), "{on}");
}
