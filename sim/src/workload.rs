//! The requests a simulation serves: when each arrives, its prompt, chunking, prefixes, which
//! sender ranks write it, when the receiver registers it and whether the engine cancels it.

use kvpipe_core::{Duration, RequestId};

use super::SimRng;
use kvpipe_conformance::cache::AllocationStyle;

/// Which engine cancels a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CancelSide {
    /// The prefill engine (every writer rank at once).
    Sender,
    /// The decode engine.
    Receiver,
}

/// One request of a simulation. Offsets count from the moment the request is admitted (its
/// start); the engine opens it on the senders at `open_after` and registers it on the receiver
/// at `register_after`, in whichever order they fall.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestPlan {
    /// The request.
    pub id: RequestId,
    /// Earliest start, from the simulation's origin.
    pub arrival: Duration,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Tokens the sender ranks have cached (prefill starts there).
    pub sender_prefix: u32,
    /// Tokens the receiver has cached (their full blocks are not sent).
    pub receiver_prefix: u32,
    /// End token of every prefill chunk, increasing, the last one `prompt_len`.
    pub chunk_ends: Vec<u32>,
    /// Sender ranks that write the request (several under tensor parallelism); the first one
    /// sends the aux data.
    pub writers: Vec<usize>,
    /// How the sender ranks allocate the request's blocks.
    pub allocation: AllocationStyle,
    /// When the senders open the request.
    pub open_after: Duration,
    /// When the receiver registers the request (before the open, or late, mid-prefill).
    pub register_after: Duration,
    /// Compute time of one prefill token.
    pub per_token: Duration,
    /// From the last chunk to the engine's aux data.
    pub aux_after: Duration,
    /// An engine cancel: when (from the start) and on which side.
    pub cancel: Option<(Duration, CancelSide)>,
}

impl RequestPlan {
    /// A plain request: prompt of `prompt_len` tokens in `chunks` equal chunks, written by
    /// sender rank 0, registered at once, no prefix and no cancel.
    pub fn simple(id: u64, prompt_len: u32, chunks: u32) -> Self {
        let chunks = chunks.clamp(1, prompt_len.max(1));
        let chunk_ends = (1..=chunks).map(|k| prompt_len * k / chunks).collect();
        RequestPlan {
            id: RequestId(id),
            arrival: Duration::ZERO,
            prompt_len,
            sender_prefix: 0,
            receiver_prefix: 0,
            chunk_ends,
            writers: vec![0],
            allocation: AllocationStyle::FullPrompt,
            open_after: Duration::from_micros(100),
            register_after: Duration::ZERO,
            per_token: Duration::from_micros(10),
            aux_after: Duration::from_micros(200),
            cancel: None,
        }
    }
}

/// Shape of a randomised workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkloadShape {
    /// Longest prompt, in tokens.
    pub max_prompt: u32,
    /// Most chunks per request.
    pub max_chunks: u32,
    /// Sender ranks available.
    pub senders: usize,
    /// Mean time between arrivals.
    pub mean_gap: Duration,
    /// Percentage of requests the engine cancels.
    pub cancel_percent: u64,
    /// Range of the prefill compute time per token.
    pub per_token: (Duration, Duration),
}

/// Draws `count` requests from `rng`.
pub fn random_workload(rng: &mut SimRng, count: usize, shape: &WorkloadShape) -> Vec<RequestPlan> {
    let mut at = 0u64;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        at += rng.range(0, 2 * shape.mean_gap.as_nanos());
        let prompt_len = rng.range(1, u64::from(shape.max_prompt)) as u32;
        let sender_prefix = if rng.chance(0.25) {
            rng.below(u64::from(prompt_len)) as u32
        } else {
            0
        };
        let receiver_prefix = if rng.chance(0.25) {
            rng.range(0, u64::from(prompt_len)) as u32
        } else {
            0
        };
        let span = prompt_len - sender_prefix;
        let chunks = rng.range(1, u64::from(shape.max_chunks.min(span))) as usize;
        let mut cuts: Vec<u32> = (1..chunks)
            .map(|_| sender_prefix + rng.range(1, u64::from(span)) as u32)
            .filter(|&c| c < prompt_len)
            .collect();
        cuts.push(prompt_len);
        cuts.sort_unstable();
        cuts.dedup();
        let writers = if shape.senders > 1 && rng.chance(0.4) {
            let first = rng.below(shape.senders as u64) as usize;
            let second = (first + 1 + rng.below(shape.senders as u64 - 1) as usize) % shape.senders;
            vec![first, second]
        } else {
            vec![rng.below(shape.senders as u64) as usize]
        };
        let per_token = Duration::from_nanos(
            rng.range(shape.per_token.0.as_nanos(), shape.per_token.1.as_nanos()),
        );
        let prefill = per_token.as_nanos() * u64::from(span);
        // Mostly generation-first (register before prefill), sometimes late, mid-prefill.
        let (open_after, register_after) = match rng.below(4) {
            0 => (
                Duration::ZERO,
                Duration::from_nanos(rng.range(0, prefill + 200_000)),
            ),
            _ => (Duration::from_nanos(rng.range(0, 300_000)), Duration::ZERO),
        };
        let cancel = rng.chance(shape.cancel_percent as f64 / 100.0).then(|| {
            let side = if rng.chance(0.5) {
                CancelSide::Sender
            } else {
                CancelSide::Receiver
            };
            (Duration::from_nanos(rng.range(0, prefill + 500_000)), side)
        });
        out.push(RequestPlan {
            id: RequestId(i as u64 + 1),
            arrival: Duration::from_nanos(at),
            prompt_len,
            sender_prefix,
            receiver_prefix,
            chunk_ends: cuts,
            writers,
            allocation: if rng.chance(0.5) {
                AllocationStyle::FullPrompt
            } else {
                AllocationStyle::Incremental
            },
            open_after,
            register_after,
            per_token,
            aux_after: Duration::from_nanos(rng.range(0, 400_000)),
            cancel,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{random_workload, WorkloadShape};
    use crate::SimRng;
    use kvpipe_core::Duration;

    #[test]
    fn random_requests_are_well_formed() {
        let shape = WorkloadShape {
            max_prompt: 90,
            max_chunks: 6,
            senders: 3,
            mean_gap: Duration::from_micros(100),
            cancel_percent: 20,
            per_token: (Duration::from_micros(2), Duration::from_micros(20)),
        };
        let plans = random_workload(&mut SimRng::new(5), 2000, &shape);
        let mut two_writers = 0;
        let mut late = 0;
        for (i, p) in plans.iter().enumerate() {
            assert_eq!(p.id.0, i as u64 + 1);
            assert!((1..=90).contains(&p.prompt_len));
            assert!(p.sender_prefix < p.prompt_len && p.receiver_prefix <= p.prompt_len);
            assert_eq!(*p.chunk_ends.last().unwrap(), p.prompt_len);
            assert!(p.chunk_ends.len() <= 6);
            let mut start = p.sender_prefix;
            for &end in &p.chunk_ends {
                assert!(end > start, "{p:?}");
                start = end;
            }
            assert!(!p.writers.is_empty() && p.writers.iter().all(|&w| w < 3));
            if p.writers.len() == 2 {
                assert_ne!(p.writers[0], p.writers[1]);
                two_writers += 1;
            }
            late += usize::from(p.register_after > p.open_after);
            if i > 0 {
                assert!(p.arrival >= plans[i - 1].arrival);
            }
        }
        assert!(two_writers > 400 && late > 200, "{two_writers} {late}");
    }
}
