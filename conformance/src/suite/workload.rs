//! What a run of the engine model does ([`Workload`]): the caches' shape, the requests
//! ([`RequestPlan`]) and what is done to them ([`Interrupt`]), how the KV leaves the sender
//! ([`TransferMode`], [`layer_slices`]), deadlines and faults, and which checks run.

use kvpipe_core::session::Deadlines;
use kvpipe_core::wire::{Role, VersionRange};
use kvpipe_core::{Duration, LayerOrder, LayerRange, RequestId};

use super::{FaultPlan, SimulatedCompute};
use crate::cache::{AllocationStyle, CacheSpec, GroupSpec};

/// How the KV leaves the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// Each chunk's blocks as soon as the chunk is computed.
    Pipelined,
    /// Everything in one slice after the whole prefill (the baseline).
    Monolithic,
    /// Each chunk in layer ranges of this many layers, each range as soon as its layers are
    /// computed (the chunk's simulated compute is spread over its layers), so the last
    /// chunk's transfer overlaps its own compute.
    LayerSlices(u16),
}

impl TransferMode {
    /// `pipelined`, `monolithic` or `layer slices of N`.
    pub fn describe(self) -> String {
        match self {
            TransferMode::Pipelined => "pipelined".into(),
            TransferMode::Monolithic => "monolithic".into(),
            TransferMode::LayerSlices(n) => format!("pipelined, layer slices of {n}"),
        }
    }

    /// Whether chunks leave as they are computed (in layer slices or whole).
    pub fn is_pipelined(self) -> bool {
        !matches!(self, TransferMode::Monolithic)
    }
}

/// The layer ranges of `per_slice` layers a chunk of a model with these groups is submitted
/// in, in compute order (the sender's [`LayerOrder`] indexes them):
/// from layer 0 to the groups' layers summed, the last range possibly shorter; at least one.
pub fn layer_slices(groups: &[GroupSpec], per_slice: u16) -> Vec<LayerRange> {
    let layers: u32 = groups
        .iter()
        .map(|g| u32::from(g.layers))
        .sum::<u32>()
        .max(1);
    let step = u32::from(per_slice.max(1));
    (0..layers)
        .step_by(step as usize)
        .map(|begin| LayerRange::new(begin, (begin + step).min(layers)))
        .collect()
}

/// Something done to a request right after one of its chunks was submitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Interrupt {
    /// That side's engine cancels the request.
    Cancel(Role),
    /// That side's process dies.
    Kill(Role),
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestPlan {
    /// The request id.
    pub id: RequestId,
    /// Prompt length in tokens.
    pub prompt: u32,
    /// Prefill chunk length in tokens.
    pub chunk: u32,
    /// Tokens the sender has cached already (prefix reuse).
    pub sender_prefix: u32,
    /// Tokens the receiver has cached already (prefix reuse).
    pub receiver_prefix: u32,
    /// The receiver registers after this many chunks were submitted (0: before prefill).
    pub register_after_chunks: u32,
    /// An interrupt applied after chunk `.0` (0-based) was submitted.
    pub interrupt: Option<(u32, Interrupt)>,
    /// The sender's cached prefix is sent before the first chunk
    /// ([`Sender::submit_prefix`](kvpipe_core::Sender::submit_prefix)).
    pub prefix_early: bool,
}

impl RequestPlan {
    /// A request of `prompt` tokens in chunks of `chunk`, no prefixes, registered up front.
    pub fn new(id: u64, prompt: u32, chunk: u32) -> Self {
        RequestPlan {
            id: RequestId(id),
            prompt,
            chunk,
            sender_prefix: 0,
            receiver_prefix: 0,
            register_after_chunks: 0,
            interrupt: None,
            prefix_early: false,
        }
    }

    /// The chunks' token ranges, from the sender's prefix to the prompt's end.
    pub fn chunks(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let mut start = self.sender_prefix.min(self.prompt);
        let step = self.chunk.max(1);
        loop {
            let end = start.saturating_add(step).min(self.prompt);
            out.push((start, end));
            if end >= self.prompt {
                return out;
            }
            start = end;
        }
    }
}

