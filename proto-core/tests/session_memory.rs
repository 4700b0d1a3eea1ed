//! Memory does not grow with the number of requests served: a sender and a receiver that
//! complete, quiesce and retire requests in waves hold, after a warm-up, the same heap however
//! many more requests they serve. Counted by a global allocator (live bytes), not timed.
//!
//! The only test in this file: the allocator counts the whole process.

mod session_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use kvpipe_core::session::{Event, Output};
use kvpipe_core::{AnchoredRun, BlockId, Duration, RequestId};
use session_support::*;

/// Forwards to the system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

fn bytes(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract is `System`'s; the counter is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded (the caller's layout has a non-zero size).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(bytes(layout.size()), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded (`ptr` came from this allocator with `layout`).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(bytes(layout.size()), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded (`ptr` came from this allocator with `layout`).
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(bytes(new_size) - bytes(layout.size()), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Requests open at once.
const WAVE: u64 = 8;
/// Virtual time between waves: 80 requests a second, so the warm-up (72,000 requests, 15
/// minutes) outlasts every deadline and any memory kept for a time horizon (retired ids are
/// remembered for up to two minutes) many times over.
const PACE: Duration = Duration::from_millis(100);

/// Serves `count` one-block requests from `next` on, `WAVE` at a time: each is registered,
/// opened, sent, completed, quiesced and retired on both sides.
fn serve(net: &mut Net, next: &mut u64, count: u64) {
    for _ in 0..count / WAVE {
        for k in 0..WAVE {
            let request = RequestId(*next + k);
            let mut reg = registration(request, TPB, &[0]);
            reg.groups = vec![AnchoredRun::from_ids(0, &[BlockId(500 + k as u32)])];
            net.register(0, reg);
            net.open(0, send_request(request, &[0]));
            let mut source = TestSource::with(request, 100 + k as u32, 1);
            net.submit(0, request, chunk(0, TPB, TPB, true), &mut source);
            net.aux(0, request);
        }
        let mut quiesced = 0;
        for (side, output) in std::mem::take(&mut net.log) {
            let now = net.now;
            match output {
                Output::Event(Event::Quiesced { request }) => {
                    match side {
                        Side::Sender(i) => net.senders[i].retire(now, request).unwrap(),
                        Side::Receiver(j) => net.receivers[j].retire(now, request).unwrap(),
                    }
                    quiesced += 1;
                }
                Output::Event(
                    e @ (Event::Failed { .. } | Event::TimedOut { .. } | Event::Cancelled { .. }),
                ) => panic!("{side:?}: {e:?}"),
                _ => {}
            }
        }
        assert_eq!(quiesced, 2 * WAVE, "every request quiesced on both sides");
        *next += WAVE;
        net.advance(PACE);
        net.log.clear();
    }
}

#[test]
fn heap_does_not_grow_with_requests_served() {
    let mut net = Net::connected(1, 1);
    let mut next = 1;
    // Past every bound the endpoints keep by count (65,536 retired ids) or by time.
    serve(&mut net, &mut next, 72_000);
    let warm = LIVE.load(Ordering::Relaxed);
    serve(&mut net, &mut next, 40_000);
    let end = LIVE.load(Ordering::Relaxed);
    eprintln!("live heap after the warm-up {warm} bytes, 40,000 requests later {end} bytes");
    assert_eq!(net.senders[0].session_count(), 0);
    assert_eq!(net.receivers[0].session_count(), 0);
    // A leak of one byte per request would be 40,000 bytes; what the endpoints keep in steady
    // state moves by far less.
    assert!(
        end - warm < 16 * 1024,
        "the heap grew by {} bytes over 40,000 requests after the warm-up ({warm} → {end})",
        end - warm
    );
}
