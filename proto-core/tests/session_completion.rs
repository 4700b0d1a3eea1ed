//! Completion rules: a sender session completes only after its last slice and the aux data; a
//! receiver completes after one successful last result from each expected writer plus the aux
//! data. Counters follow.

mod session_support;

use kvpipe_core::session::state::{RecvPhase, SendPhase};
use kvpipe_core::session::{Event, Output, SenderInput, UsageError};
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::RequestId;
use session_support::*;

const R: RequestId = RequestId(3);

fn completed(net: &Net, side: Side) -> bool {
    net.events(side)
        .iter()
        .any(|e| matches!(e, Event::Completed { request, .. } if *request == R))
}

#[test]
fn intermediate_chunk_never_completes_the_sender() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.aux(0, R);
    assert!(!completed(&net, Side::Sender(0)));
    assert!(!completed(&net, Side::Receiver(0)));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Streaming));
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    assert!(completed(&net, Side::Sender(0)));
    assert!(completed(&net, Side::Receiver(0)));
}

#[test]
fn sender_completes_only_after_the_aux_data() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Finishing));
    assert!(!completed(&net, Side::Sender(0)));
    assert!(
        !completed(&net, Side::Receiver(0)),
        "the receiver waits for the aux data"
    );
    net.aux(0, R);
    assert!(completed(&net, Side::Sender(0)));
    let ev = net.events(Side::Receiver(0));
    let aux = ev
        .iter()
        .find_map(|e| match e {
            Event::Completed {
                aux, bytes_written, ..
            } => Some((aux.clone(), *bytes_written)),
            _ => None,
        })
        .expect("receiver completed");
    assert_eq!(aux.0.unwrap().first_tokens, vec![42]);
    assert_eq!(aux.1, 4 * BLOCK_BYTES);
    // Completed is followed by Quiesced on both sides, and then both may retire.
    for side in [Side::Sender(0), Side::Receiver(0)] {
        let ev = net.events(side);
        let c = ev
            .iter()
            .position(|e| matches!(e, Event::Completed { .. }))
            .unwrap();
        assert_eq!(ev[c + 1], Event::Quiesced { request: R });
    }
    let now = net.now;
    net.senders[0].retire(now, R).unwrap();
    net.receivers[0].retire(now, R).unwrap();
    assert_eq!(net.senders[0].session_count(), 0);
    assert_eq!(net.receivers[0].session_count(), 0);
}

#[test]
fn aux_is_sent_after_the_last_result() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.aux(0, R); // early aux data waits for the KV
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    let frames = net.frames(Side::Sender(0));
    let last = frames
        .iter()
        .position(|f| matches!(f, Frame::KvResult(r) if r.is_last))
        .unwrap();
    let aux = frames
        .iter()
        .position(|f| matches!(f, Frame::AuxResult(_)))
        .unwrap();
    assert!(last < aux);
}

#[test]
fn receiver_waits_for_every_expected_writer() {
    let mut net = Net::tensor_parallel(2);
    let mut s0 = TestSource::with(R, 100, 4);
    let mut s1 = TestSource::with(R, 300, 4);
    net.register(0, registration(R, 16, &[0, 1]));
    net.open(0, send_request(R, &[0]));
    net.open(1, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut s0);
    net.aux(0, R);
    assert!(
        !completed(&net, Side::Receiver(0)),
        "writer 1 has not finished"
    );
    // Writer 0 sent everything, and completes only when the receiver does.
    assert!(!completed(&net, Side::Sender(0)));
    assert_eq!(net.senders[0].phase(R), Some(SendPhase::Finishing));
    assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Receiving));
    net.submit(1, R, chunk(0, 8, 16, false), &mut s1);
    assert!(
        !completed(&net, Side::Receiver(0)),
        "an intermediate result is not the last"
    );
    net.submit(1, R, chunk(8, 16, 16, true), &mut s1);
    assert!(
        !completed(&net, Side::Receiver(0)),
        "every writer sends its aux data"
    );
    net.aux(1, R);
    assert!(completed(&net, Side::Receiver(0)));
    assert!(completed(&net, Side::Sender(0)));
    assert!(completed(&net, Side::Sender(1)));
    assert_eq!(net.receivers[0].counters().bytes_written, 8 * BLOCK_BYTES);
}

