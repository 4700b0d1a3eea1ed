//! Submission: the engine's chunk, layer-range and prefix commands, the block queries they make
//! of the engine's block source ([`ChunkQuery`]), and what became of each ([`Submitted`]).

use super::*;

/// What became of a submitted chunk or prefix (the `Ok` of [`Sender::submit_chunk`],
/// [`Sender::submit_chunk_runs`] and [`Sender::submit_prefix`]). An engine fault is also
/// reported as the request's [`Event::Failed`], so a driver that only follows events misses
/// nothing but the fault's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// A slice was created; it goes out to every receiver that registered (the others get it,
    /// in order, when their registration arrives).
    Slice(SenderSliceId),
    /// The chunk completes no block (or the prefix fills none): nothing is sent.
    Nothing,
    /// The engine's answer broke its contract: the request was failed on both sides and an
    /// [`Event::Failed`] follows. The call itself was fine (this is no usage error); the
    /// fault says what the engine got wrong.
    EngineFault(EngineFault),
}

impl Submitted {
    /// A slice when one was created, else nothing.
    pub(super) fn sent(slice: Option<SenderSliceId>) -> Self {
        slice.map_or(Submitted::Nothing, Submitted::Slice)
    }

    /// The slice created, if one was.
    pub fn slice(&self) -> Option<SenderSliceId> {
        match self {
            Submitted::Slice(id) => Some(*id),
            Submitted::Nothing | Submitted::EngineFault(_) => None,
        }
    }

    /// The engine's fault, if the submission failed the request.
    pub fn engine_fault(&self) -> Option<&EngineFault> {
        match self {
            Submitted::EngineFault(fault) => Some(fault),
            Submitted::Slice(_) | Submitted::Nothing => None,
        }
    }
}

/// The block windows one chunk needs, from [`Sender::chunk_query`]: what a driver asks the
/// engine's block source without holding the sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkQuery {
    request: RequestId,
    windows: super::intake::Windows,
}

impl ChunkQuery {
    /// The chunk's block window in each group that sends something, in group order.
    pub fn windows(&self) -> &[(GroupIndex, BlockWindow)] {
        &self.windows
    }

    /// Whether there is nothing to ask (a chunk that writes nothing, or a later layer range of
    /// a chunk, which reuses its first range's runs).
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Asks `source` for every window's block run (bounded queries, one per window), in group
    /// order: the runs [`Sender::submit_chunk_runs`] (or
    /// [`Sender::submit_chunk_layers_runs`]) takes. A query with no window asks nothing.
    pub fn ask(
        &self,
        source: &mut impl BlockSource,
    ) -> Result<Vec<(GroupIndex, BlockRun)>, UsageError> {
        let request = self.request;
        let mut runs = Vec::with_capacity(self.windows.len());
        for &(group, w) in &self.windows {
            let mut run = BlockRun::default();
            source
                .block_run(request, group, w.begin, w.end, &mut run)
                .map_err(|error| UsageError::BlockSource { request, error })?;
            runs.push((group, run));
        }
        Ok(runs)
    }
}

impl Sender {
    /// Submits one computed prefill chunk of `request`. The sender asks `source` for the chunk's
    /// bounded block windows (only those) and applies [`SenderInput::Chunk`] with its answers:
    /// a slice is created and written to every receiver that has registered (the others get
    /// it, in order, when their registration arrives).
    ///
    /// Returns what became of the chunk ([`Submitted`]): a slice, nothing (the chunk completes
    /// no block), or the engine's fault (its block runs broke the [`BlockSource`] contract, or
    /// its prefix or prompt length changed: the request was failed on both sides, the call
    /// itself was fine). An error is a usage error, with nothing changed.
    ///
    /// A driver that shares the sender between threads should not hold it while the engine's
    /// block source runs: it asks [`chunk_query`](Self::chunk_query) for the windows, queries
    /// the source with the sender released ([`ChunkQuery::ask`]), and applies the answers with
    /// [`submit_chunk_runs`](Self::submit_chunk_runs).
    pub fn submit_chunk(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        // The checks and the block windows are computed once, here: the engine's answers are
        // applied without computing them again.
        let next_phase = self.check_chunk(request, &spec)?;
        let query = ChunkQuery {
            request,
            windows: self.chunk_windows(request, &spec)?,
        };
        let runs = query.ask(source)?;
        self.apply_chunk_runs(now, request, spec, runs, Some((next_phase, &query.windows)))
    }