/// Everything one run does.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// The layer groups (the sender's pool split).
    pub groups: Vec<GroupSpec>,
    /// The receiver's pool split per group (`None`: the sender's).
    pub receiver_pool_split: Option<Vec<Vec<u16>>>,
    /// Extra block slots per group beyond what the requests need.
    pub spare_slots: u32,
    /// Seed of a shuffled slot order (fragmented block tables); `None`: contiguous.
    pub slot_order_seed: Option<u64>,
    /// How the sender allocates blocks.
    pub allocation: AllocationStyle,
    /// The requests, prefilled round-robin chunk by chunk.
    pub requests: Vec<RequestPlan>,
    /// Simulated compute time of one prefill chunk.
    pub prefill_per_chunk: std::time::Duration,
    /// Pipelined or monolithic.
    pub mode: TransferMode,
    /// The order the sender's engine computes its layers in, which layer ranges index
    /// ([`TransferMode::LayerSlices`]; default: the groups stacked).
    pub layer_order: LayerOrder,
    /// Both endpoints' deadlines.
    pub deadlines: Deadlines,
    /// Faults to inject.
    pub faults: FaultPlan,
    /// Versions the receiver speaks (`None`: this build's).
    pub receiver_versions: Option<VersionRange>,
    /// Check the receiver's cache against the deterministic content too (slow for big caches).
    pub verify_content: bool,
    /// Snapshot the receiver's memory to check nothing outside granted blocks changed (doubles
    /// the receiver's memory).
    pub check_untouched: bool,
    /// Flip one destination byte after the transfer (tests that verification catches it).
    pub corrupt_one_byte: bool,
    /// How the simulated compute passes: the engine's thread asleep, or a GPU kept busy.
    pub compute: SimulatedCompute,
    /// How long the whole run may take.
    pub time_limit: std::time::Duration,
}

impl Workload {
    /// A small single-group workload with checks on and generous deadlines.
    pub fn small(requests: Vec<RequestPlan>) -> Self {
        Workload {
            tokens_per_block: 4,
            groups: vec![GroupSpec::full(2, &[2])],
            receiver_pool_split: None,
            spare_slots: 3,
            slot_order_seed: None,
            allocation: AllocationStyle::FullPrompt,
            requests,
            prefill_per_chunk: std::time::Duration::ZERO,
            mode: TransferMode::Pipelined,
            layer_order: LayerOrder::stacked(),
            deadlines: suite_deadlines(),
            faults: FaultPlan::default(),
            receiver_versions: None,
            verify_content: true,
            check_untouched: true,
            corrupt_one_byte: false,
            compute: SimulatedCompute::Sleep,
            time_limit: std::time::Duration::from_secs(20),
        }
    }

    pub(super) fn cache_spec(&self, receiver: bool) -> CacheSpec {
        let blocks: u32 = self
            .requests
            .iter()
            .map(|r| r.prompt.div_ceil(self.tokens_per_block))
            .sum();
        CacheSpec {
            tokens_per_block: self.tokens_per_block,
            groups: self
                .groups
                .iter()
                .enumerate()
                .map(|(g, gs)| {
                    let mut gs = gs.clone();
                    if receiver {
                        if let Some(split) =
                            self.receiver_pool_split.as_ref().and_then(|s| s.get(g))
                        {
                            gs.pool_split = split.clone();
                        }
                    }
                    gs
                })
                .collect(),
            slots_per_group: blocks + self.spare_slots,
            first_region: if receiver { 1000 } else { 1 },
            slot_order_seed: self.slot_order_seed.map(|s| s ^ u64::from(receiver)),
            materialize: true,
        }
    }
}

/// Deadlines short enough that failure scenarios end quickly, long enough for a loaded CI
/// machine.
pub(crate) fn suite_deadlines() -> Deadlines {
    Deadlines {
        handshake: Duration::from_secs(5),
        registration: Duration::from_secs(5),
        write_completion: Duration::from_secs(10),
        result_wait: Duration::from_secs(15),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_secs(15),
        aux_wait: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(200),
        liveness_timeout: Duration::from_secs(5),
        quiesce: Duration::from_secs(2),
    }
}

#[cfg(test)]
mod tests {
    use super::RequestPlan;

    #[test]
    fn a_chunk_longer_than_the_rest_of_the_prompt_is_the_rest() {
        let mut plan = RequestPlan::new(1, 100, 40);
        assert_eq!(plan.chunks(), vec![(0, 40), (40, 80), (80, 100)]);
        // Chunk ends past u32::MAX end at the prompt instead of wrapping around.
        plan.chunk = u32::MAX;
        plan.sender_prefix = 10;
        assert_eq!(plan.chunks(), vec![(10, 100)]);
        plan.prompt = u32::MAX;
        plan.sender_prefix = u32::MAX - 1;
        assert_eq!(plan.chunks(), vec![(u32::MAX - 1, u32::MAX)]);
    }
}