#[test]
fn writers_whose_aux_data_differ_fail_the_request() {
    let mut net = Net::tensor_parallel(2);
    let mut s0 = TestSource::with(R, 100, 4);
    let mut s1 = TestSource::with(R, 300, 4);
    net.register(0, registration(R, 16, &[0, 1]));
    net.open(0, send_request(R, &[0]));
    net.open(1, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut s0);
    net.submit(1, R, chunk(0, 16, 16, true), &mut s1);
    net.aux(0, R);
    let now = net.now;
    let other = kvpipe_core::wire::AuxData {
        first_tokens: vec![43],
        ..Default::default()
    };
    net.senders[1].submit_aux(now, R, other).unwrap();
    net.pump();
    assert!(net.events(Side::Receiver(0)).iter().any(|e| matches!(
        e,
        Event::Failed {
            cause: TransferStatus::ProtocolError,
            ..
        }
    )));
    assert!(!completed(&net, Side::Receiver(0)));
}

#[test]
fn a_request_with_several_beams_is_refused_when_opened() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    let request = SendRequest {
        beam_width: 4,
        ..send_request(R, &[0])
    };
    let err = net.senders[0].open_request(now, request).unwrap_err();
    assert_eq!(
        err,
        UsageError::Unsupported {
            request: R,
            error: kvpipe_core::ConfigError::BeamWidth(4)
        }
    );
    assert!(err.to_string().contains("beam width"));
    assert_eq!(net.senders[0].session_count(), 0);
}

#[test]
fn an_unsupported_configuration_is_refused_at_start() {
    let mut config = sender_config(0);
    config.pipeline.chunked_prefill = false;
    assert_eq!(
        kvpipe_core::Sender::new(config).err(),
        Some(kvpipe_core::ConfigError::ChunkedPrefillOff)
    );
    let mut config = receiver_config(0);
    config.pipeline.bounce_buffer = true;
    assert_eq!(
        kvpipe_core::Receiver::new(config).err(),
        Some(kvpipe_core::ConfigError::BounceBuffer)
    );
}

use kvpipe_core::session::SendRequest;

#[test]
fn one_sender_writes_to_several_receivers() {
    let mut net = Net::connected(1, 2);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0, 1]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    net.aux(0, R);
    assert!(completed(&net, Side::Receiver(0)));
    assert!(
        !completed(&net, Side::Sender(0)),
        "receiver 1 has not registered"
    );
    net.register(1, registration(R, 16, &[0]));
    assert!(completed(&net, Side::Receiver(1)));
    assert!(completed(&net, Side::Sender(0)));
    // The chunk's blocks were queried once, not once per receiver.
    assert_eq!(source.queries.len(), 1);
}

#[test]
fn counters_report_bytes_slices_and_results() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    net.aux(0, R);
    let now = net.now;
    net.senders[0].retire(now, R).unwrap();
    let c = *net.senders[0].counters();
    assert_eq!(c.bytes_planned, 4 * BLOCK_BYTES);
    assert_eq!(c.bytes_written, 4 * BLOCK_BYTES);
    assert_eq!(c.slices, 2);
    assert_eq!(c.write_batches, 2);
    assert_eq!(c.results.get(TransferStatus::Success), 2);
    assert_eq!(c.results.total(), 2);
    assert_eq!(c.completions, 1);
    assert_eq!(c.retirements, 1);
    assert_eq!(c.failures.total(), 0);
    let rc = *net.receivers[0].counters();
    assert_eq!(rc.results.get(TransferStatus::Success), 2);
    assert_eq!(rc.bytes_written, 4 * BLOCK_BYTES);
    assert_eq!(rc.completions, 1);
}

#[test]
fn aux_usage_errors_leave_the_session_unchanged() {
    let mut net = Net::connected(1, 1);
    let now = net.now;
    let data = kvpipe_core::wire::AuxData::default();
    assert_eq!(
        net.senders[0].handle_input(SenderInput::Aux {
            now,
            request: RequestId(99),
            data: data.clone()
        }),
        Err(UsageError::UnknownRequest(RequestId(99)))
    );
    net.open(0, send_request(RequestId(4), &[0]));
    net.senders[0]
        .handle_input(SenderInput::Aux {
            now,
            request: RequestId(4),
            data: data.clone(),
        })
        .unwrap();
    assert_eq!(
        net.senders[0].handle_input(SenderInput::Aux {
            now,
            request: RequestId(4),
            data
        }),
        Err(UsageError::AuxAlreadySubmitted(RequestId(4)))
    );
}