    /// The block windows chunk `spec` of `request` needs, after every check
    /// [`submit_chunk`](Self::submit_chunk) makes before asking the engine (nothing changes):
    /// the first half of a submission whose block queries run without the sender.
    pub fn chunk_query(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
    ) -> Result<ChunkQuery, UsageError> {
        self.check_chunk(request, spec)?;
        Ok(ChunkQuery {
            request,
            windows: self.chunk_windows(request, spec)?,
        })
    }

    /// Applies a chunk whose block runs the engine gave for its [`chunk_query`](Self::chunk_query)
    /// (the second half of a submission): the checks are made again, since the sender may have
    /// changed in between (a cancel, a failure), and the runs must answer the chunk's windows.
    /// Errors and outcome as [`submit_chunk`](Self::submit_chunk).
    pub fn submit_chunk_runs(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        self.apply_chunk_runs(now, request, spec, runs, None)
    }

    /// Applies chunk `spec` with the engine's `runs` and records it as [`SenderInput::Chunk`].
    /// `checked`: the chunk's next phase and windows when the caller just checked it (else
    /// the checks are made here).
    fn apply_chunk_runs(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        runs: Vec<(GroupIndex, BlockRun)>,
        checked: Option<(SendPhase, &[(GroupIndex, BlockWindow)])>,
    ) -> Result<Submitted, UsageError> {
        let outcome = match checked {
            Some((next_phase, windows)) => {
                self.apply_chunk(now, request, spec, next_phase, windows, runs.clone(), None)?
            }
            None => self.on_chunk(now, request, spec, runs.clone())?,
        };
        self.recorded.push(SenderInput::Chunk {
            now,
            request,
            spec,
            runs,
        });
        Ok(outcome)
    }

    /// Submits layers `layers` of one computed prefill chunk of `request`, as the engine
    /// finishes them (see [`crate::layers`] for the rules and [`SenderInput::ChunkLayers`]).
    ///
    /// The chunk's first range (starting at layer 0) is checked as [`submit_chunk`](Self::submit_chunk)
    /// checks a chunk, asks `source` for the chunk's bounded block windows and pairs its
    /// blocks; each later range (the same `spec`, starting where the previous one ended) asks
    /// `source` nothing and writes its layers of those blocks. Each range that writes something
    /// is a slice of its own, written to every registered receiver in slice order; the `is_last`
    /// slice is the last chunk's last range (ending at [`layer_count`](Self::layer_count)). A
    /// single range of every layer is exactly [`submit_chunk`](Self::submit_chunk).
    ///
    /// Returns the range's outcome as [`submit_chunk`](Self::submit_chunk) does:
    /// [`Submitted::Nothing`] when it writes nothing (a chunk that completes no block; an
    /// engine's fault only on a chunk's first range, which asks the engine). Refused with
    /// nothing changed ([`UsageError`]): an empty range, one past the rank's layers, one that
    /// does not start where the chunk's previous range ended (overlap, gap, out of order:
    /// [`UsageError::LayerRangeOutOfOrder`]), a range naming another chunk (another `start`)
    /// or a whole chunk while a chunk's last range has not come
    /// ([`UsageError::ChunkLayersUnfinished`]), a range of the open chunk whose spec differs
    /// in another field ([`UsageError::ChunkRangeSpecMismatch`], naming the field), and every
    /// refusal of [`submit_chunk`](Self::submit_chunk) for a chunk's first range.
    pub fn submit_chunk_layers(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        let query = self.chunk_layers_query(request, &spec, layers)?;
        let runs = query.ask(source)?;
        self.submit_chunk_layers_runs(now, request, spec, layers, runs)
    }

