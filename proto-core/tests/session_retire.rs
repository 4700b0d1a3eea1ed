//! Retirement: a retired request is a typed usage error and is never re-created.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{SenderInput, UsageError};
use kvpipe_core::wire::Frame;
use kvpipe_core::RequestId;
use session_support::*;

const R: RequestId = RequestId(51);

fn completed_and_retired() -> (Net, TestSource) {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.aux(0, R);
    let now = net.now;
    net.senders[0].retire(now, R).unwrap();
    net.receivers[0].retire(now, R).unwrap();
    (net, source)
}

#[test]
fn retired_request_is_a_usage_error_everywhere() {
    let (mut net, mut source) = completed_and_retired();
    let now = net.now;
    let s = &mut net.senders[0];
    assert_eq!(s.phase(R), Some(SendPhase::Retired));
    assert_eq!(
        s.submit_chunk(now, R, chunk(0, 16, 16, true), &mut source),
        Err(UsageError::Retired(R))
    );
    assert_eq!(
        s.open_request(now, send_request(R, &[0])),
        Err(UsageError::Retired(R))
    );
    assert_eq!(s.cancel(now, R), Err(UsageError::Retired(R)));
    assert_eq!(s.retire(now, R), Err(UsageError::Retired(R)));
    assert_eq!(
        s.handle_input(SenderInput::Aux {
            now,
            request: R,
            data: Default::default()
        }),
        Err(UsageError::Retired(R))
    );
    assert_eq!(s.session_count(), 0);
    let r = &mut net.receivers[0];
    assert_eq!(r.phase(R), Some(RecvPhase::Retired));
    assert_eq!(
        r.register(now, registration(R, 16, &[0])),
        Err(UsageError::Retired(R))
    );
    assert_eq!(r.cancel(now, R), Err(UsageError::Retired(R)));
    assert_eq!(r.session_count(), 0);
    assert_eq!(net.senders[0].counters().retirements, 1);
    assert_eq!(net.receivers[0].counters().retirements, 1);
}

#[test]
fn a_late_registration_never_recreates_a_retired_send_session() {
    let (mut net, _source) = completed_and_retired();
    let reg = net
        .frames(Side::Receiver(0))
        .into_iter()
        .find(|f| matches!(f, Frame::RecvRegistration(_)))
        .unwrap();
    let now = net.now;
    net.senders[0]
        .handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::session::TransportInput::FrameReceived {
                peer: rx_peer(0),
                bytes: kvpipe_core::wire::Frame::to_bytes(&reg).unwrap(),
            },
        })
        .unwrap();
    net.pump();
    assert_eq!(net.senders[0].session_count(), 0);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Retired));
    // The receiver is told the request is gone.
    assert!(matches!(net.frames(Side::Sender(0)).last(), Some(Frame::Cancel(c)) if c.request == R));
}

#[test]
fn retire_before_quiesce_is_refused() {
    let mut net = Net::connected(1, 1);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let now = net.now;
    assert_eq!(
        net.senders[0].retire(now, R),
        Err(UsageError::NotQuiesced(R))
    );
    assert_eq!(
        net.receivers[0].retire(now, R),
        Err(UsageError::NotQuiesced(R))
    );
    assert_eq!(
        net.senders[0].retire(now, RequestId(9)),
        Err(UsageError::UnknownRequest(RequestId(9)))
    );
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Streaming));
}

