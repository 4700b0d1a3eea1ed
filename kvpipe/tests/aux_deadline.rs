//! The aux deadline over the in-process pair driven only by the engine's calls: aux data that
//! comes after the deadline ends the request the same way on both sides, and the engine's call
//! says the request already ended.

mod common;

use std::time::Duration;

use common::{configs, first_token, open_request, wait_for, Sides};
use kvpipe::kvpipe_core::session::Wait;
use kvpipe::{
    mem_pair, BlockId, BlockTables, EmbedError, Event, Node, RequestId, Role, Transport,
    UsageError, MEM_RECEIVER_PEER, MEM_SENDER_PEER,
};

/// The request's terminal event on `node` (completed, failed, timed out or cancelled).
fn outcome<E: Role>(node: &Node<E>, request: RequestId) -> Event {
    wait_for(node, "the request's end", |e| match e {
        Event::Completed { request: r, .. }
        | Event::TimedOut { request: r, .. }
        | Event::Cancelled { request: r, .. } => *r == request,
        _ => false,
    })
}

#[test]
fn aux_after_the_deadline_times_the_request_out_on_both_sides() {
    let mut sides = Sides::new();
    let (mut s, mut r) = configs(Transport::Mem);
    let aux_wait = kvpipe::kvpipe_core::Duration::from_millis(300);
    s.deadlines.aux_wait = aux_wait;
    r.deadlines.aux_wait = aux_wait;
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: `sides` outlives both nodes (dropped at the end of the block).
    {
        let (tx, rx) = unsafe { mem_pair(&s, &src, &r, &dst) }.unwrap();
        let request = RequestId(7);
        let table = open_request(&tx, &rx, request, MEM_RECEIVER_PEER, MEM_SENDER_PEER);
        let groups: [&[Option<BlockId>]; 1] = [&table];
        let whole = common::whole_prompt();
        tx.submit_chunk(request, whole, &mut BlockTables { groups: &groups })
            .unwrap();
        // The engine computes its first token for longer than the aux wait, and nothing else
        // drives the pair meanwhile.
        std::thread::sleep(Duration::from_millis(500));
        let late = tx.submit_aux(request, first_token());
        assert!(
            matches!(late, Err(EmbedError::Usage(UsageError::SessionEnded(r))) if r == request),
            "{late:?}"
        );
        assert_eq!(
            outcome(&tx, request),
            Event::TimedOut {
                request,
                waiting_for: Wait::Aux
            }
        );
        // The decode side never completes: it hears of the sender's timeout (a failed terminal
        // result) or times out itself.
        let decode = wait_for(&rx, "the request's end (decode)", |e| {
            matches!(
                e,
                Event::Completed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. }
            ) || matches!(e, Event::Failed { request: r, .. } if *r == request)
        });
        assert!(!matches!(decode, Event::Completed { .. }), "{decode:?}");
        let quiesced = |e: &Event| matches!(e, Event::Quiesced { request: r } if *r == request);
        wait_for(&rx, "Quiesced (decode)", quiesced);
        wait_for(&tx, "Quiesced (prefill)", quiesced);
        tx.retire(request).unwrap();
        rx.retire(request).unwrap();
    }
    drop(sides);
}
