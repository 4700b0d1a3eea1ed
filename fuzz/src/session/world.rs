//! The case's small world: the fixed layout, deadlines and configurations of both endpoints,
//! the requests' ids and prompt lengths, the sender's fixed block source and aux data.

use kvpipe_core::session::{Deadlines, LocalHello, ReceiverConfig, SenderConfig};
use kvpipe_core::wire::{AuxData, Topology};
use kvpipe_core::{
    BlockId, BlockRun, BlockSource, BlockSourceError, Duration, GroupIndex, InstanceId,
    LayerGroupLayout, PeerId, PoolLayout, RegionId, RequestId,
};

/// Tokens per block of the fixed layout.
pub(super) const TPB: u32 = 4;

/// Bytes per block slot.
pub(super) const SLOT: u64 = 128;

/// How the receiver names the sender.
pub(super) const SENDER: PeerId = PeerId(0);

/// How the sender names the receiver.
pub(super) const RECEIVER: PeerId = PeerId(1000);

/// Request ids the cases fold into.
pub(super) const REQUESTS: u64 = 4;

/// The receiver's pool region.
pub(super) const RECEIVER_REGION: RegionId = RegionId(2);

pub(super) fn layout(region: u32) -> Vec<LayerGroupLayout> {
    vec![LayerGroupLayout {
        layers: 2,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 4,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: None,
        block_layout: Default::default(),
        shard: Default::default(),
        pools: [PoolLayout {
            region: RegionId(region),
            layer_begin: 0,
            layers: 2,
            slot_bytes: SLOT,
        }]
        .into_iter()
        .collect(),
    }]
}

pub(super) fn deadlines() -> Deadlines {
    Deadlines {
        handshake: Duration::from_millis(100),
        registration: Duration::from_millis(1_000),
        write_completion: Duration::from_millis(200),
        result_wait: Duration::from_millis(2_000),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_millis(2_000),
        aux_wait: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(50),
        liveness_timeout: Duration::from_millis(400),
        quiesce: Duration::from_millis(150),
    }
}

pub(super) fn sender_config() -> SenderConfig {
    let mut sc = SenderConfig::new(LocalHello::new(
        InstanceId(1),
        Topology::default(),
        layout(1),
    ));
    sc.deadlines = deadlines();
    sc
}

pub(super) fn receiver_config() -> ReceiverConfig {
    let mut rc = ReceiverConfig::new(
        LocalHello::new(InstanceId(2), Topology::default(), layout(2)),
        7,
    );
    rc.deadlines = deadlines();
    rc
}

/// The prompt length of request `r` (fixed, so both engines agree).
pub(super) fn prompt_len(r: RequestId) -> u32 {
    5 + 7 * r.0 as u32
}

/// Folds any request id into `1..=REQUESTS` (ids already there stay).
pub(super) fn fold(r: RequestId) -> RequestId {
    RequestId(r.0.wrapping_sub(1) % REQUESTS + 1)
}

pub(super) fn request(r: u8) -> RequestId {
    RequestId(u64::from(r) % REQUESTS + 1)
}

/// Request `r`'s blocks on the sender: ordinal `o` in slot `100 * r + o`.
pub(super) struct FixedSource;

impl BlockSource for FixedSource {
    fn block_run(
        &mut self,
        request: RequestId,
        _group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let blocks = prompt_len(request).div_ceil(TPB);
        if begin > end {
            return Err(BlockSourceError::BeginAfterEnd { begin, end });
        }
        if end > blocks {
            return Err(BlockSourceError::PastAllocation {
                end,
                allocated: blocks,
            });
        }
        out.first_ordinal = begin;
        out.ids.clear();
        out.ids
            .extend((begin..end).map(|o| BlockId(100 * request.0 as u32 + o)));
        Ok(())
    }
}

/// A well-formed aux data for request `r`.
pub(super) fn aux_data(r: RequestId) -> AuxData {
    AuxData {
        prompt_tokens: prompt_len(r),
        cached_tokens: 0,
        first_tokens: vec![7],
        draft_tokens: vec![],
    }
}
