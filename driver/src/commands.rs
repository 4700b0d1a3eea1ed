//! The engine's commands on a driven endpoint, written once for every transport: each is
//! applied under the node's lock with the node's now, and what it produced is carried out
//! before it returns. A chunk's block queries run with the node unlocked, between two
//! commands, so every connection's admissions and reports go on while the engine's block
//! table answers; the sender checks the chunk again when the answers are applied. That
//! sequence ([`submit_chunk`], [`submit_chunk_layers`]) serves any node that runs commands on a
//! locked sender ([`SenderLock`]): a [`Driver`], and the engine API's in-process pair, which is
//! none.

use std::time::Duration as StdDuration;

use kvpipe_core::session::{Counters, Registration, SendRequest, UsageError};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    BlockSource, ChunkSpec, Endpoint, Event, Instant, LayerRange, PeerId, Receiver,
    ReceiverSliceId, RequestId, Sender, Submitted,
};

use crate::node::{Driver, Io};

/// # Both roles
impl<E: Endpoint + Send + 'static, T: Io> Driver<E, T> {
    /// The next event, waiting up to `timeout`.
    pub fn next_event(&self, timeout: StdDuration) -> Option<Event> {
        self.events().next(timeout).map(|(_, e)| e)
    }

    /// The next event and the node time it was reported at, waiting up to `timeout`.
    pub fn next_event_at(&self, timeout: StdDuration) -> Option<(Instant, Event)> {
        self.events().next(timeout)
    }

    /// Every queued event with its time, without waiting.
    pub fn take_events(&self) -> Vec<(Instant, Event)> {
        self.events().take_all()
    }

    /// Whether the handshake with `peer` completed.
    pub fn is_peer_ready(&self, peer: PeerId) -> bool {
        self.lock().endpoint.is_peer_ready(peer)
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        *self.lock().endpoint.counters()
    }

    /// Sessions the core still holds.
    pub fn session_count(&self) -> usize {
        self.lock().endpoint.session_count()
    }
}

/// A node whose core [`Sender`] runs one command at a time under the node's lock: what a
/// chunk's submission in two steps needs ([`submit_chunk`], [`submit_chunk_layers`]).
pub trait SenderLock {
    /// What a command fails with: the core's usage error, or the node's own.
    type Error: From<UsageError>;

    /// Runs `f` on the sender under the node's lock with the node's now, and carries out what
    /// it produced before returning.
    fn with_sender<R>(
        &self,
        f: impl FnOnce(&mut Sender, Instant) -> Result<R, UsageError>,
    ) -> Result<R, Self::Error>;
}

impl<T: Io> SenderLock for Driver<Sender, T> {
    type Error = UsageError;

    fn with_sender<R>(
        &self,
        f: impl FnOnce(&mut Sender, Instant) -> Result<R, UsageError>,
    ) -> Result<R, UsageError> {
        self.with(f)
    }
}

/// Submits a computed chunk on `node` (see [`Sender::submit_chunk`]) in two commands: the
/// chunk's block windows ([`Sender::chunk_query`]), then its block runs
/// ([`Sender::submit_chunk_runs`]). `source` is asked in between, with the node unlocked, so
/// the engine's block table never holds up the node (and may even call back into it).
pub fn submit_chunk<N: SenderLock + ?Sized>(
    node: &N,
    request: RequestId,
    spec: ChunkSpec,
    source: &mut impl BlockSource,
) -> Result<Submitted, N::Error> {
    let query = node.with_sender(|ep, _| ep.chunk_query(request, &spec))?;
    let runs = query.ask(source)?;
    node.with_sender(|ep, now| ep.submit_chunk_runs(now, request, spec, runs))
}

/// Submits layers `layers` of a computed chunk on `node` (see [`Sender::submit_chunk_layers`])
/// as [`submit_chunk`] does: only a chunk's first range asks `source`, with the node unlocked.
pub fn submit_chunk_layers<N: SenderLock + ?Sized>(
    node: &N,
    request: RequestId,
    spec: ChunkSpec,
    layers: LayerRange,
    source: &mut impl BlockSource,
) -> Result<Submitted, N::Error> {
    let query = node.with_sender(|ep, _| ep.chunk_layers_query(request, &spec, layers))?;
    let runs = query.ask(source)?;
    node.with_sender(|ep, now| ep.submit_chunk_layers_runs(now, request, spec, layers, runs))
}

/// Submits an early prefix on `node` (see [`Sender::submit_prefix`]) as [`submit_chunk`]
/// does: `source` is asked with the node unlocked, so it may call into the node (or wait for a
/// thread that does) without a deadlock.
pub fn submit_prefix<N: SenderLock + ?Sized>(
    node: &N,
    request: RequestId,
    prompt_len: u32,
    prepopulated_len: u32,
    source: &mut impl BlockSource,
) -> Result<Submitted, N::Error> {
    let query = node.with_sender(|ep, _| ep.prefix_query(request, prompt_len, prepopulated_len))?;
    let runs = query.ask(source)?;
    node.with_sender(|ep, now| {
        ep.submit_prefix_runs(now, request, prompt_len, prepopulated_len, runs)
    })
}

/// # Prefill
impl<T: Io> Driver<Sender, T> {
    /// Opens a request (see [`Sender::open_request`]).
    pub fn open_request(&self, req: SendRequest) -> Result<(), UsageError> {
        self.with(|ep, now| ep.open_request(now, req))
    }

    /// Submits a computed chunk (see [`Sender::submit_chunk`]); `source` is asked with the
    /// node unlocked.
    pub fn submit_chunk(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        submit_chunk(self, request, spec, source)
    }

    /// Submits layers `layers` of a computed chunk, as the engine finishes them (see
    /// [`Sender::submit_chunk_layers`]). Only a chunk's first range asks `source` for blocks,
    /// with the node unlocked as [`submit_chunk`](Self::submit_chunk) does.
    pub fn submit_chunk_layers(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        submit_chunk_layers(self, request, spec, layers, source)
    }

    /// Submits the request's aux data.
    pub fn submit_aux(&self, request: RequestId, data: AuxData) -> Result<(), UsageError> {
        self.with(|ep, now| ep.submit_aux(now, request, data))
    }

    /// Cancels a request (see [`Sender::cancel`]).
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event.
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.retire(now, request))
    }
}

/// # Decode
impl<T: Io> Driver<Receiver, T> {
    /// Registers a request's destination blocks (see [`Receiver::register`]).
    pub fn register(&self, reg: Registration) -> Result<ReceiverSliceId, UsageError> {
        self.with(|ep, now| ep.register(now, reg))
    }

    /// Cancels a request (see [`Receiver::cancel`]).
    pub fn cancel(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.cancel(now, request))
    }

    /// Retires a request after its `Quiesced` event (the core still recognises and drops late
    /// writes for it for a while).
    pub fn retire(&self, request: RequestId) -> Result<(), UsageError> {
        self.with(|ep, now| ep.retire(now, request))
    }
}
