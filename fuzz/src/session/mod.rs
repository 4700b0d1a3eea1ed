//! The `session` target: the endpoints' own input enums ([`SenderInput`], [`ReceiverInput`]
//! with [`TransportInput`]) applied to one connected sender/receiver pair, with the frames
//! between them carried by the seeded network emulation (`kvpipe_netem`: delayed, lost,
//! duplicated, reordered as the case's configuration says), and the sessions' safety rules
//! checked after every step.
//!
//! A case is a network configuration and a list of [`Step`]s. Most steps are real inputs
//! ([`Step::Sender`], [`Step::Receiver`]): arbitrary engine commands (open, chunk with arbitrary
//! block runs, a layer range of a chunk, aux, cancel, retire, register with arbitrary anchored runs), transport reports,
//! arbitrary frame bytes from a hostile peer, and arbitrary (decoded) data-write headers, which
//! go through [`Receiver::admit_write`]. The harness folds each into the case's small world before
//! applying it (the endpoints would refuse most raw values at once): `now` is the case's clock,
//! request ids fall into four, peers are the pair's, batch ids and write tickets name ones that
//! are pending, and connection reports reach both ends (the transport contract). A few steps
//! are conveniences that make progress likely: a well-formed chunk from a fixed block source (whole, or the next layer range of one),
//! a well-formed registration, a batch that lands through admission and completes, a
//! data-write header inside the request's grant, frames delivered as they fall due.
//!
//! Rules checked (a violation panics):
//!
//! - nothing panics (every input, however wrong — including arbitrary bytes from a hostile
//!   peer — is answered with a value or an error);
//! - a sender completes a request only after its last chunk (all its layer ranges) was submitted, every write batch of
//!   the request was reported complete (none failed), and its aux data was submitted;
//! - a receiver completes a request only after a successful last result and the aux data for it
//!   were delivered to it;
//! - no write batch is emitted for a request after it was cancelled, ended or retired;
//! - after `Quiesced`, an endpoint emits nothing more for the request (no write, no event, no
//!   result, aux or registration frame), and `Quiesced` comes once, after exactly one terminal
//!   event;
//! - admitted writes never overlap one still being applied, and always lie inside the request's
//!   `granted_extents`;
//! - nothing waits without a deadline: after the case, with the network and transport catching
//!   up and twelve seconds passing, every registered request ended and quiesced on the receiver,
//!   and every request whose last chunk was submitted (or that was cancelled) on the sender;
//! - replaying each endpoint's recorded inputs into a fresh endpoint gives the same outputs.
//!
//! This file holds the pair's state and the entry points; the other files add their part:
//!
//! - `case.rs`: what a case is ([`NetemCase`], [`Step`], [`SessionCase`]) and what a run saw;
//! - `world.rs`: the case's small world (layouts, configurations, requests, block source);
//! - `steps.rs`: applying the steps, raw inputs folded into the world first;
//! - `network.rs`: the connection, frames through the network emulation, timers;
//! - `transport.rs`: the transport's part (admission, write batches, transport inputs);
//! - `rules.rs`: the rules checked on every output;
//! - `settle.rs`: the checks after the steps (everything ends and quiesces; replay).
//!
//! [`SenderInput`]: kvpipe_core::session::SenderInput
//! [`ReceiverInput`]: kvpipe_core::session::ReceiverInput
//! [`TransportInput`]: kvpipe_core::session::TransportInput

mod case;
mod network;
mod rules;
mod settle;
mod steps;
mod transport;
mod world;

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::{Arbitrary, Unstructured};
use kvpipe_core::session::{DataWriteHeaders, Output, Receiver, Sender, WriteBatchId, WriteTicket};
use kvpipe_core::{ChunkSpec, Instant, RegionId, RequestId, WritePlan};
use kvpipe_netem::{FrameQueue, Link, Netem};

pub use case::{NetemCase, SessionCase, SessionStats, Step};
use world::{receiver_config, sender_config};

/// Per-endpoint, per-request bookkeeping for the rules.
#[derive(Clone, Debug, Default)]
struct Track {
    terminal: bool,
    quiesced: bool,
    /// No write may be emitted any more (cancelled, ended or retired).
    no_writes: bool,
}

