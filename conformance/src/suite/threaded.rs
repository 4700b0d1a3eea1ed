//! The suite's [`Link`] over transports whose nodes run their endpoint on their own threads (TCP
//! and RDMA verbs): a sender node and a receiver node in this process. One implementation serves
//! both, since the two crates' nodes have the same shape (an endpoint behind a lock, events
//! queued with their times, write batches counted until reported).

use std::ops::DerefMut;
use std::time::Duration as StdDuration;

use kvpipe_core::wire::Role;
use kvpipe_core::{Event, Instant, PeerId, Receiver, Sender};

use super::{BatchTiming, Link, LinkError};

/// A transport node that runs one core endpoint on its own threads, as the suite drives it.
pub trait ThreadedNode {
    /// Exclusive access to the endpoint; the node's threads wait while it lives.
    type Guard: DerefMut;

    /// Takes the endpoint (see [`ThreadedNode::Guard`]).
    fn endpoint(&self) -> Self::Guard;
    /// The events the node queued since the last call, with the times they happened.
    fn take_events(&self) -> Vec<(Instant, Event)>;
}

/// A sender's node: it also counts its write batches.
pub trait ThreadedSenderNode: ThreadedNode {
    /// Write batches handed to the transport and not reported yet.
    fn writes_in_flight(&self) -> usize;
    /// `(bytes, issued, reported)` of recent write batches.
    fn batch_timings(&self) -> Vec<(u64, Instant, Instant)>;
    /// [`ThreadedSenderNode::writes_in_flight`] while `guard` holds the endpoint.
    fn writes_in_flight_held(guard: &Self::Guard) -> usize;
    /// [`ThreadedSenderNode::batch_timings`] while `guard` holds the endpoint.
    fn batch_timings_held(guard: &Self::Guard) -> Vec<(u64, Instant, Instant)>;
}

macro_rules! threaded_node {
    ($node:ty, $guard:ty) => {
        impl ThreadedNode for $node {
            type Guard = $guard;
            fn endpoint(&self) -> $guard {
                <$node>::endpoint(self)
            }
            fn take_events(&self) -> Vec<(Instant, Event)> {
                <$node>::take_events(self)
            }
        }
    };
    (sender $node:ty, $guard:ty) => {
        threaded_node!($node, $guard);
        impl ThreadedSenderNode for $node {
            fn writes_in_flight(&self) -> usize {
                <$node>::writes_in_flight(self)
            }
            fn batch_timings(&self) -> Vec<(u64, Instant, Instant)> {
                <$node>::batch_timings(self)
            }
            fn writes_in_flight_held(guard: &$guard) -> usize {
                guard.writes_in_flight()
            }
            fn batch_timings_held(guard: &$guard) -> Vec<(u64, Instant, Instant)> {
                guard.batch_timings()
            }
        }
    };
}

#[cfg(feature = "tcp")]
threaded_node!(sender kvpipe_tcp::TcpSender, kvpipe_tcp::EndpointGuard<Sender>);
#[cfg(feature = "tcp")]
threaded_node!(kvpipe_tcp::TcpReceiver, kvpipe_tcp::EndpointGuard<Receiver>);
#[cfg(feature = "verbs")]
threaded_node!(sender kvpipe_ibverbs::VerbsSender, kvpipe_ibverbs::EndpointGuard<Sender>);
#[cfg(feature = "verbs")]
threaded_node!(
    kvpipe_ibverbs::VerbsReceiver,
    kvpipe_ibverbs::EndpointGuard<Receiver>
);

/// A sender node and a receiver node in this process, as the suite drives them. `Keep` is held
/// until both nodes are gone (the TCP async driver's runtime, which their connections run on).
pub struct ThreadedLink<Tx: ThreadedNode, Rx: ThreadedNode, Keep = ()> {
    tx: Option<Tx>,
    rx: Option<Rx>,
    tx_guard: Option<Tx::Guard>,
    rx_guard: Option<Rx::Guard>,
    sender_peer: PeerId,
    receiver_peer: PeerId,
    origin: std::time::Instant,
    /// Dropped last (fields drop in order, after `Drop::drop` has stopped both nodes).
    #[allow(dead_code)]
    keep: Keep,
}

