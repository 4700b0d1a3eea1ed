//! The aux deadline gives one outcome on both sides: whatever order the engine's aux data, the
//! timers and the frames come in at or after the deadline, the sender never reports `Completed`
//! while the receiver reports a timeout (or the other way round).
//!
//! The driver here is the one an engine-driven pair is: nothing polls the timers between the
//! last chunk and the engine's late `submit_aux`, so the aux data and the deadlines meet at the
//! same `now`.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{Event, ReceiverInput, TransportInput, Wait};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{Duration, Instant, RequestId, Sender};
use session_support::*;

const R: RequestId = RequestId(33);

fn aux_data() -> AuxData {
    AuxData {
        prompt_tokens: 16,
        cached_tokens: 0,
        first_tokens: vec![42],
        draft_tokens: vec![],
    }
}

/// A connected pair (sender aux wait `sender_wait`, receiver aux wait `receiver_wait`) whose
/// whole 16-token request was submitted as one last chunk at the returned instant; its writes
/// landed and its last result reached the receiver at that same instant. Peers stay live for
/// 10 s without heartbeats, so only the aux deadline is in play.
fn last_chunk_sent(sender_wait: u64, receiver_wait: u64) -> (Net, Instant) {
    let mut net = Net::new(1, 1);
    let mut s = sender_config(0);
    s.deadlines.aux_wait = Duration::from_millis(sender_wait);
    s.deadlines.liveness_timeout = Duration::from_secs(10);
    net.senders[0] = Sender::new(s).unwrap();
    let mut r = receiver_config(0);
    r.deadlines.aux_wait = Duration::from_millis(receiver_wait);
    r.deadlines.liveness_timeout = Duration::from_secs(10);
    net.receivers[0] = kvpipe_core::Receiver::new(r).unwrap();
    net.connect(0, 0);
    net.pump();
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    let at = net.now;
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    (net, at)
}

/// The request's terminal event on `side` (completed, failed, timed out or cancelled).
fn outcome(net: &Net, side: Side) -> Option<Event> {
    net.events(side).into_iter().find(|e| {
        matches!(
            e,
            Event::Completed { .. }
                | Event::Failed { .. }
                | Event::TimedOut { .. }
                | Event::Cancelled { .. }
        )
    })
}

fn completed(net: &Net, side: Side) -> bool {
    matches!(outcome(net, side), Some(Event::Completed { .. }))
}

/// Both sides ended, and either both completed or neither did.
fn assert_agree(net: &Net) {
    let (s, r) = (
        outcome(net, Side::Sender(0)),
        outcome(net, Side::Receiver(0)),
    );
    assert!(s.is_some() && r.is_some(), "both sides end: {s:?} / {r:?}");
    assert_eq!(
        completed(net, Side::Sender(0)),
        completed(net, Side::Receiver(0)),
        "split outcome: sender {s:?}, receiver {r:?}"
    );
}

fn receiver_timer(net: &mut Net) {
    let now = net.now;
    net.receivers[0]
        .handle_input(ReceiverInput::Transport {
            now,
            input: TransportInput::Timeout,
        })
        .unwrap();
}

fn sender_timed_out_on_aux(net: &Net) -> bool {
    outcome(net, Side::Sender(0))
        == Some(Event::TimedOut {
            request: R,
            waiting_for: Wait::Aux,
        })
}

/// The reviewer's case: aux wait 300 ms on both sides, the engine's aux data 500 ms after the
/// last chunk, and the receiver's timer poll runs before the aux frame reaches it.
#[test]
fn late_aux_with_the_receiver_timer_first_times_out_on_both_sides() {
    let (mut net, last) = last_chunk_sent(300, 300);
    net.now = last + Duration::from_millis(500);
    let now = net.now;
    let _ = net.senders[0].submit_aux(now, R, aux_data());
    receiver_timer(&mut net);
    net.pump();
    assert_agree(&net);
    assert!(
        sender_timed_out_on_aux(&net),
        "{:?}",
        net.events(Side::Sender(0))
    );
    assert_eq!(
        outcome(&net, Side::Receiver(0)),
        Some(Event::TimedOut {
            request: R,
            waiting_for: Wait::Aux,
        })
    );
}

/// The same late aux data, delivered before the receiver's timer poll: the sender times out as
/// its timer would have, and tells the receiver.
#[test]
fn late_aux_with_the_frame_first_times_out_on_both_sides() {
    let (mut net, last) = last_chunk_sent(300, 300);
    net.now = last + Duration::from_millis(500);
    let now = net.now;
    let _ = net.senders[0].submit_aux(now, R, aux_data());
    net.pump();
    receiver_timer(&mut net);
    net.pump();
    assert_agree(&net);
    assert!(sender_timed_out_on_aux(&net));
    assert!(!net
        .frames(Side::Sender(0))
        .iter()
        .any(|f| matches!(f, kvpipe_core::wire::Frame::AuxResult(_))));
    net.advance(Duration::from_millis(1_000));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Quiesced));
}
