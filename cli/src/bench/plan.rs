//! `kvpipe bench plan`: what planning one prefill chunk costs.
//!
//! A 131072-token prompt in 1024-token chunks (32 tokens per block, two layer groups) is
//! prefilled on the reference cache. The bench times planning the first and the last chunk —
//! chunk window, bounded block query, ordinal pairing, coalescing — which must cost the same,
//! since the work is O(chunk), not O(request). The baseline plans the same last chunk the
//! whole-list way (fetch every block of the request, then project onto the chunk). It also
//! counts heap allocations over a steady-state pass over every chunk (none expected).
//! Figures are medians over many repetitions.

use std::process::ExitCode;
use std::time::Instant;

use kvpipe_conformance::cache::{
    AllocationStyle, CacheSpec, ChunkPlanner, GroupSpec, ReferenceCache,
};
use kvpipe_core::{
    chunk_window, plan_group, AnchoredRun, BlockRun, ChunkSpec, DstCursor, GroupIndex,
    LayerGroupLayout, RequestId, WritePlan,
};
use serde::Serialize;

use crate::{preflight, CliError};

/// Arguments of `kvpipe bench plan`.
#[derive(Debug, clap::Args)]
pub(crate) struct PlanBenchArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Tokens in the prompt.
    #[arg(long, default_value_t = 131_072)]
    prompt_tokens: u32,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 1024)]
    chunk_tokens: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: u32,
    /// Timed samples per figure (the median is reported).
    #[arg(long, default_value_t = 2001)]
    samples: u32,
    /// Plannings per timed sample.
    #[arg(long, default_value_t = 16)]
    batch: u32,
    /// Hand out cache slots in a shuffled order on both sides, so block tables are fragmented
    /// (no coalescing; the receiver's run has one id run per block).
    #[arg(long)]
    fragmented: bool,
}

/// The figures `kvpipe bench plan` prints.
#[derive(Debug, Serialize)]
pub(crate) struct PlanBenchReport {
    prompt_tokens: u32,
    chunk_tokens: u32,
    tokens_per_block: u32,
    layer_groups: u32,
    chunks: u32,
    first_chunk_ns: f64,
    last_chunk_ns: f64,
    naive_last_chunk_ns: f64,
    allocs_per_chunk: f64,
    /// `last_chunk_ns / first_chunk_ns` (target ≤ 1.2).
    last_over_first: f64,
    /// `naive_last_chunk_ns / last_chunk_ns` (target ≥ 20).
    naive_over_last: f64,
    /// Extents of the last chunk's plan (after coalescing).
    last_chunk_extents: u32,
    /// Samples per median, plannings per sample.
    samples: u32,
    batch: u32,
    /// Whether slots were handed out in a shuffled order.
    fragmented: bool,
}

const REQUEST: RequestId = RequestId(1);

/// Two layer groups (4 layers in two pools, 4 layers in one), 8 KV heads of 128 bf16 elements.
fn groups() -> Vec<GroupSpec> {
    let g = |split: &[u16]| GroupSpec {
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        ..GroupSpec::full(split.iter().sum(), split)
    };
    vec![g(&[2, 2]), g(&[4])]
}

fn chunk(args: &PlanBenchArgs, index: u32) -> ChunkSpec {
    let start = index * args.chunk_tokens;
    let end = start
        .saturating_add(args.chunk_tokens)
        .min(args.prompt_tokens);
    ChunkSpec {
        start,
        end,
        prompt_len: args.prompt_tokens,
        prepopulated_len: 0,
        is_last: end == args.prompt_tokens,
        prefix_sent_early: false,
    }
}

/// Medians, in ns per call, of `samples` timings of `batch` calls of each of the three
/// workloads. The workloads take turns sample by sample, so a noisy neighbour on the machine
/// slows all three alike instead of skewing their ratios.
fn interleaved_medians(samples: u32, batch: u32, work: &mut [&mut dyn FnMut(); 3]) -> [f64; 3] {
    let batch = batch.max(1);
    let mut times: [Vec<f64>; 3] = Default::default();
    for _ in 0..samples.max(1) {
        for (f, v) in work.iter_mut().zip(&mut times) {
            let t = Instant::now();
            for _ in 0..batch {
                f();
            }
            v.push(t.elapsed().as_nanos() as f64 / f64::from(batch));
        }
    }
    times.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    })
}

