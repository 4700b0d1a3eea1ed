//! Ranges handed over while the GPU may still be computing them (`cuda` feature): a
//! submission with a [`Fence`] behind that compute.
//!
//! A serving engine queues a layer's kernels and moves on; vLLM calls `save_kv_layer` at that
//! point, before the GPU ran them. Waiting there for the GPU stalls the forward pass, and
//! waiting on another thread puts a wake-up and the copy's issue on the tail. Over mem the
//! range's copies are queued at once behind the fence and start on the GPU the moment the
//! compute ends. Over tcp and verbs the bytes leave through a socket or a NIC, which cannot wait
//! for a GPU event, so the call waits for the fence on the calling thread first.

use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use kvpipe_core::session::{ChunkQuery, UsageError};
use kvpipe_core::{
    BlockRun, BlockSource, ChunkSpec, GroupIndex, Instant, LayerRange, RequestId, Sender, Submitted,
};
pub use kvpipe_cuda::Fence;

use crate::node::Inner;
use crate::{EmbedError, PrefillNode};

/// The block runs a chunk's source answered, in group order.
type Runs = Vec<(GroupIndex, BlockRun)>;

/// Longest a submission over tcp or verbs waits for its fence.
pub const FENCE_WAIT: Duration = Duration::from_secs(60);

/// # Handing ranges over behind a fence (`cuda` feature)
impl PrefillNode {
    /// [`submit_chunk`](Self::submit_chunk) for a chunk whose KV the GPU may still be
    /// computing: `after` is a [`Fence`] recorded behind that compute (on the forward pass's
    /// stream). See [`submit_chunk_layers_after`](Self::submit_chunk_layers_after).
    pub fn submit_chunk_after(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
        after: &Arc<Fence>,
    ) -> Result<Submitted, EmbedError> {
        if !self.gates_on_gpu(after)? {
            return self.submit_chunk(request, spec, source);
        }
        self.submit_gated(
            request,
            after,
            source,
            |ep| ep.chunk_query(request, &spec),
            move |ep, now, runs| ep.submit_chunk_runs(now, request, spec, runs),
        )
    }

    /// [`submit_chunk_layers`](Self::submit_chunk_layers) for a range whose KV the GPU may
    /// still be computing, as vLLM's `save_kv_layer` hands a layer over: `after` is a [`Fence`]
    /// recorded behind that compute (on the forward pass's stream).
    ///
    /// - **mem**: the range's write batches are queued at once, each copy waiting for the
    ///   fence on the GPU (also a batch issued later, when the decode side registers); the
    ///   call does not wait. A batch with host memory on either side waits for the fence on
    ///   the transport's copy worker instead.
    /// - **tcp, verbs**: the call waits for the fence first, on this thread (at most
    ///   [`FENCE_WAIT`]), then submits as [`submit_chunk_layers`](Self::submit_chunk_layers).
    ///
    /// The blocks' bytes may still be being written by the work before the fence; nothing
    /// else may write them until the request quiesces, as for any submission. Over tcp and
    /// verbs a fence whose work failed, or did not pass within [`FENCE_WAIT`], is
    /// [`EmbedError::Fence`], with nothing submitted. Over mem the call does not look at the
    /// fence: work that fails before it fails the range's copies, and the request fails as for
    /// any failed write (its write deadline runs from the batch's issue, so it includes the
    /// rest of the compute).
    pub fn submit_chunk_layers_after(
        &self,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
        after: &Arc<Fence>,
    ) -> Result<Submitted, EmbedError> {
        if !self.gates_on_gpu(after)? {
            return self.submit_chunk_layers(request, spec, layers, source);
        }
        self.submit_gated(
            request,
            after,
            source,
            |ep| ep.chunk_layers_query(request, &spec, layers),
            move |ep, now, runs| ep.submit_chunk_layers_runs(now, request, spec, layers, runs),
        )
    }

    /// Whether this node's transport waits for `after` on the GPU (mem). Elsewhere it waits
    /// for the fence here first, at most [`FENCE_WAIT`], and answers `false`: the submission
    /// then goes as an ordinary one.
    fn gates_on_gpu(&self, after: &Fence) -> Result<bool, EmbedError> {
        if self.with(|inner| Ok(matches!(inner, Inner::Mem(_))))? {
            return Ok(true);
        }
        after
            .wait(StdInstant::now() + FENCE_WAIT)
            .map_err(|e| EmbedError::Fence(e.to_string()))?;
        Ok(false)
    }

    /// Over mem: a submission in two commands, as `kvpipe_driver::submit_chunk` makes it (the
    /// query, then the runs `source` answered, asked with the node unlocked), the slice gated
    /// behind `after` before the pair carries it out.
    fn submit_gated<S: BlockSource>(
        &self,
        request: RequestId,
        after: &Arc<Fence>,
        source: &mut S,
        query: impl FnOnce(&Sender) -> Result<ChunkQuery, UsageError>,
        submit: impl FnOnce(&mut Sender, Instant, Runs) -> Result<Submitted, UsageError>,
    ) -> Result<Submitted, EmbedError> {
        let query = self.command(|ep: &mut Sender, _| query(ep))?;
        let runs = query.ask(source)?;
        self.with(|inner| match inner {
            Inner::Mem(side) => side.submit_gated(request, after, |ep, now| submit(ep, now, runs)),
            // A node's transport never changes.
            _ => Err(EmbedError::Unsupported {
                operation: "gating a slice behind a fence",
                transport: "tcp or verbs",
            }),
        })
    }
}
