//! Event traces of scripted scenarios, snapshotted: every output of both endpoints in the order
//! drained. A change in what the endpoints emit, or in its order, shows up as a reviewed diff.

mod session_support;

use std::fmt::Write as _;

use kvpipe_core::session::Output;
use kvpipe_core::wire::TransferStatus;
use kvpipe_core::{Duration, RequestId};
use session_support::*;

const R: RequestId = RequestId(5);

fn render(net: &Net) -> String {
    let mut out = String::new();
    for (side, o) in &net.log {
        let who = match side {
            Side::Sender(i) => format!("S{i}"),
            Side::Receiver(j) => format!("R{j}"),
        };
        let _ = match o {
            Output::Transmit { peer, frame, .. } => writeln!(out, "{who} -> {peer}: {frame}"),
            Output::ExecuteWrites {
                peer,
                batch,
                request,
                slice,
                grant,
                plan,
                ..
            } => writeln!(
                out,
                "{who} execute {batch} to {peer}: {request} {slice} {grant} {} extents {} bytes",
                plan.extents().len(),
                plan.total_bytes()
            ),
            Output::ClosePeer { peer, reason } => writeln!(out, "{who} close {peer}: {reason:?}"),
            Output::Event(e) => writeln!(out, "{who} event {e:?}"),
            Output::DataPath(n) => writeln!(out, "{who} data path {n:?}"),
        };
    }
    out
}

#[test]
fn trace_two_chunk_transfer() {
    let mut net = Net::connected(1, 1);
    let mut source = TestSource::with(R, 100, 4);
    net.register(0, registration(R, 16, &[0]));
    net.open(0, send_request(R, &[0]));
    net.submit(0, R, chunk(0, 6, 16, false), &mut source);
    net.submit(0, R, chunk(6, 16, 16, true), &mut source);
    net.aux(0, R);
    insta::assert_snapshot!(render(&net));
}

#[test]
fn trace_write_failure_with_a_batch_in_flight() {
    let (mut net, mut source) = Net::first_chunk_held(R);
    net.submit(0, R, chunk(8, 16, 16, true), &mut source);
    net.fail_held(1, TransferStatus::WriteFailed);
    net.complete_held(0);
    insta::assert_snapshot!(render(&net));
}

#[test]
fn trace_receiver_fence_after_lost_confirmation() {
    let (mut net, _) = Net::first_chunk_held(R);
    net.cut.insert((0, 0));
    let now = net.now;
    net.receivers[0].cancel(now, R).unwrap();
    net.pump();
    net.advance(Duration::from_millis(150));
    insta::assert_snapshot!(render(&net));
}