/// The whole-list baseline: fetch every block of the request, project onto the chunk's window,
/// then pair and coalesce as usual.
fn plan_whole_list(
    sender: &ReferenceCache,
    src_layouts: &[LayerGroupLayout],
    dst_layouts: &[LayerGroupLayout],
    runs: &[AnchoredRun],
    chunk: &ChunkSpec,
    plan: &mut WritePlan,
) -> Result<(), CliError> {
    plan.clear();
    for (g, layout) in src_layouts.iter().enumerate() {
        let Some(w) = chunk_window(chunk, layout)? else {
            continue;
        };
        let whole = sender.whole_block_list(REQUEST, GroupIndex(g as u16))?;
        let from = w.begin.max(whole.first_ordinal);
        let end = w.end.min(whole.end_ordinal()).max(from);
        let lo = (from - whole.first_ordinal) as usize;
        let hi = (end - whole.first_ordinal) as usize;
        let src = BlockRun {
            first_ordinal: from,
            ids: whole.ids[lo..hi].to_vec(),
        };
        plan_group(layout, &dst_layouts[g], &src, &runs[g], plan)?;
    }
    Ok(())
}

/// Runs the bench (allocation counts are meaningful only in the `kvpipe` binary, whose global
/// allocator counts).
pub(crate) fn measure(args: &PlanBenchArgs) -> Result<PlanBenchReport, CliError> {
    preflight::at_least("--prompt-tokens", args.prompt_tokens.into(), 1)?;
    preflight::at_least("--chunk-tokens", args.chunk_tokens.into(), 1)?;
    preflight::at_least("--tokens-per-block", args.tokens_per_block.into(), 1)?;
    preflight::at_least("--samples", args.samples.into(), 1)?;
    preflight::at_least("--batch", args.batch.into(), 1)?;
    let chunks = args.prompt_tokens.div_ceil(args.chunk_tokens);
    let total = args.prompt_tokens.div_ceil(args.tokens_per_block);
    // Both sides' block tables, the whole-list baseline's list and the timings.
    let chunk_blocks = u64::from(args.chunk_tokens.div_ceil(args.tokens_per_block)) + 1;
    let samples = u64::from(args.samples)
        .checked_mul(3 * 8)
        .and_then(|b| b.checked_add(u64::from(total) * 16));
    preflight::MemoryNeed::new("--prompt-tokens or --samples")
        .add(
            format!("block tables of {total} blocks on both sides"),
            preflight::tables(2, groups().len() as u64, total.into(), chunk_blocks),
        )
        .add("the baseline's block lists and the timings", samples)
        .check()?;
    let spec = |first_region: u32| CacheSpec {
        tokens_per_block: args.tokens_per_block,
        groups: groups(),
        slots_per_group: total,
        first_region,
        slot_order_seed: args.fragmented.then_some(u64::from(first_region)),
        materialize: false,
    };
    let mut sender = ReferenceCache::new(&spec(1))?;
    let mut receiver = ReferenceCache::new(&spec(101))?;
    sender.begin_prefill(REQUEST, args.prompt_tokens, 0, AllocationStyle::FullPrompt)?;
    for i in 0..chunks {
        let c = chunk(args, i);
        sender.compute_chunk(REQUEST, c.start, c.end)?;
    }
    let runs = receiver.register_destination(REQUEST, args.prompt_tokens, 0)?;
    let src_layouts = sender.layouts();
    let dst_layouts = receiver.layouts();
    let mut planner = ChunkPlanner::new(src_layouts.clone(), dst_layouts.clone(), runs.clone());

    // Warm-up pass: buffers grow to their steady-state size.
    for i in 0..chunks {
        planner.plan_chunk(&mut sender, REQUEST, &chunk(args, i))?;
    }
    // Steady-state pass over every chunk, counting allocations.
    let before = crate::allocations();
    for i in 0..chunks {
        planner.plan_chunk(&mut sender, REQUEST, &chunk(args, i))?;
    }
    let allocs = crate::allocations() - before;

    let first = chunk(args, 0);
    let last = chunk(args, chunks - 1);
    let bounded_plan = {
        planner.plan_chunk(&mut sender, REQUEST, &last)?;
        planner.plan().clone()
    };

    let mut naive_plan = WritePlan::new();
    let naive = |sender: &ReferenceCache, plan: &mut WritePlan| {
        plan_whole_list(sender, &src_layouts, &dst_layouts, &runs, &last, plan)
    };
    naive(&sender, &mut naive_plan)?;
    if naive_plan != bounded_plan {
        return Err("the whole-list baseline planned a different last chunk".into());
    }

    // Each timed planning starts from the cursors the previous chunk left, as in a real
    // pipeline (chunk 0: a fresh request; the last chunk: after the one before it).
    let fresh = vec![DstCursor::default(); planner.cursors().len()];
    planner.restore_cursors(&fresh);
    for i in 0..chunks - 1 {
        planner.plan_chunk(&mut sender, REQUEST, &chunk(args, i))?;
    }
    let before_last = planner.cursors().to_vec();
    let failure: std::cell::RefCell<Option<CliError>> = std::cell::RefCell::new(None);
    let (planner, sender, naive_plan) = (
        std::cell::RefCell::new(planner),
        std::cell::RefCell::new(sender),
        std::cell::RefCell::new(naive_plan),
    );
    let plan_from = |c: &ChunkSpec, cursors: &[DstCursor]| {
        let mut planner = planner.borrow_mut();
        planner.restore_cursors(cursors);
        if let Err(e) = planner.plan_chunk(&mut *sender.borrow_mut(), REQUEST, c) {
            failure.borrow_mut().get_or_insert(e.into());
        }
    };
    let [first_chunk_ns, last_chunk_ns, naive_last_chunk_ns] = interleaved_medians(
        args.samples,
        args.batch,
        &mut [
            &mut || plan_from(&first, &fresh),
            &mut || plan_from(&last, &before_last),
            &mut || {
                if let Err(e) = naive(&sender.borrow(), &mut naive_plan.borrow_mut()) {
                    failure.borrow_mut().get_or_insert(e);
                }
            },
        ],
    );
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }

    Ok(PlanBenchReport {
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        tokens_per_block: args.tokens_per_block,
        layer_groups: src_layouts.len() as u32,
        chunks,
        first_chunk_ns,
        last_chunk_ns,
        naive_last_chunk_ns,
        allocs_per_chunk: allocs as f64 / f64::from(chunks),
        last_over_first: last_chunk_ns / first_chunk_ns,
        naive_over_last: naive_last_chunk_ns / last_chunk_ns,
        last_chunk_extents: bounded_plan.len() as u32,
        samples: args.samples,
        batch: args.batch,
        fragmented: args.fragmented,
    })
}