impl<Tx: ThreadedNode, Rx: ThreadedNode, Keep> ThreadedLink<Tx, Rx, Keep> {
    /// The link over two connected nodes; `origin` is the instant both nodes' clocks start at.
    pub(crate) fn new(
        tx: Tx,
        rx: Rx,
        sender_peer: PeerId,
        receiver_peer: PeerId,
        origin: std::time::Instant,
        keep: Keep,
    ) -> Self {
        ThreadedLink {
            tx: Some(tx),
            rx: Some(rx),
            tx_guard: None,
            rx_guard: None,
            sender_peer,
            receiver_peer,
            origin,
            keep,
        }
    }

    /// Hands both endpoints back to their nodes' threads.
    fn release(&mut self) {
        self.tx_guard = None;
        self.rx_guard = None;
    }
}

impl<Tx, Rx, Keep> Link for ThreadedLink<Tx, Rx, Keep>
where
    Tx: ThreadedSenderNode,
    Tx::Guard: DerefMut<Target = Sender>,
    Rx: ThreadedNode,
    Rx::Guard: DerefMut<Target = Receiver>,
{
    fn now(&self) -> Instant {
        Instant::from_nanos(self.origin.elapsed().as_nanos() as u64)
    }

    fn sender(&mut self) -> &mut Sender {
        if self.tx_guard.is_none() {
            let node = self.tx.as_ref().expect("the sender is alive");
            self.tx_guard = Some(node.endpoint());
        }
        self.tx_guard.as_mut().expect("just set")
    }

    fn receiver(&mut self) -> &mut Receiver {
        if self.rx_guard.is_none() {
            let node = self.rx.as_ref().expect("the receiver is alive");
            self.rx_guard = Some(node.endpoint());
        }
        self.rx_guard.as_mut().expect("just set")
    }

    fn sender_peer(&self) -> PeerId {
        self.sender_peer
    }

    fn receiver_peer(&self) -> PeerId {
        self.receiver_peer
    }

    fn pump(&mut self) -> Result<(), LinkError> {
        self.release();
        Ok(())
    }

    fn wait(&mut self, max: StdDuration) {
        self.release();
        std::thread::sleep(max.min(StdDuration::from_millis(1)));
    }

    fn take_events(&mut self) -> Vec<(Role, Instant, Event)> {
        self.release();
        let mut out: Vec<(Role, Instant, Event)> = Vec::new();
        if let Some(tx) = &self.tx {
            out.extend(
                tx.take_events()
                    .into_iter()
                    .map(|(at, e)| (Role::Sender, at, e)),
            );
        }
        if let Some(rx) = &self.rx {
            out.extend(
                rx.take_events()
                    .into_iter()
                    .map(|(at, e)| (Role::Receiver, at, e)),
            );
        }
        out.sort_by_key(|(_, at, _)| *at);
        out
    }

    fn kill(&mut self, side: Role) -> Result<(), LinkError> {
        self.release();
        match side {
            Role::Sender => drop(self.tx.take()),
            Role::Receiver => drop(self.rx.take()),
        }
        Ok(())
    }

    fn is_alive(&self, side: Role) -> bool {
        match side {
            Role::Sender => self.tx.is_some(),
            Role::Receiver => self.rx.is_some(),
        }
    }

    fn writes_in_flight(&self) -> usize {
        match (&self.tx_guard, &self.tx) {
            (Some(guard), _) => Tx::writes_in_flight_held(guard),
            (None, Some(tx)) => tx.writes_in_flight(),
            (None, None) => 0,
        }
    }

    fn batch_timings(&self) -> Vec<BatchTiming> {
        let timings = match (&self.tx_guard, &self.tx) {
            (Some(guard), _) => Tx::batch_timings_held(guard),
            (None, Some(tx)) => tx.batch_timings(),
            (None, None) => Vec::new(),
        };
        timings
            .into_iter()
            .map(|(bytes, issued, reported)| BatchTiming {
                bytes,
                issued,
                transfer: reported - issued,
                reported,
            })
            .collect()
    }
}

impl<Tx: ThreadedNode, Rx: ThreadedNode, Keep> Drop for ThreadedLink<Tx, Rx, Keep> {
    fn drop(&mut self) {
        self.release();
        // Both nodes stop before what `keep` holds (their connections may run on it).
        self.tx = None;
        self.rx = None;
    }
}