#[test]
fn completion_reports_when_each_milestone_happened() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.advance(kvpipe_core::Duration::from_millis(10));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    net.advance(kvpipe_core::Duration::from_millis(10));
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    net.advance(kvpipe_core::Duration::from_millis(5));
    net.aux(0, R);
    let timings = |side| {
        net.events(side)
            .into_iter()
            .find_map(|e| match e {
                Event::Completed { timings, .. } => Some(timings),
                _ => None,
            })
            .expect("completed")
    };
    let t0 = kvpipe_core::Instant::from_millis(1);
    let ms = |m| t0 + kvpipe_core::Duration::from_millis(m);
    let s = timings(Side::Sender(0));
    assert_eq!(s.started, t0);
    assert_eq!(s.first_chunk, Some(ms(10)));
    assert_eq!(s.first_byte, Some(ms(10)));
    assert_eq!(s.last_chunk, Some(ms(20)));
    assert_eq!(s.last_byte, Some(ms(20)));
    assert_eq!(s.ended, ms(25));
    assert_eq!(s.tail(), Some(kvpipe_core::Duration::from_millis(5)));
    assert_eq!(s.writes, 2);
    let r = timings(Side::Receiver(0));
    assert_eq!((r.first_chunk, r.last_chunk), (None, None));
    assert_eq!(r.first_byte, Some(ms(10)));
    assert_eq!(r.transfer(), Some(kvpipe_core::Duration::from_millis(10)));
    assert_eq!(r.writes, 2);
    assert_eq!(r.ended, ms(25));
    // The last slice's data began to arrive when the last chunk was submitted (each slice's
    // result came before the next chunk): the decode side's tail is the sender's.
    assert_eq!(r.last_burst, Some(ms(20)));
    assert_eq!(
        r.receiver_tail(),
        Some(kvpipe_core::Duration::from_millis(5))
    );
    assert_eq!(s.last_burst, None, "the sender admits no data");
}

fn completion_timings(net: &Net, side: Side) -> kvpipe_core::session::RequestTimings {
    net.events(side)
        .into_iter()
        .find_map(|e| match e {
            Event::Completed { timings, .. } => Some(timings),
            _ => None,
        })
        .expect("completed")
}

#[test]
fn overlapping_slices_keep_the_burst_where_the_pipeline_last_drained() {
    let (mut net, mut source) = Net::held_pair(R, 16);
    let t0 = net.now;
    let ms = |m| t0 + kvpipe_core::Duration::from_millis(m);
    net.advance(kvpipe_core::Duration::from_millis(10));
    net.submit(0, R, chunk(0, 8, 16, false), &mut source);
    // The first slice's data lands, but its result is not sent yet when the second slice's
    // data arrives: the slices overlap.
    let first = net.held[0].clone();
    net.land(0, 0, &first.plan, &first.headers);
    net.advance(kvpipe_core::Duration::from_millis(10));
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    let second = net.held[1].clone();
    net.land(0, 0, &second.plan, &second.headers);
    net.held.clear();
    for batch in [first.batch, second.batch] {
        let now = net.now;
        net.senders[0]
            .handle_input(SenderInput::Transport {
                now,
                input: kvpipe_core::TransportInput::WritesCompleted { batch },
            })
            .unwrap();
        net.pump();
    }
    net.advance(kvpipe_core::Duration::from_millis(5));
    net.aux(0, R);
    let r = completion_timings(&net, Side::Receiver(0));
    assert_eq!(r.last_burst, Some(ms(10)));
    assert_eq!(
        r.receiver_tail(),
        Some(kvpipe_core::Duration::from_millis(15))
    );
}

fn aux_of(tokens: u32) -> kvpipe_core::wire::AuxData {
    kvpipe_core::wire::AuxData {
        prompt_tokens: 16,
        cached_tokens: 0,
        first_tokens: (0..tokens).collect(),
        draft_tokens: vec![],
    }
}

fn failed(net: &Net, side: Side, status: TransferStatus) -> bool {
    net.events(side).iter().any(
        |e| matches!(e, Event::Failed { request, cause, .. } if *request == R && *cause == status),
    )
}

