//! The aux deadline gives one outcome on both sides: whatever order the engine's aux data, the
//! timers and the frames come in at or after the deadline, the sender never reports `Completed`
//! while the receiver reports a timeout (or the other way round).
//!
//! The driver here is the one an engine-driven pair is: nothing polls the timers between the
//! last chunk and the engine's late `submit_aux`, so the aux data and the deadlines meet at the
//! same `now`.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{CancelOrigin, Event, ReceiverInput, TransportInput, UsageError, Wait};
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
    let answer = net.senders[0].submit_aux(now, R, aux_data());
    receiver_timer(&mut net);
    net.pump();
    assert_agree(&net);
    assert!(
        sender_timed_out_on_aux(&net),
        "{:?}",
        net.events(Side::Sender(0))
    );
    assert_eq!(answer, Err(UsageError::SessionEnded(R)));
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
    let answer = net.senders[0].submit_aux(now, R, aux_data());
    assert!(matches!(answer, Err(UsageError::SessionEnded(R))));
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

/// A deadline that has passed at `now` wins over an input at `now`: aux data at the deadline
/// instant itself is late, one nanosecond before it is in time.
#[test]
fn aux_at_the_deadline_instant_is_late_and_just_before_is_in_time() {
    let (mut net, last) = last_chunk_sent(300, 300);
    net.now = last + Duration::from_millis(300);
    let now = net.now;
    assert!(net.senders[0].submit_aux(now, R, aux_data()).is_err());
    net.pump();
    assert_agree(&net);
    assert!(sender_timed_out_on_aux(&net));

    let (mut net, last) = last_chunk_sent(300, 300);
    net.now = last + Duration::from_nanos(300_000_000 - 1);
    let now = net.now;
    net.senders[0].submit_aux(now, R, aux_data()).unwrap();
    net.pump();
    assert_agree(&net);
    assert!(completed(&net, Side::Sender(0)));
}

/// After the sender's timer already timed the session out, a late aux gets the same answer.
#[test]
fn late_aux_after_the_timer_ran_gets_the_same_answer() {
    let (mut net, _) = last_chunk_sent(300, 300);
    net.advance(Duration::from_millis(500));
    assert!(sender_timed_out_on_aux(&net));
    let now = net.now;
    assert_eq!(
        net.senders[0].submit_aux(now, R, aux_data()),
        Err(UsageError::SessionEnded(R))
    );
    assert_agree(&net);
}

/// The late aux's timeout is recorded: a fresh sender replaying the recorded inputs produces
/// the same outputs.
#[test]
fn a_late_aux_replays_into_the_same_outputs() {
    let mut net = Net::new(1, 1);
    net.senders[0].record_inputs(true);
    net.connect(0, 0);
    net.pump();
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    // Past the aux deadline (300 ms), before the peers' liveness deadline (400 ms).
    net.now += Duration::from_millis(350);
    let now = net.now;
    assert!(net.senders[0].submit_aux(now, R, aux_data()).is_err());
    net.pump();
    let inputs = net.senders[0].take_recorded_inputs();
    let original: Vec<_> = net
        .log
        .iter()
        .filter(|(s, _)| *s == Side::Sender(0))
        .map(|(_, o)| o.clone())
        .collect();
    let mut replay = Sender::new(sender_config(0)).unwrap();
    let mut outputs = Vec::new();
    for input in inputs {
        replay.handle_input(input).unwrap();
        while let Some(o) = replay.poll_output() {
            outputs.push(o);
        }
    }
    assert_eq!(outputs, original);
    assert!(
        outputs.contains(&kvpipe_core::session::Output::Event(Event::TimedOut {
            request: R,
            waiting_for: Wait::Aux,
        }))
    );
}

/// The aux frame reaches the receiver after the receiver's own deadline (its aux wait is
/// shorter than the sender's) but before its timer poll: the sender accepted the aux data in
/// time and reported `Completed`, so the receiver completes too rather than contradict it.
#[test]
fn aux_in_time_for_the_sender_but_late_for_the_receiver_completes_on_both_sides() {
    let (mut net, last) = last_chunk_sent(300, 100);
    net.now = last + Duration::from_millis(200);
    let now = net.now;
    net.senders[0].submit_aux(now, R, aux_data()).unwrap();
    net.pump();
    assert_agree(&net);
    assert!(completed(&net, Side::Receiver(0)));
}

/// The receiver's deadline comes first and its timer runs: it times out and tells the sender,
/// which has not completed: neither side completes, and later aux data is refused.
#[test]
fn the_receiver_deadline_first_stops_the_sender_too() {
    let (mut net, last) = last_chunk_sent(300, 100);
    net.advance(Duration::from_millis(150));
    assert_eq!(
        outcome(&net, Side::Receiver(0)),
        Some(Event::TimedOut {
            request: R,
            waiting_for: Wait::Aux,
        })
    );
    // The receiver's cancel reached the sender while it waited for the aux data.
    assert_eq!(
        outcome(&net, Side::Sender(0)),
        Some(Event::Cancelled {
            request: R,
            origin: CancelOrigin::Peer(rx_peer(0)),
        })
    );
    let now = last + Duration::from_millis(200);
    net.now = now;
    assert_eq!(
        net.senders[0].submit_aux(now, R, aux_data()),
        Err(UsageError::SessionEnded(R))
    );
    net.pump();
    assert_agree(&net);
}