#[test]
fn retired_ids_in_any_order_are_refused_within_the_horizon_then_forgotten() {
    let mut config = sender_config(0);
    config.retired_horizon = kvpipe_core::Duration::from_secs(10);
    let mut sender = kvpipe_core::Sender::new(config).unwrap();
    let t0 = kvpipe_core::Instant::from_millis(1);
    // Hashed string ids: no order, any value.
    let ids = [
        RequestId(u64::MAX),
        RequestId(7),
        RequestId(1 << 40),
        RequestId(0),
    ];
    for id in ids {
        sender.open_request(t0, send_request(id, &[0])).unwrap();
        sender.cancel(t0, id).unwrap();
        sender.retire(t0, id).unwrap();
    }
    for id in ids {
        assert_eq!(
            sender.open_request(t0, send_request(id, &[0])),
            Err(UsageError::Retired(id)),
            "{id}"
        );
        assert_eq!(sender.phase(id), Some(SendPhase::Retired));
    }
    // Ids between and around the retired ones are fresh.
    for id in [RequestId(6), RequestId(8), RequestId(u64::MAX - 1)] {
        sender.open_request(t0, send_request(id, &[0])).unwrap();
        sender.cancel(t0, id).unwrap();
    }
    assert_eq!(sender.retired_count(), 4);
    // A retirement after the horizon forgets those whose horizon passed.
    let later = t0 + kvpipe_core::Duration::from_secs(11);
    sender.retire(later, RequestId(6)).unwrap();
    assert_eq!(sender.retired_count(), 1);
    assert_eq!(
        sender.phase(RequestId(7)),
        None,
        "forgotten after the horizon"
    );
    assert_eq!(sender.counters().retired_forgotten_early, 0);

    let mut config = receiver_config(0);
    config.retired_horizon = kvpipe_core::Duration::from_secs(10);
    config.max_retired = 2;
    let mut receiver = kvpipe_core::Receiver::new(config).unwrap();
    for id in ids {
        receiver.register(t0, registration(id, 16, &[0])).unwrap();
        receiver.cancel(t0, id).unwrap();
        receiver.retire(t0, id).unwrap();
    }
    // Past `max_retired`, the oldest retirements are forgotten early, and counted.
    assert_eq!(receiver.retired_count(), 2);
    assert_eq!(receiver.counters().retired_forgotten_early, 2);
    for id in &ids[2..] {
        assert_eq!(
            receiver.register(t0, registration(*id, 16, &[0])),
            Err(UsageError::Retired(*id))
        );
    }
    receiver
        .register(t0, registration(ids[0], 16, &[0]))
        .expect("forgotten early: a fresh registration, never a refusal");
}

/// Many requests with random 64-bit ids (as engines hash their string ids) through a connected
/// pair, each completed and retired: none is refused, and the retired ids remembered stay at
/// one horizon's worth.
#[test]
fn random_request_ids_through_a_pair_are_never_refused_and_memory_stays_bounded() {
    const N: usize = 20_000;
    let horizon = kvpipe_core::Duration::from_millis(500);
    let step = kvpipe_core::Duration::from_millis(1);
    let mut net = Net::new(1, 1);
    let mut s = sender_config(0);
    s.retired_horizon = horizon;
    // Small enough that an id-order bound would have refused fresh ids long before the end.
    s.max_retired = 4096;
    net.senders[0] = kvpipe_core::Sender::new(s).unwrap();
    let mut r = receiver_config(0);
    r.retired_horizon = horizon;
    r.max_retired = 4096;
    net.receivers[0] = kvpipe_core::Receiver::new(r).unwrap();
    net.connect(0, 0);
    net.pump();
    let mut state = 0x0dd_ba11_u64;
    let mut most = 0;
    for _ in 0..N {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let id = RequestId(state ^ (state >> 29));
        let mut source = TestSource::with(id, 100, 1);
        net.register(0, registration(id, 4, &[0]));
        net.open(0, send_request(id, &[0]));
        net.submit(0, id, chunk(0, 4, 4, true), &mut source);
        net.aux(0, id);
        let now = net.now;
        net.senders[0].retire(now, id).unwrap();
        net.receivers[0].retire(now, id).unwrap();
        most = most
            .max(net.senders[0].retired_count())
            .max(net.receivers[0].retired_count());
        net.log.clear();
        net.advance(step);
    }
    assert_eq!(net.receivers[0].counters().completions, N as u64);
    assert_eq!(net.senders[0].counters().completions, N as u64);
    let per_horizon = (horizon.as_nanos() / step.as_nanos()) as usize;
    assert!(
        most <= per_horizon + 1,
        "{most} retired ids remembered, more than one horizon's {per_horizon}"
    );
    assert_eq!(net.senders[0].session_count(), 0);
    assert_eq!(net.receivers[0].session_count(), 0);
}
