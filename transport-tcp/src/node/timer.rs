//! The timer thread: delivers the endpoint's timeouts, drops bundles that stayed incomplete past
//! the preamble timeout, and aborts orderly closes that passed their deadline.

use std::time::Duration as StdDuration;

use kvpipe_core::{Endpoint, TransportInput};

use super::link::LinkPhase;
use super::{NodePhase, Shared};

/// Longest sleep between checks.
const MAX_SLEEP: StdDuration = StdDuration::from_millis(500);

pub(super) fn run<E: Endpoint + Send + 'static>(shared: &Shared<E>) {
    let mut st = shared.state.lock();
    loop {
        if matches!(st.phase, NodePhase::Stopped) {
            return;
        }
        let now = shared.now();
        let wall = std::time::Instant::now();
        if st.endpoint.poll_timeout().is_some_and(|at| at <= now) {
            st.feed(now, TransportInput::Timeout);
            shared.drain(&mut st, now);
            continue;
        }
        let timeout = shared.config.preamble_timeout;
        let mut wake = wall + MAX_SLEEP;
        let mut stale = Vec::new();
        for (peer, link) in st.links.iter_mut() {
            match link.deadline(timeout) {
                Some(at) if at <= wall => match link.phase {
                    LinkPhase::Assembling { .. } => stale.push(peer),
                    _ => {
                        link.abort();
                    }
                },
                Some(at) => wake = wake.min(at),
                None => {}
            }
        }
        for peer in stale {
            // The core never heard of it; its sockets close with the link.
            st.links.remove(peer);
        }
        if let Some(at) = st.endpoint.poll_timeout().and_then(|at| shared.wall(at)) {
            wake = wake.min(at);
        }
        st.timer_at = Some(wake);
        shared.timer.wait_until(&mut st, wake);
        st.timer_at = None;
    }
}
