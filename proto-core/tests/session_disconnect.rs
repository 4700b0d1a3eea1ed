//! A peer that disconnects fails exactly the sessions that involve it; healthy peers continue.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::Event;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::RequestId;
use session_support::*;

#[test]
fn disconnect_fails_exactly_the_sessions_of_that_peer() {
    // Sender 0 writes request 1 to receiver 0 and request 2 to receiver 1.
    let mut net = Net::connected(1, 2);
    let (a, b) = (RequestId(1), RequestId(2));
    let mut source = TestSource::with(a, 100, 4);
    source.allocations.insert(b, (200, 4));
    net.register(0, registration(a, 16, &[0]));
    net.register(1, registration(b, 16, &[0]));
    net.open(0, send_request(a, &[0]));
    net.open(0, send_request(b, &[1]));
    net.submit(0, a, chunk(0, 8, 16, false), &mut source);
    net.submit(0, b, chunk(0, 8, 16, false), &mut source);
    net.disconnect(0, 0);
    net.pump();
    let failed = |e: &Event, r| matches!(e, Event::Failed { request, cause: TransferStatus::PeerLost, .. } if *request == r);
    assert!(net.events(Side::Sender(0)).iter().any(|e| failed(e, a)));
    assert!(!net.events(Side::Sender(0)).iter().any(|e| failed(e, b)));
    assert!(net.events(Side::Receiver(0)).iter().any(|e| failed(e, a)));
    assert_eq!(net.senders[0].phase(a), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(a), Some(RecvPhase::Quiesced));
    // Request 2 carries on and completes.
    net.submit(0, b, chunk(8, 16, 16, true), &mut source);
    net.aux(0, b);
    assert_eq!(net.senders[0].phase(b), Some(SendPhase::Completed));
    assert_eq!(net.receivers[1].phase(b), Some(RecvPhase::Completed));
}

#[test]
fn disconnect_of_one_writer_fails_the_receiver_session_and_stops_the_other_writer() {
    let mut net = Net::tensor_parallel(2);
    let r = RequestId(3);
    let mut s0 = TestSource::with(r, 100, 4);
    net.register(0, registration(r, 16, &[0, 1]));
    net.open(0, send_request(r, &[0]));
    net.open(1, send_request(r, &[0]));
    net.submit(0, r, chunk(0, 8, 16, false), &mut s0);
    net.disconnect(1, 0);
    net.pump();
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed { cause: TransferStatus::PeerLost, peer: Some(p), .. } if *p == tx_peer(1)
    )));
    // Writer 0 was told to stop and confirmed: both ends quiesced.
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Quiesced));
}

#[test]
fn disconnect_after_a_writer_finished_does_not_fail_the_request() {
    let mut net = Net::tensor_parallel(2);
    let r = RequestId(4);
    let mut s0 = TestSource::with(r, 100, 4);
    let mut s1 = TestSource::with(r, 300, 4);
    net.register(0, registration(r, 16, &[0, 1]));
    net.open(0, send_request(r, &[0]));
    net.open(1, send_request(r, &[0]));
    net.submit(1, r, chunk(0, 16, 16, true), &mut s1);
    net.aux(1, r);
    net.disconnect(1, 0);
    net.pump();
    net.submit(0, r, chunk(0, 16, 16, true), &mut s0);
    net.aux(0, r);
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Completed));
}

#[test]
fn disconnect_before_a_writers_aux_data_fails_the_request() {
    let mut net = Net::tensor_parallel(2);
    let r = RequestId(5);
    let mut s1 = TestSource::with(r, 300, 4);
    net.register(0, registration(r, 16, &[0, 1]));
    net.open(0, send_request(r, &[0]));
    net.open(1, send_request(r, &[0]));
    net.submit(1, r, chunk(0, 16, 16, true), &mut s1);
    net.disconnect(1, 0);
    net.pump();
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: kvpipe_core::wire::TransferStatus::PeerLost,
            ..
        }
    )));
}

