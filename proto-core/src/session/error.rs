//! The endpoints' errors, kept apart (shared/STYLE.md): a peer's broken rule
//! ([`ProtocolError`], which fails the session and travels as a status), the caller's bug
//! ([`UsageError`], returned at once with nothing changed), and the engine's answer that breaks
//! its contract ([`EngineFault`], an outcome: the request fails, the call itself was fine).

use thiserror::Error;

use super::*;

/// A rule a peer broke. Inside a session it fails the session and travels on the wire as
/// [`TransferStatus::ProtocolError`]; outside one it is reported as
/// [`Event::ProtocolViolation`] and the frame is dropped.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProtocolError {
    /// A session frame arrived before the handshake finished.
    #[error("{kind} frame arrived before the handshake finished")]
    FrameBeforeHandshake {
        /// The frame kind.
        kind: &'static str,
    },
    /// This endpoint's role never receives that frame kind.
    #[error("{kind} frame is not accepted by a {role:?} endpoint")]
    UnexpectedFrame {
        /// The frame kind.
        kind: &'static str,
        /// This endpoint's role.
        role: Role,
    },
    /// A second, different handshake on one connection.
    #[error("a second, different Hello arrived on one connection")]
    SecondHello,
    /// A frame about a request the endpoint does not know.
    #[error("{kind} frame for {request}, which this endpoint does not know")]
    UnknownRequest {
        /// The frame kind.
        kind: &'static str,
        /// The request.
        request: RequestId,
    },
    /// A frame from a peer that is not part of the request.
    #[error("{kind} frame for {request} from a peer that is not part of it")]
    NotAParticipant {
        /// The frame kind.
        kind: &'static str,
        /// The request.
        request: RequestId,
    },
    /// A result named a receiver slice the request does not have.
    #[error("result for {request} names {got}, but the registration is {expected}")]
    UnknownSlice {
        /// The request.
        request: RequestId,
        /// The receiver slice of the registration.
        expected: ReceiverSliceId,
        /// The receiver slice named.
        got: ReceiverSliceId,
    },
    /// A result arrived after the writer's last one.
    #[error("result for {request} after the writer's last result")]
    ResultAfterLast {
        /// The request.
        request: RequestId,
    },
    /// A second, different registration for one request from one peer.
    #[error("a second, different registration for {request}")]
    DuplicateRegistration {
        /// The request.
        request: RequestId,
    },
    /// The registration's layer groups do not match the handshake's layout.
    #[error("registration for {request} has {got} layer groups, the layout has {expected}")]
    GroupCountMismatch {
        /// The request.
        request: RequestId,
        /// Groups in the layout.
        expected: usize,
        /// Groups in the registration.
        got: usize,
    },
    /// The two sides disagree on the prompt length.
    #[error(
        "{request}: the receiver registered {registered} prompt tokens, the sender has {local}"
    )]
    PromptLenMismatch {
        /// The request.
        request: RequestId,
        /// Prompt length in the registration.
        registered: u32,
        /// Prompt length of the local chunks.
        local: u32,
    },
    /// A registration names one destination block for two ordinals of a layer group (a
    /// receiver's own `register` refuses that; this one came over the wire).
    #[error("registration for {request} names {block} twice in layer group {group}")]
    RepeatedBlock {
        /// The request.
        request: RequestId,
        /// The layer group (index in the layout).
        group: usize,
        /// The smallest block id named twice.
        block: crate::ids::BlockId,
    },
    /// Aux data larger than the receiver's aux slot.
    #[error("aux data for {request} takes {len} bytes, the aux slot holds {capacity}")]
    AuxTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded size of the aux data.
        len: u64,
        /// The slot's capacity.
        capacity: u32,
    },
    /// Bytes from the peer that are no frame at the negotiated version.
    #[error("undecodable frame: {error}")]
    Undecodable {
        /// The decoder's error.
        error: DecodeError,
    },
    /// A data write from the peer was refused (see [`WriteRefusal`]).
    #[error("data write refused: {refusal}")]
    WriteRefused {
        /// Why.
        refusal: WriteRefusal,
    },
    /// A writer sent more frames than may wait for their data to land.
    #[error("{request}: more than {held} frames wait for data that has not landed")]
    TooManyHeldFrames {
        /// The request.
        request: RequestId,
        /// The bound.
        held: usize,
    },
    /// Every writer reported its last result, yet writes are still landing: bytes nobody
    /// reported.
    #[error("{request}: {writes} data write(s) still landing after every writer's last result")]
    UnreportedWrites {
        /// The request.
        request: RequestId,
        /// Writes still in flight.
        writes: u32,
    },
    /// A writer's bytes do not cover its share of the registration exactly.
    #[error(
        "{request}: the writer's share of the registration is {expected} bytes, it reported \
         {reported}{}",
        match landed { Some(l) => format!(" and {l} landed"), None => String::new() }
    )]
    BytesMismatch {
        /// The request.
        request: RequestId,
        /// Bytes of the writer's share of the registration.
        expected: u64,
        /// Bytes the writer's results reported.
        reported: u64,
        /// Bytes that landed (transports that report landings).
        landed: Option<u64>,
    },
    /// A registration ends a group before its prompt's last block: the tail would never be
    /// written, yet every writer would report its share and the request would complete.
    #[error(
        "registration of {request} {group} ends at block ordinal {end}, but a prompt of \
         {prompt_len} tokens has {blocks} blocks: register every block from the first one \
         the decode side does not hold to the last one"
    )]
    RegistrationShort {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// One past the last ordinal registered.
        end: u64,
        /// The prompt's length in tokens.
        prompt_len: u32,
        /// Blocks of the prompt.
        blocks: u32,
    },
    /// The registration's writers do not write every layer and head of the part the decode
    /// rank expects exactly once (one of them missing, two claiming the same part, or one
    /// writing outside it): the request would complete with KV never written.
    #[error("the writers of {request} do not cover {group} exactly once: {fault}")]
    WritersDoNotCover {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// What is missing, doubled or outside.
        fault: CoverFault,
    },
    /// A registration lists a writer that writes none of this rank's layers and heads (its
    /// layers or heads do not overlap, or another replica of its heads writes this rank): it
    /// would be waited for in vain.
    #[error(
        "the writers of {request} include {writer}, which writes none of this rank's layers and \
         heads: list exactly the prefill ranks that write this rank (`writes_to`)"
    )]
    WriterWritesNothing {
        /// The request.
        request: RequestId,
        /// The writer.
        writer: PeerId,
    },
    /// A registration names block ordinals past its prompt's blocks.
    #[error(
        "registration of {request} {group} reaches block ordinal {end}, but a prompt of \
         {prompt_len} tokens has {blocks} blocks"
    )]
    RegistrationPastPrompt {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// One past the last ordinal registered.
        end: u64,
        /// The prompt's length in tokens.
        prompt_len: u32,
        /// Blocks of the prompt.
        blocks: u32,
    },
    /// Two writers of one request sent different aux data.
    #[error("{request}: the writers' aux data differ (first tokens, draft tokens or counts)")]
    AuxMismatch {
        /// The request.
        request: RequestId,
    },
    /// The blocks of the registration cannot be paired with the local ones.
    #[error("{request}: cannot plan writes into the registration: {error}")]
    Unplannable {
        /// The request.
        request: RequestId,
        /// The planner's error.
        error: PlanError,
    },
}