    /// The block windows layer range `layers` of chunk `spec` needs, after every check
    /// [`submit_chunk_layers`](Self::submit_chunk_layers) makes before asking the engine
    /// (nothing changes): the chunk's windows for its first range, none for a later range
    /// ([`ChunkQuery::is_empty`]; its [`ask`](ChunkQuery::ask) queries nothing).
    pub fn chunk_layers_query(
        &self,
        request: RequestId,
        spec: &ChunkSpec,
        layers: LayerRange,
    ) -> Result<ChunkQuery, UsageError> {
        let windows = match self.check_chunk_layers(request, spec, layers)? {
            layers::RangeStep::First { windows, .. } => windows,
            layers::RangeStep::Later { .. } => SmallVec::new(),
        };
        Ok(ChunkQuery { request, windows })
    }

    /// Applies layer range `layers` of chunk `spec` with the block runs the engine gave for
    /// its [`chunk_layers_query`](Self::chunk_layers_query) (empty for a later range): the
    /// checks are made again, since the sender may have changed in between. Errors and outcome
    /// as [`submit_chunk_layers`](Self::submit_chunk_layers).
    pub fn submit_chunk_layers_runs(
        &mut self,
        now: Instant,
        request: RequestId,
        spec: ChunkSpec,
        layers: LayerRange,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        let recorded = self.recorded.is_on().then(|| runs.clone());
        let outcome = self.on_chunk_layers(now, request, spec, layers, runs)?;
        if let Some(runs) = recorded {
            self.recorded.push(SenderInput::ChunkLayers {
                now,
                request,
                spec,
                layers,
                runs,
            });
        }
        Ok(outcome)
    }

    /// Sends the request's cached prefix before its first chunk (see [`SenderInput::Prefix`]):
    /// the fully cached blocks `[0, prepopulated_len / tpb)` (from the stale boundary in a
    /// windowed group), so only the computed part waits for prefill. The request's chunks must
    /// then set [`ChunkSpec::prefix_sent_early`]. Returns the slice ([`Submitted::Slice`]),
    /// [`Submitted::Nothing`] when the prefix fills no whole block, or the engine's fault as
    /// for [`submit_chunk`](Self::submit_chunk).
    pub fn submit_prefix(
        &mut self,
        now: Instant,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        source: &mut impl BlockSource,
    ) -> Result<Submitted, UsageError> {
        let runs = self
            .prefix_query(request, prompt_len, prepopulated_len)?
            .ask(source)?;
        self.submit_prefix_runs(now, request, prompt_len, prepopulated_len, runs)
    }

    /// The block windows an early prefix needs, after every check
    /// [`submit_prefix`](Self::submit_prefix) makes before asking the engine (nothing
    /// changes): the first half of a prefix submission whose block queries run without the
    /// sender, as [`chunk_query`](Self::chunk_query) is for a chunk.
    pub fn prefix_query(
        &self,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
    ) -> Result<ChunkQuery, UsageError> {
        let windows = self.check_prefix(request, prompt_len, prepopulated_len)?;
        Ok(ChunkQuery { request, windows })
    }

    /// Applies an early prefix whose block runs the engine gave for its
    /// [`prefix_query`](Self::prefix_query): the checks are made again, since the sender may
    /// have changed in between. Errors and outcome as [`submit_prefix`](Self::submit_prefix).
    pub fn submit_prefix_runs(
        &mut self,
        now: Instant,
        request: RequestId,
        prompt_len: u32,
        prepopulated_len: u32,
        runs: Vec<(GroupIndex, BlockRun)>,
    ) -> Result<Submitted, UsageError> {
        let recorded = self.recorded.is_on().then(|| runs.clone());
        let outcome = self.on_prefix(now, request, prompt_len, prepopulated_len, runs)?;
        if let Some(runs) = recorded {
            self.recorded.push(SenderInput::Prefix {
                now,
                request,
                prompt_len,
                prepopulated_len,
                runs,
            });
        }
        Ok(outcome)
    }
}
