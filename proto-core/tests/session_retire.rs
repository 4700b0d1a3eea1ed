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
fn more_retirements_than_remembered_never_recreate_a_request() {
    let mut config = sender_config(0);
    config.max_retired = 1;
    let mut sender = kvpipe_core::Sender::new(config).unwrap();
    let now = kvpipe_core::Instant::from_millis(1);
    let ids = [RequestId(10), RequestId(11), RequestId(12)];
    for id in ids {
        sender.open_request(now, send_request(id, &[0])).unwrap();
        sender.cancel(now, id).unwrap();
        sender.retire(now, id).unwrap();
    }
    // Only one id is remembered exactly, yet none of the three can be opened again.
    for id in ids {
        assert_eq!(
            sender.open_request(now, send_request(id, &[0])),
            Err(UsageError::Retired(id)),
            "{id}"
        );
        assert_eq!(sender.phase(id), Some(SendPhase::Retired));
    }
    sender
        .open_request(now, send_request(RequestId(13), &[0]))
        .unwrap();
    let mut config = receiver_config(0);
    config.max_retired = 1;
    let mut receiver = kvpipe_core::Receiver::new(config).unwrap();
    for id in ids {
        receiver.register(now, registration(id, 16, &[0])).unwrap();
        receiver.cancel(now, id).unwrap();
        receiver.retire(now, id).unwrap();
    }
    for id in ids {
        assert_eq!(
            receiver.register(now, registration(id, 16, &[0])),
            Err(UsageError::Retired(id))
        );
    }
}