/// A caller bug: returned at once, with the endpoint's state unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum UsageError {
    /// The request was never opened (sender) or registered (receiver).
    #[error("{0} is not known to this endpoint")]
    UnknownRequest(RequestId),
    /// The request was retired; it is never re-created.
    #[error("{0} was retired and cannot be used again")]
    Retired(RequestId),
    /// The request is already open or registered.
    #[error("{0} is already open on this endpoint")]
    DuplicateRequest(RequestId),
    /// The request has no peers to exchange with.
    #[error("{0} names no peers")]
    NoPeers(RequestId),
    /// A peer is named twice for one request.
    #[error("{request} names {peer} twice")]
    DuplicatePeer {
        /// The request.
        request: RequestId,
        /// The peer named twice.
        peer: PeerId,
    },
    /// The registration's groups do not match the local layout.
    #[error("{request}: {got} layer groups given, the layout has {expected}")]
    GroupCountMismatch {
        /// The request.
        request: RequestId,
        /// Groups in the layout.
        expected: usize,
        /// Groups given.
        got: usize,
    },
    /// A registration names one destination block for two ordinals of a layer group: two
    /// blocks of the prompt would be written into one slot, and the sender's write there
    /// would be refused as a grant violation that closes the link.
    #[error(
        "registration for {request} names {block} twice in layer group {group}: each \
         ordinal needs its own destination block"
    )]
    RepeatedBlock {
        /// The request.
        request: RequestId,
        /// The layer group (index in the layout).
        group: usize,
        /// The smallest block id named twice.
        block: crate::ids::BlockId,
    },
    /// A registration names a destination block whose slot lies past the memory of its
    /// layer group's pool ([`ReceiverConfig::region_bytes`](super::ReceiverConfig::region_bytes)):
    /// every write to it would fail at the transport.
    #[error(
        "registration for {request} names {block} in layer group {group}, past its pools: the \
         memory given for them holds {slots} slots"
    )]
    BlockPastPool {
        /// The request.
        request: RequestId,
        /// The layer group (index in the layout).
        group: usize,
        /// The first block (in ordinal order) past the pools.
        block: crate::ids::BlockId,
        /// Slots the group's smallest pool holds.
        slots: u64,
    },
    /// A chunk (or prefix) needs more blocks of a layer group at once than its pools hold
    /// ([`SenderConfig::region_bytes`](super::SenderConfig::region_bytes)): its blocks cannot
    /// all be resident, so no block source could answer it. Refused before the engine is asked.
    #[error(
        "{request}'s chunk needs {blocks} blocks of layer group {group} at once, but the memory \
         given for its pools holds {slots} slots: check the chunk's prompt_len and end"
    )]
    ChunkPastPool {
        /// The request.
        request: RequestId,
        /// The layer group (index in the layout).
        group: usize,
        /// Blocks the chunk's window spans.
        blocks: u32,
        /// Slots the group's smallest pool holds.
        slots: u64,
    },
    /// A registration names a destination block that another request still holds: it was
    /// registered and has not quiesced, so writes may still land in it. Each block belongs to
    /// one request at a time.
    #[error(
        "registration for {request} names {block} in layer group {group}, which {holder} still \
         holds: a block is free again at its holder's Quiesced event"
    )]
    BlockHeldByRequest {
        /// The request.
        request: RequestId,
        /// The layer group (index in the layout).
        group: usize,
        /// The first block (in ordinal order) another request holds.
        block: crate::ids::BlockId,
        /// The request that holds it.
        holder: RequestId,
    },
    /// A chunk after the request's last chunk.
    #[error("chunk for {0} after its last chunk")]
    ChunkAfterLast(RequestId),
    /// A layer range holds no layer.
    #[error("{layers} of a chunk of {request} is empty: a layer range holds at least one layer")]
    LayerRangeEmpty {
        /// The request.
        request: RequestId,
        /// The range.
        layers: LayerRange,
    },
    /// A layer range reaches past the rank's layers.
    #[error(
        "{layers} of a chunk of {request} reaches past the rank's {count} layers: a range lies \
         within 0..{count}"
    )]
    LayerRangePastLayers {
        /// The request.
        request: RequestId,
        /// The range.
        layers: LayerRange,
        /// The rank's layers.
        count: u32,
    },
    /// A layer range does not start where the chunk's previous range ended (at layer 0 for
    /// its first): it overlaps, skips layers or comes out of order.
    #[error(
        "{layers} of a chunk of {request} must start at layer {expected}: a chunk's ranges are \
         submitted in ascending, contiguous order from layer 0 to the rank's last layer"
    )]
    LayerRangeOutOfOrder {
        /// The request.
        request: RequestId,
        /// The range.
        layers: LayerRange,
        /// Where it must start.
        expected: u32,
    },
    /// A chunk (or a range of another chunk: another `start`) while the previous chunk's
    /// layers are not all submitted. A range of the open chunk whose spec differs otherwise is
    /// [`UsageError::ChunkRangeSpecMismatch`].
    #[error(
        "{request}'s chunk submitted in layer ranges is open until its last range: submit \
         layers {next_layer}..{layers} of that chunk before another chunk"
    )]
    ChunkLayersUnfinished {
        /// The request.
        request: RequestId,
        /// Where the open chunk's next range starts.
        next_layer: u32,
        /// The rank's layers.
        layers: u32,
    },
    /// A later layer range of the open chunk names the same chunk (the same `start`) with a
    /// [`ChunkSpec`] that differs from its first range's in `field` (the first field that
    /// differs). Every range of a chunk carries the chunk's spec unchanged.
    #[error(
        "a layer range of {request}'s open chunk (from token {}) gives {field} = {}, its first \
         range gave {field} = {}: every range of a chunk carries the same ChunkSpec",
        .open.start,
        .field.value_in(.got),
        .field.value_in(.open)
    )]
    ChunkRangeSpecMismatch {
        /// The request.
        request: RequestId,
        /// The first field that differs.
        field: ChunkSpecField,
        /// The open chunk's spec (as its first range gave it).
        open: ChunkSpec,
        /// The spec this range gave.
        got: ChunkSpec,
    },
    /// Chunks must be submitted in token order without gaps.
    #[error("chunk for {request} starts at token {got}, expected {expected}")]
    ChunkOutOfOrder {
        /// The request.
        request: RequestId,
        /// Where the next chunk must start.
        expected: u32,
        /// Where it started.
        got: u32,
    },
    /// A chunk's prompt length differs from an earlier chunk's.
    #[error(
        "chunk for {request} says the prompt has {got} tokens, earlier chunks said {expected}"
    )]
    PromptLenChanged {
        /// The request.
        request: RequestId,
        /// Earlier prompt length.
        expected: u32,
        /// This chunk's prompt length.
        got: u32,
    },
    /// The chunk's geometry is invalid.
    #[error("invalid chunk for {request}: {error}")]
    Geometry {
        /// The request.
        request: RequestId,
        /// The geometry error.
        error: GeometryError,
    },
    /// The block source could not answer a chunk's query.
    #[error("block source failed for {request}: {error}")]
    BlockSource {
        /// The request.
        request: RequestId,
        /// The block source's error.
        error: BlockSourceError,
    },
    /// The request already ended (failed, timed out, cancelled or completed); its event says
    /// which. Aux data submitted at or after the request's aux deadline gets this too, after
    /// the deadline timed the request out ([`Event::TimedOut`] waiting for
    /// [`Wait::Aux`](super::Wait::Aux)).
    #[error("{0} already ended (failed, timed out, cancelled or completed: its event says which)")]
    SessionEnded(RequestId),
    /// The request still has writes that may touch its blocks; retire it after
    /// [`Event::Quiesced`].
    #[error("{0} is not quiesced yet; retire it after the Quiesced event")]
    NotQuiesced(RequestId),
    /// Aux data was already submitted for the request.
    #[error("aux data for {0} was already submitted")]
    AuxAlreadySubmitted(RequestId),
    /// No write batch with that id was ever issued.
    #[error("{0} was never issued")]
    UnknownBatch(WriteBatchId),
    /// The peer is already connected.
    #[error("{0} is already connected")]
    PeerAlreadyConnected(PeerId),
    /// The peer is not connected.
    #[error("{0} is not connected")]
    UnknownPeer(PeerId),
    /// A data-path answer for a peer whose handshake does not wait for one (it offered
    /// nothing, was answered already, or is ready, rejected or closing).
    #[error("{0} has no data-path offer waiting for an answer")]
    NoOfferPending(PeerId),
    /// A data-path offer or answer longer than the wire carries.
    #[error("a data-path offer or answer of {len} bytes (at most {max})")]
    DataPathTooLong {
        /// Its length.
        len: usize,
        /// The most a `Hello` or `HelloAccept` carries.
        max: usize,
    },
    /// The input belongs to the other role's endpoint.
    #[error("{input} is not an input of a {role:?} endpoint")]
    WrongRole {
        /// What was given.
        input: &'static str,
        /// This endpoint's role.
        role: Role,
    },
    /// A chunk's block runs do not answer its block windows group by group.
    #[error("chunk for {request}: runs given for groups {given:?}, its windows need {expected:?}")]
    RunsDoNotMatchChunk {
        /// The request.
        request: RequestId,
        /// Groups whose windows are non-empty, in order.
        expected: Vec<GroupIndex>,
        /// Groups the runs were given for.
        given: Vec<GroupIndex>,
    },
    /// The aux data does not fit in one frame.
    #[error("aux data for {request} takes {len} bytes, a frame carries at most {max}")]
    AuxTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded body length.
        len: u64,
        /// The frame body cap.
        max: u64,
    },
    /// The aux data does not fit in the aux slot a receiver of the request registered: it
    /// would be refused there after this side had completed.
    #[error(
        "aux data for {request} takes {len} bytes, the aux slot {peer} registered holds \
         {capacity}: submit at most {capacity} bytes (16 plus 4 per token)"
    )]
    AuxOverSlot {
        /// The request.
        request: RequestId,
        /// The receiver with the smallest aux slot.
        peer: PeerId,
        /// Bytes the aux data takes in a slot ([`AuxData::slot_len`]).
        ///
        /// [`AuxData::slot_len`]: crate::wire::AuxData::slot_len
        len: u64,
        /// That receiver's aux capacity.
        capacity: u32,
    },
    /// A registration's aux slot cannot hold any aux data (its two counts and two lengths
    /// alone take [`AuxData::SLOT_MIN`](crate::wire::AuxData::SLOT_MIN) bytes): every writer's
    /// aux data would be refused, after the writers had sent the KV.
    #[error(
        "registration of {request} gives an aux slot of {capacity} bytes, less than the {min} \
         any aux data takes (16 plus 4 per token): give at least {min}"
    )]
    AuxSlotTooSmall {
        /// The request.
        request: RequestId,
        /// The `aux_capacity` given.
        capacity: u32,
        /// The least any aux data takes.
        min: u64,
    },
    /// The registration does not fit in one frame.
    #[error("registration of {request} takes {len} bytes, a frame carries at most {max}")]
    RegistrationTooLarge {
        /// The request.
        request: RequestId,
        /// Encoded body length.
        len: u64,
        /// The frame body cap.
        max: u64,
    },
    /// The registration cannot be encoded (for example a hand-built [`AnchoredRun`] that is
    /// not canonical: an empty id run, or one that continues the previous one — build runs
    /// with [`AnchoredRun::from_ids`] or [`AnchoredRun::push`]).
    ///
    /// [`AnchoredRun`]: crate::AnchoredRun
    /// [`AnchoredRun::from_ids`]: crate::AnchoredRun::from_ids
    /// [`AnchoredRun::push`]: crate::AnchoredRun::push
    #[error("registration of {request} cannot be sent: {error}")]
    RegistrationUnencodable {
        /// The request.
        request: RequestId,
        /// Why the wire cannot carry it.
        error: crate::wire::EncodeError,
    },
    /// A windowed group's registration starts below the group's stale boundary: blocks there
    /// (sink tokens among them) are never sent.
    #[error(
        "registration of {request} {group} starts at block {first}, below the window's stale \
         boundary {stale}: blocks below it (sink tokens among them) are never sent; register \
         from block {stale} and fill the blocks below it on the decode side"
    )]
    RegistrationBelowWindow {
        /// The request.
        request: RequestId,
        /// The group.
        group: GroupIndex,
        /// The registration's first ordinal.
        first: u32,
        /// The group's stale boundary for the prompt.
        stale: u32,
    },
    /// The registration's writers do not cover what it expects exactly once (see
    /// [`ProtocolError::WritersDoNotCover`]); checked at once when every writer's handshake is
    /// known, else when the last one completes (then the request fails).
    #[error(transparent)]
    WritersDoNotCover(ProtocolError),
    /// The registration's expected part is not one part per layer group inside what this rank
    /// holds.
    #[error(
        "registration of {request} expects {group}'s {part}, but this rank holds {held} \
         (give one part per layer group, inside what the rank holds)"
    )]
    ExpectedPartNotHeld {
        /// The request.
        request: RequestId,
        /// The group (the first one past the layout when the counts differ).
        group: GroupIndex,
        /// The part expected (empty when missing).
        part: GroupPart,
        /// What the rank holds of the group (empty past the layout).
        held: GroupPart,
    },
    /// No data write was ever admitted with that ticket.
    #[error("{0} was never issued")]
    UnknownTicket(WriteTicket),
    /// A chunk's `prefix_sent_early` disagrees with whether the prefix was sent early.
    #[error(
        "chunk for {request}: prefix_sent_early must be {sent_early}, as the prefix was \
         {}sent early with Sender::submit_prefix",
        if *sent_early { "" } else { "not " }
    )]
    EarlyPrefixMismatch {
        /// The request.
        request: RequestId,
        /// Whether the prefix was sent early.
        sent_early: bool,
    },
    /// The first chunk starts after the cached prefix: the tokens between would never be
    /// sent.
    #[error(
        "the first chunk of {request} starts at token {start}, but its cached prefix ends at \
         {prepopulated_len}: the first chunk starts where the prefix ends (tokens between would \
         never be sent)"
    )]
    FirstChunkAfterPrefix {
        /// The request.
        request: RequestId,
        /// The chunk's first token.
        start: u32,
        /// The prefix length it declared.
        prepopulated_len: u32,
    },
    /// The early prefix goes before the first chunk, once.
    #[error("the prefix of {0} can only be sent early once, before its first chunk")]
    PrefixAfterChunks(RequestId),
    /// The registration's block ordinals do not end at its prompt's last block (see
    /// [`ProtocolError::RegistrationPastPrompt`] and [`ProtocolError::RegistrationShort`]).
    #[error(transparent)]
    RegistrationOutsidePrompt(ProtocolError),
    /// The request asks for something pipelined transfer cannot do.
    #[error("{request} cannot be transferred: {error}")]
    Unsupported {
        /// The request.
        request: RequestId,
        /// What is unsupported.
        error: crate::config::ConfigError,
    },
    /// A write failure was reported with [`TransferStatus::Success`].
    #[error("write failure for {0} reported with status Success")]
    FailureWithSuccessStatus(WriteBatchId),
}