/// A write batch the sender asked for and nobody reported yet.
#[derive(Clone, Debug)]
struct PendingBatch {
    batch: WriteBatchId,
    request: RequestId,
    plan: WritePlan,
    headers: DataWriteHeaders,
}

/// A data write the receiver admitted and that is still being applied.
#[derive(Clone, Copy, Debug)]
struct Applying {
    ticket: WriteTicket,
    request: RequestId,
    region: RegionId,
    offset: u64,
    len: u64,
}

struct Pair {
    now: Instant,
    sender: Sender,
    receiver: Receiver,
    connected: bool,
    netem: Netem,
    link: Link,
    to_receiver: FrameQueue,
    to_sender: FrameQueue,
    pending: Vec<PendingBatch>,
    applying: Vec<Applying>,
    next_start: BTreeMap<RequestId, u32>,
    /// Per request, the chunk submitted in layer ranges whose last range has not come.
    open_chunk: BTreeMap<RequestId, ChunkSpec>,
    last_submitted: BTreeSet<RequestId>,
    /// Requests opened on the sender / registered on the receiver.
    opened: BTreeSet<RequestId>,
    registered: BTreeSet<RequestId>,
    /// Requests the sender engine cancelled.
    cancelled: BTreeSet<RequestId>,
    aux_submitted: BTreeSet<RequestId>,
    /// Per request: batches issued, completed, whether one failed.
    batches: BTreeMap<RequestId, (u64, u64, bool)>,
    /// (request) → delivered to the receiver: a successful last result, aux data.
    delivered_last: BTreeSet<RequestId>,
    delivered_aux: BTreeSet<RequestId>,
    /// Requests the receiver completed (a sender completes only after it).
    receiver_completed: BTreeSet<RequestId>,
    send_track: BTreeMap<RequestId, Track>,
    recv_track: BTreeMap<RequestId, Track>,
    /// Every output of each endpoint, in order (for the replay check).
    sender_outputs: Vec<Output>,
    receiver_outputs: Vec<Output>,
    stats: SessionStats,
}

impl Pair {
    fn new(netem: NetemCase) -> Self {
        let mut sender = Sender::new(sender_config()).expect("a supported configuration");
        let mut receiver = Receiver::new(receiver_config()).expect("a supported configuration");
        sender.record_inputs(true);
        receiver.record_inputs(true);
        let mut netem = Netem::new(netem.config());
        let link = netem.link();
        let mut pair = Pair {
            now: Instant::from_millis(1),
            sender,
            receiver,
            connected: false,
            netem,
            link,
            to_receiver: FrameQueue::default(),
            to_sender: FrameQueue::default(),
            pending: Vec::new(),
            applying: Vec::new(),
            next_start: BTreeMap::new(),
            open_chunk: BTreeMap::new(),
            last_submitted: BTreeSet::new(),
            opened: BTreeSet::new(),
            registered: BTreeSet::new(),
            cancelled: BTreeSet::new(),
            aux_submitted: BTreeSet::new(),
            batches: BTreeMap::new(),
            delivered_last: BTreeSet::new(),
            delivered_aux: BTreeSet::new(),
            receiver_completed: BTreeSet::new(),
            send_track: BTreeMap::new(),
            recv_track: BTreeMap::new(),
            sender_outputs: Vec::new(),
            receiver_outputs: Vec::new(),
            stats: SessionStats::default(),
        };
        pair.reconnect(None);
        // Finish the handshake (handshake frames are spared) so cases start ready.
        for _ in 0..4 {
            pair.deliver_due();
        }
        pair
    }

    fn count<E>(&mut self, res: Result<(), E>) {
        self.stats.refused += u64::from(res.is_err());
    }
}

/// Runs `case` on a fresh pair, lets it settle and replays it, panicking on the first broken
/// rule.
pub fn run_case(case: &SessionCase) -> SessionStats {
    let mut pair = Pair::new(case.netem);
    for step in &case.steps {
        pair.apply(step.clone());
    }
    pair.settle();
    pair.check_replay();
    pair.stats
}

/// The fuzz entry point: decodes a case from `data` and runs it.
pub fn check(data: &[u8]) {
    if let Ok(case) = SessionCase::arbitrary_take_rest(Unstructured::new(data)) {
        run_case(&case);
    }
}