#[test]
fn aux_larger_than_a_registered_slot_is_refused_at_the_call_changing_nothing() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    // Net::aux's data (one token) takes 20 bytes: the slot holds exactly that.
    let mut reg = registration(R, 16, &[0]);
    reg.aux_capacity = 20;
    net.register(0, reg);
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    let phase = net.senders[0].phase(R);
    let events = net.events(Side::Sender(0)).len();
    let now = net.now;
    let err = net.senders[0]
        .handle_input(SenderInput::Aux {
            now,
            request: R,
            data: aux_of(100),
        })
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::AuxOverSlot {
            request: R,
            peer: rx_peer(0),
            len: 416,
            capacity: 20
        }
    );
    assert!(err.to_string().contains("416") && err.to_string().contains("20"));
    net.pump();
    assert_eq!(net.senders[0].phase(R), phase);
    assert_eq!(net.events(Side::Sender(0)).len(), events);
    // Nothing was taken: aux data that fits still completes both sides.
    net.aux(0, R);
    assert!(completed(&net, Side::Sender(0)));
    assert!(completed(&net, Side::Receiver(0)));
}

#[test]
fn aux_taken_before_a_smaller_slot_registers_fails_both_sides_and_never_completes() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 16, 16, true), &mut source);
    // No receiver registered yet: the slot's size is unknown, the data is taken.
    let now = net.now;
    net.senders[0]
        .handle_input(SenderInput::Aux {
            now,
            request: R,
            data: aux_of(100),
        })
        .unwrap();
    net.pump();
    let mut reg = registration(R, 16, &[0]);
    reg.aux_capacity = 16;
    net.register(0, reg);
    for side in [Side::Sender(0), Side::Receiver(0)] {
        assert!(
            failed(&net, side, TransferStatus::ProtocolError),
            "{side:?}"
        );
        assert!(!completed(&net, side), "{side:?}");
    }
    assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
        e,
        Event::ProtocolViolation { error, .. }
            if error.to_string().contains("416 bytes, the aux slot holds 16")
    )));
}

/// The receiver's transfer time runs from its first write's admission (its bytes began to
/// arrive) to its last landing: a request of one write that takes 5 ms to land reports 5 ms,
/// not zero.
#[test]
fn the_receivers_transfer_starts_when_its_first_write_is_admitted() {
    use kvpipe_core::session::Admission;
    use kvpipe_core::Duration;
    let mut net = Net::connected(1, 1);
    net.auto_complete = false;
    let mut source = TestSource::with(R, 100, 1);
    net.register(0, registration(R, 4, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 4, 4, true), &mut source);
    let h = net.held.remove(0);
    assert_eq!(h.plan.extents().len(), 1, "one write");
    let admitted_at = net.now;
    let e = &h.plan.extents()[0];
    let header = h.headers.frame(e.dst_region, e.dst_offset, e.len);
    let Admission::Apply { ticket, .. } =
        net.receivers[0].admit_write(admitted_at, tx_peer(0), &header)
    else {
        panic!("the write was not admitted")
    };
    net.now = admitted_at + Duration::from_millis(5);
    net.write_landed(0, ticket);
    let now = net.now;
    net.senders[0]
        .handle_input(SenderInput::Transport {
            now,
            input: kvpipe_core::TransportInput::WritesCompleted { batch: h.batch },
        })
        .unwrap();
    net.pump();
    net.aux(0, R);
    let timings = net
        .events(Side::Receiver(0))
        .iter()
        .find_map(|e| match e {
            Event::Completed { timings, .. } => Some(*timings),
            _ => None,
        })
        .expect("completed");
    assert_eq!(timings.first_byte, Some(admitted_at));
    assert_eq!(timings.transfer(), Some(Duration::from_millis(5)));
}

/// The writer completes only on the receiver's word (`RecvComplete`): everything sent is not
/// everything received.
mod writer_waits_for_the_receiver {
    use super::*;
    use kvpipe_core::session::{CancelOrigin, Sender, Wait};
    use kvpipe_core::Duration;

    /// Receiver 0 registered `R`, the sender opened it towards `receivers` and sent its one
    /// chunk and the aux data; with `unheard`, none of the sender's frames to receiver 0
    /// arrive from before the chunk on.
    fn sent_whole(net: &mut Net, receivers: &[usize], unheard: bool) {
        let mut source = TestSource::with(R, 100, 4);
        net.register(0, registration(R, 16, &[0]));
        net.open(0, send_request(R, receivers));
        if unheard {
            net.stalled.insert((0, 0));
        }
        net.submit(0, R, chunk(0, 16, 16, true), &mut source);
        net.aux(0, R);
    }