/// How a block run broke the block-source contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockRunFault {
    /// More blocks than asked for.
    TooLong,
    /// The run does not end at the asked end (shifted, or holes dropped at the wrong place).
    WrongEnd,
    /// Fewer blocks than asked for in a group that keeps every block (full attention).
    TooShort,
    /// A windowed group's run starts past its stale boundary: a block the decode side still
    /// needs (inside the window at the end of prefill) is missing.
    InsideWindow,
}

/// The engine's answer to a chunk (its block runs, its prefix, its prompt) broke the engine's
/// side of the contract. Not a usage error: the submission was applied, and since the KV it
/// describes cannot be trusted the request was failed on both sides
/// ([`TransferStatus::EngineError`], or a protocol error towards a receiver whose registration
/// disagrees); an [`Event::Failed`] follows. Returned as [`Submitted::EngineFault`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EngineFault {
    /// The block source answered a chunk's query with a run that breaks its contract.
    #[error("{0}; the request was failed on both sides")]
    BlockRun(BlockRunError),
    /// A chunk says another prefix was cached than the request's earlier chunks said: blocks
    /// would be sent twice or never.
    #[error(
        "chunk for {request} says {got} prefix tokens were cached, earlier chunks said \
         {expected}; the request was failed on both sides"
    )]
    PrefixChanged {
        /// The request.
        request: RequestId,
        /// Prefix length of earlier chunks.
        expected: u32,
        /// This chunk's prefix length.
        got: u32,
    },
    /// The block source named a block whose slot lies past the memory of its layer group's
    /// pool ([`SenderConfig::region_bytes`](super::SenderConfig::region_bytes)): its bytes
    /// cannot be read.
    #[error(
        "block source named {block} for {request} in {group}, past its pools: the memory given \
         for them holds {slots} slots; the request was failed on both sides"
    )]
    BlockPastPool {
        /// The request.
        request: RequestId,
        /// The layer group.
        group: GroupIndex,
        /// The first block (in ordinal order) past the pools.
        block: crate::ids::BlockId,
        /// Slots the group's smallest pool holds.
        slots: u64,
    },
    /// A chunk's prompt length differs from what a receiver registered (the KV of the other
    /// tokens would never move).
    #[error(
        "chunk for {request} has a prompt of {local} tokens, the receiver registered \
         {registered}; the request was failed on both sides"
    )]
    PromptLenDiffersFromRegistration {
        /// The request.
        request: RequestId,
        /// Prompt length the receiver registered.
        registered: u32,
        /// Prompt length of the chunk.
        local: u32,
    },
}

/// A block run the engine's block source returned that breaks its contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[error(
    "block source broke its contract for {request} {group}: asked for ordinals [{}, {}), got \
     [{}, {}) ({})",
    asked.begin, asked.end, returned.begin, returned.end,
    match fault {
        BlockRunFault::TooLong => "longer than asked",
        BlockRunFault::WrongEnd => "does not end at the asked end",
        BlockRunFault::TooShort => "short in a full-attention group",
        BlockRunFault::InsideWindow => "misses a block inside the sliding window",
    }
)]
pub struct BlockRunError {
    /// The request.
    pub request: RequestId,
    /// The layer group.
    pub group: GroupIndex,
    /// The ordinals asked for.
    pub asked: BlockWindow,
    /// The ordinals the run covers.
    pub returned: BlockWindow,
    /// What is wrong.
    pub fault: BlockRunFault,
}
