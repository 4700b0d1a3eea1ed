//! The `MemPair` driver: frames through the codec, handshake outcomes, faults, peer death.

use std::time::Duration;

use kvpipe_core::session::LocalHello;
use kvpipe_core::wire::{Topology, VersionRange};
use kvpipe_core::{Event, InstanceId, ReceiverConfig, SenderConfig};
use kvpipe_mem::{Endpoint, MemPair, PairConfig, RECEIVER_PEER, SENDER_PEER};
use kvpipe_netem::NetemConfig;

fn config() -> PairConfig {
    let hello = |i| LocalHello::new(InstanceId(i), Topology::default(), Vec::new());
    PairConfig::new(
        SenderConfig::new(hello(1)),
        ReceiverConfig::new(hello(2), 3),
    )
}

fn ready(p: &mut MemPair) -> bool {
    p.sender().is_peer_ready(RECEIVER_PEER) && p.receiver().is_peer_ready(SENDER_PEER)
}

#[test]
fn the_handshake_travels_encoded_through_the_codec() {
    let mut pair = MemPair::new(config()).unwrap();
    pair.connect().unwrap();
    pair.drive_until(Duration::from_secs(5), ready).unwrap();
    let stats = pair.stats();
    assert!(stats.frames >= 4, "two Hellos and two accepts: {stats:?}");
    assert!(
        stats.frame_bytes > stats.frames * 12,
        "each frame has a header and a body"
    );
    for counters in [pair.sender().counters(), pair.receiver().counters()] {
        assert_eq!(counters.decode_errors, 0);
        assert_eq!(counters.encode_errors, 0);
    }
    let events = pair.take_events();
    for side in [Endpoint::Sender, Endpoint::Receiver] {
        assert!(events
            .iter()
            .any(|(s, _, e)| *s == side && matches!(e, Event::PeerReady { .. })));
    }
}

#[test]
fn a_version_mismatch_closes_the_connection_on_both_sides() {
    let mut c = config();
    c.receiver.local.versions = VersionRange { min: 9, max: 9 };
    let mut pair = MemPair::new(c).unwrap();
    pair.connect().unwrap();
    pair.drive_until(Duration::from_secs(5), |p| !p.is_connected())
        .unwrap();
    let events = pair.take_events();
    let rejected = |side| {
        events.iter().any(|(s, _, e)| {
            *s == side && matches!(e, Event::PeerRejected { message, .. } if message.contains('9'))
        })
    };
    assert!(
        rejected(Endpoint::Sender) && rejected(Endpoint::Receiver),
        "{events:?}"
    );
    assert_eq!(pair.sender().peer_count(), 0);
    assert_eq!(pair.receiver().peer_count(), 0);
}

#[test]
fn killing_an_endpoint_disconnects_the_survivor() {
    let mut pair = MemPair::new(config()).unwrap();
    pair.connect().unwrap();
    pair.drive_until(Duration::from_secs(5), ready).unwrap();
    pair.kill(Endpoint::Receiver).unwrap();
    pair.pump().unwrap();
    assert!(!pair.is_connected());
    assert!(!pair.is_alive(Endpoint::Receiver));
    assert_eq!(
        pair.sender().peer_count(),
        0,
        "the sender learned of the loss"
    );
    assert_eq!(
        pair.receiver().peer_count(),
        1,
        "a dead endpoint takes no input"
    );
}

#[test]
fn duplicated_heartbeats_are_counted_and_harmless() {
    let mut c = config();
    c.sender.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(5);
    c.receiver.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(5);
    c.faults = NetemConfig {
        seed: 1,
        duplicate: 1.0,
        ..NetemConfig::default()
    };
    let mut pair = MemPair::new(c).unwrap();
    pair.connect().unwrap();
    pair.drive_until(Duration::from_secs(5), ready).unwrap();
    pair.drive_until(Duration::from_secs(5), |p| p.fault_counts().duplicated >= 4)
        .unwrap();
    assert!(pair.is_connected());
    assert!(ready(&mut pair));
}

#[test]
fn a_bounded_wait_returns_when_nothing_happens() {
    let mut pair = MemPair::new(config()).unwrap();
    let start = std::time::Instant::now();
    let err = pair
        .drive_until(Duration::from_millis(30), |_| false)
        .unwrap_err();
    assert!(matches!(err, kvpipe_mem::DriveError::Stalled { .. }));
    assert!(start.elapsed() < Duration::from_secs(2));
}
