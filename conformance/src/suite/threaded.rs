//! The suite's [`Link`] over transports whose nodes run their endpoint on their own threads,
//! built on `kvpipe-driver` (TCP and RDMA verbs): a sender node and a receiver node in this
//! process. One implementation serves every such transport: each node is [`Driven`] (an
//! endpoint behind the driver's lock, events queued with their times, write batches counted
//! until reported).

use std::time::Duration as StdDuration;

use kvpipe_core::wire::Role;
use kvpipe_core::{Event, Instant, PeerId, Receiver, Sender};
use kvpipe_driver::{Driven, EndpointGuard};

use super::{BatchTiming, Link, LinkError};

/// A sender node and a receiver node in this process, as the suite drives them. `Keep` is held
/// until both nodes are gone (the TCP async driver's runtime, which their connections run on).
pub struct ThreadedLink<Tx: Driven, Rx: Driven, Keep = ()> {
    tx: Option<Tx>,
    rx: Option<Rx>,
    tx_guard: Option<EndpointGuard<Tx::Endpoint, Tx::Io>>,
    rx_guard: Option<EndpointGuard<Rx::Endpoint, Rx::Io>>,
    sender_peer: PeerId,
    receiver_peer: PeerId,
    origin: std::time::Instant,
    /// Dropped last (fields drop in order, after `Drop::drop` has stopped both nodes).
    #[allow(dead_code)]
    keep: Keep,
}

impl<Tx: Driven, Rx: Driven, Keep> ThreadedLink<Tx, Rx, Keep> {
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
    Tx: Driven<Endpoint = Sender>,
    Rx: Driven<Endpoint = Receiver>,
{
    fn now(&self) -> Instant {
        Instant::from_nanos(self.origin.elapsed().as_nanos() as u64)
    }

    fn sender(&mut self) -> &mut Sender {
        if self.tx_guard.is_none() {
            let node = self.tx.as_ref().expect("the sender is alive");
            self.tx_guard = Some(node.driver().guard());
        }
        self.tx_guard.as_mut().expect("just set")
    }

    fn receiver(&mut self) -> &mut Receiver {
        if self.rx_guard.is_none() {
            let node = self.rx.as_ref().expect("the receiver is alive");
            self.rx_guard = Some(node.driver().guard());
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
                tx.driver()
                    .take_events()
                    .into_iter()
                    .map(|(at, e)| (Role::Sender, at, e)),
            );
        }
        if let Some(rx) = &self.rx {
            out.extend(
                rx.driver()
                    .take_events()
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
            (Some(guard), _) => guard.writes_in_flight(),
            (None, Some(tx)) => tx.driver().writes_in_flight(),
            (None, None) => 0,
        }
    }

    fn batch_timings(&self) -> Vec<BatchTiming> {
        let timings = match (&self.tx_guard, &self.tx) {
            (Some(guard), _) => guard.batch_timings(),
            (None, Some(tx)) => tx.driver().batch_timings(),
            (None, None) => Vec::new(),
        };
        timings
            .into_iter()
            .map(|(bytes, issued, reported)| BatchTiming {
                bytes,
                issued,
                transfer: reported - issued,
                copied: reported,
                reported,
            })
            .collect()
    }
}

impl<Tx: Driven, Rx: Driven, Keep> Drop for ThreadedLink<Tx, Rx, Keep> {
    fn drop(&mut self) {
        self.release();
        // Both nodes stop before what `keep` holds (their connections may run on it).
        self.tx = None;
        self.rx = None;
    }
}