pub(crate) fn run(args: PlanBenchArgs) -> Result<ExitCode, CliError> {
    let r = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "plan bench: {} tokens in {} chunks of {}, {} tokens per block, {} layer groups{} \
         (medians of {} samples × {})",
        r.prompt_tokens,
        r.chunks,
        r.chunk_tokens,
        r.tokens_per_block,
        r.layer_groups,
        if r.fragmented {
            ", fragmented slots"
        } else {
            ""
        },
        r.samples,
        r.batch
    );
    println!("  first chunk            {:>10.0} ns", r.first_chunk_ns);
    println!(
        "  last chunk             {:>10.0} ns   last/first  {:.2} (target ≤ 1.2)",
        r.last_chunk_ns, r.last_over_first
    );
    println!(
        "  last chunk, whole list {:>10.0} ns   naive/last  {:.1} (target ≥ 20)",
        r.naive_last_chunk_ns, r.naive_over_last
    );
    println!(
        "  allocations per chunk  {:>10.2}      (target 0)",
        r.allocs_per_chunk
    );
    println!(
        "  extents in the last chunk's plan: {}",
        r.last_chunk_extents
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the bench's logic on a small prompt (no timing asserted): the plans it compares
    /// agree and the figures are well-formed.
    #[test]
    fn bench_logic_runs_on_a_small_prompt() {
        let args = PlanBenchArgs {
            json: true,
            prompt_tokens: 4096,
            chunk_tokens: 512,
            tokens_per_block: 32,
            samples: 3,
            batch: 1,
            fragmented: false,
        };
        let r = measure(&args).unwrap();
        assert_eq!(r.chunks, 8);
        assert_eq!(r.layer_groups, 2);
        // Contiguous slots: one extent per pool and group (2 + 1).
        assert_eq!(r.last_chunk_extents, 3);
        assert!(r.first_chunk_ns > 0.0 && r.last_chunk_ns > 0.0 && r.naive_last_chunk_ns > 0.0);
        // Fragmented slots: nothing coalesces, one extent per block and pool.
        let fragmented = measure(&PlanBenchArgs {
            fragmented: true,
            ..args
        })
        .unwrap();
        assert_eq!(fragmented.last_chunk_extents, 16 * 3);
        let json = serde_json::to_value(&r).unwrap();
        for key in [
            "prompt_tokens",
            "chunk_tokens",
            "tokens_per_block",
            "layer_groups",
            "chunks",
            "first_chunk_ns",
            "last_chunk_ns",
            "naive_last_chunk_ns",
            "allocs_per_chunk",
        ] {
            assert!(json.get(key).is_some(), "{key} missing");
        }
    }
}