    fn sent_everything_unheard() -> Net {
        let mut net = Net::connected(1, 1);
        // The sender's last result and aux data do not arrive.
        sent_whole(&mut net, &[0], true);
        assert_eq!(net.senders[0].phase(R), Some(SendPhase::Finishing));
        assert!(!completed(&net, Side::Sender(0)));
        net
    }

    #[test]
    fn completes_after_the_receiver_did() {
        let mut net = Net::connected(1, 1);
        sent_whole(&mut net, &[0], false);
        let at = |side: Side| {
            net.position(|(s, o)| *s == side && matches!(o, Output::Event(Event::Completed { .. })))
        };
        let (rx, tx) = (at(Side::Receiver(0)), at(Side::Sender(0)));
        assert!(rx.is_some() && tx.is_some() && rx < tx, "{rx:?} {tx:?}");
        assert!(net
            .frames(Side::Receiver(0))
            .iter()
            .any(|f| matches!(f, Frame::RecvComplete(c) if c.request == R)));
    }

    #[test]
    fn a_cancel_from_the_receiver_before_it_completed_cancels_the_writer_too() {
        let mut net = sent_everything_unheard();
        net.receivers[0].cancel(net.now, R).unwrap();
        net.pump();
        assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
            e,
            Event::Cancelled { request, origin: CancelOrigin::Peer(_) } if *request == R
        )));
        assert!(!completed(&net, Side::Sender(0)));
        assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    }

    #[test]
    fn a_receiver_lost_before_it_completed_fails_the_writer() {
        let mut net = sent_everything_unheard();
        net.disconnect(0, 0);
        net.pump();
        assert!(net.events(Side::Sender(0)).iter().any(|e| matches!(
            e,
            Event::Failed { request, cause: TransferStatus::PeerLost, .. } if *request == R
        )));
        assert!(!completed(&net, Side::Sender(0)));
    }

    /// One sender waiting `result_wait` = 100 ms for its receivers' word (shorter than the
    /// liveness timeout, so that it is what fires), connected to `receivers` receivers.
    fn net_waiting_100_ms(receivers: usize) -> Net {
        let mut net = Net::new(1, receivers);
        let mut cfg = sender_config(0);
        cfg.deadlines.result_wait = Duration::from_millis(100);
        net.senders[0] = Sender::new(cfg).unwrap();
        for j in 0..receivers {
            net.connect(0, j);
        }
        net.pump();
        net
    }

    #[test]
    fn a_receiver_that_got_everything_late_gets_its_whole_wait() {
        // Receiver 0 has everything (and says so) at once; receiver 1 registers 200 ms later,
        // past the 100 ms completion wait counted from receiver 0. Its own wait starts when it
        // got everything.
        let mut net = net_waiting_100_ms(2);
        sent_whole(&mut net, &[0, 1], false);
        assert_eq!(net.receivers[0].phase(R), Some(RecvPhase::Completed));
        net.advance(Duration::from_millis(200));
        // Receiver 1's frames (the replayed results, the aux data) do not arrive.
        net.stalled.insert((0, 1));
        net.register(1, registration(R, 16, &[0]));
        let timed_out = |net: &Net| {
            net.events(Side::Sender(0)).iter().any(|e| {
                matches!(
                    e,
                    Event::TimedOut {
                        waiting_for: Wait::Completion,
                        ..
                    }
                )
            })
        };
        for step in 0..9 {
            net.advance(Duration::from_millis(10));
            assert!(!timed_out(&net), "after {}0 ms", step + 1);
        }
        net.advance(Duration::from_millis(5));
        net.advance(Duration::from_millis(100));
        assert!(timed_out(&net), "{:?}", net.events(Side::Sender(0)));
    }

    #[test]
    fn a_receiver_that_never_says_it_completed_times_the_writer_out() {
        // The completion is awaited for `result_wait`.
        let mut net = net_waiting_100_ms(1);
        sent_whole(&mut net, &[0], true);
        net.advance(Duration::from_millis(150));
        assert!(
            net.events(Side::Sender(0)).iter().any(|e| matches!(
                e,
                Event::TimedOut { request, waiting_for: Wait::Completion } if *request == R
            )),
            "{:?}",
            net.events(Side::Sender(0))
        );
        assert_eq!(net.senders[0].phase(R), Some(SendPhase::Quiesced));
    }
}
