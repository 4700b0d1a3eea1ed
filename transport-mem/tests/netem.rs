//! The in-process transport's fault injection through the network emulation: damaged frames.

use std::time::Duration;

use kvpipe_core::session::{LocalHello, ProtocolError};
use kvpipe_core::wire::Topology;
use kvpipe_core::{Event, InstanceId, ReceiverConfig, SenderConfig};
use kvpipe_mem::{Endpoint, MemPair, PairConfig, RECEIVER_PEER, SENDER_PEER};
use kvpipe_netem::NetemConfig;

#[test]
fn a_damaged_frame_closes_its_connection_as_a_protocol_violation() {
    let hello = |i| LocalHello::new(InstanceId(i), Topology::default(), Vec::new());
    let mut c = PairConfig::new(
        SenderConfig::new(hello(1)),
        ReceiverConfig::new(hello(2), 3),
    );
    c.sender.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(5);
    c.receiver.deadlines.heartbeat_interval = kvpipe_core::Duration::from_millis(5);
    // Every frame after the handshake arrives with a damaged header.
    c.faults = NetemConfig {
        seed: 11,
        corrupt: 1.0,
        ..NetemConfig::default()
    };
    let mut pair = MemPair::new(c).unwrap();
    pair.connect().unwrap();
    pair.drive_until(Duration::from_secs(5), |p| {
        p.sender().is_peer_ready(RECEIVER_PEER) || p.receiver().is_peer_ready(SENDER_PEER)
    })
    .unwrap();
    // The first heartbeat either way is undecodable: its receiver reports the violation and
    // closes the connection; both sides learn it is gone.
    pair.drive_until(Duration::from_secs(5), |p| !p.is_connected())
        .unwrap();
    assert!(pair.fault_counts().corrupted >= 1);
    let events = pair.take_events();
    let violation = events.iter().any(|(_, _, e)| {
        matches!(
            e,
            Event::ProtocolViolation {
                error: ProtocolError::Undecodable { .. },
                ..
            }
        )
    });
    assert!(violation, "{events:?}");
    assert_eq!(pair.sender().peer_count(), 0);
    assert_eq!(pair.receiver().peer_count(), 0);
    assert!(pair.is_alive(Endpoint::Sender) && pair.is_alive(Endpoint::Receiver));
    let decode_errors =
        pair.sender().counters().decode_errors + pair.receiver().counters().decode_errors;
    assert!(decode_errors >= 1);
}