#[test]
fn a_lost_peer_is_reported_once_before_its_requests_fail() {
    let mut net = Net::connected(1, 2);
    let r = RequestId(9);
    let mut source = TestSource::with(r, 100, 4);
    net.register(0, registration(r, 16, &[0]));
    net.open(0, send_request(r, &[0]));
    net.submit(0, r, chunk(0, 8, 16, false), &mut source);
    net.disconnect(0, 0);
    net.pump();
    for (side, peer) in [
        (Side::Sender(0), rx_peer(0)),
        (Side::Receiver(0), tx_peer(0)),
    ] {
        let events = net.events(side);
        let lost: Vec<usize> = (events.iter().enumerate())
            .filter(|(_, e)| matches!(e, Event::PeerLost { .. }))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(lost.len(), 1, "{side:?}: {events:?}");
        assert_eq!(
            events[lost[0]],
            Event::PeerLost { peer, reason: None },
            "{side:?}"
        );
        let failed = events
            .iter()
            .position(|e| matches!(e, Event::Failed { request, .. } if *request == r))
            .expect("the request failed");
        assert!(lost[0] < failed, "{side:?}: {events:?}");
    }
    // The other receiver's connection is untouched.
    assert!(!net
        .events(Side::Receiver(1))
        .iter()
        .any(|e| matches!(e, Event::PeerLost { .. })));
}

#[test]
fn a_request_opened_towards_a_departed_peer_fails_at_once() {
    // Over a transport that never reuses a peer id (TCP, verbs), receiver 1 left: a request
    // naming it and healthy receiver 0 fails at once on the prefill side (it does not wait
    // out its registration deadline), and receiver 0, which registered, is told.
    let mut net = Net::new_with(1, 2, false);
    net.connect(0, 0);
    net.connect(0, 1);
    net.pump();
    net.disconnect(0, 1);
    net.pump();
    let r = RequestId(11);
    net.register(0, registration(r, 16, &[0]));
    net.pump();
    net.open(0, send_request(r, &[0, 1]));
    net.pump();
    assert!(
        net.events(Side::Sender(0)).iter().any(|e| matches!(
            e,
            Event::Failed { request, cause: TransferStatus::PeerLost, peer: Some(p), .. }
                if *request == r && *p == rx_peer(1)
        )),
        "{:?}",
        net.events(Side::Sender(0))
    );
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Quiesced));
    assert!(!matches!(
        net.receivers[0].phase(r),
        Some(RecvPhase::Receiving) | Some(RecvPhase::Completed)
    ));
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Quiesced));
}

#[test]
fn a_registration_naming_a_departed_writer_fails_at_once() {
    let mut net = Net::tensor_parallel_unconnected_with(2, false);
    net.connect(0, 0);
    net.connect(1, 0);
    net.pump();
    net.disconnect(1, 0);
    net.pump();
    let r = RequestId(12);
    net.open(0, send_request(r, &[0]));
    net.register(0, registration(r, 16, &[0, 1]));
    net.pump();
    assert!(
        net.events(Side::Receiver(0)).iter().any(|e| matches!(
            e,
            Event::Failed { request, cause: TransferStatus::PeerLost, peer: Some(p), .. }
                if *request == r && *p == tx_peer(1)
        )),
        "{:?}",
        net.events(Side::Receiver(0))
    );
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Quiesced));
    // The healthy writer heard of it and stopped too.
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Quiesced));
}

#[test]
fn a_peer_that_connects_again_under_its_old_id_is_no_longer_departed() {
    // Even where ids are said not to be reused, a new connection under a departed peer's id
    // is that peer again: requests towards it proceed as usual.
    let mut net = Net::new_with(1, 1, false);
    net.connect(0, 0);
    net.pump();
    net.disconnect(0, 0);
    net.pump();
    net.connect(0, 0);
    net.pump();
    let r = RequestId(13);
    let mut source = TestSource::with(r, 100, 4);
    net.register(0, registration(r, 16, &[0]));
    net.open(0, send_request(r, &[0]));
    net.submit(0, r, chunk(0, 16, 16, true), &mut source);
    net.aux(0, r);
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Completed));
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Completed));
}

#[test]
fn where_peer_ids_are_reused_a_request_towards_a_departed_peer_waits_for_it() {
    // The default: the transport may give a new connection a departed peer's id, so a
    // request opened meanwhile waits (within its deadlines) and completes once it is back.
    let mut net = Net::connected(1, 1);
    net.disconnect(0, 0);
    net.pump();
    let r = RequestId(14);
    let mut source = TestSource::with(r, 100, 4);
    net.open(0, send_request(r, &[0]));
    net.pump();
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Streaming));
    net.connect(0, 0);
    net.pump();
    net.register(0, registration(r, 16, &[0]));
    net.submit(0, r, chunk(0, 16, 16, true), &mut source);
    net.aux(0, r);
    assert_eq!(net.senders[0].phase(r), Some(SendPhase::Completed));
    assert_eq!(net.receivers[0].phase(r), Some(RecvPhase::Completed));
}
