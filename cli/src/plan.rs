//! `kvpipe plan`: shows how a chunked prefill is sent — per chunk and layer group, the block
//! window, the source run and the coalesced write extents — computed by the core's geometry and
//! planner against the reference cache.

use std::process::ExitCode;

use kvpipe_conformance::cache::{
    AllocationStyle, CacheSpec, ChunkPlanner, GroupSpec, ReferenceCache,
};
use kvpipe_core::{total_blocks, ChunkSpec, GroupIndex, RequestId, StaleBoundary};
use serde::Serialize;

use super::{preflight, CliError};

/// Arguments of `kvpipe plan`.
#[derive(Debug, clap::Args)]
pub(crate) struct PlanArgs {
    /// Tokens in the prompt.
    #[arg(long)]
    prompt_tokens: u32,
    /// Tokens per KV block.
    #[arg(long)]
    tokens_per_block: u32,
    /// The prefill chunks as `start:end` token ranges, comma-separated, consecutive from the
    /// sender prefix to the prompt's end (e.g. `0:6,6:12,12:32`).
    #[arg(long, value_delimiter = ',', value_parser = parse_chunk, required = true)]
    chunks: Vec<(u32, u32)>,
    /// Adds a second layer group with a sliding window of this many tokens.
    #[arg(long)]
    window: Option<u32>,
    /// Prompt tokens the sender has cached (reused prefix): the first chunk starts there.
    #[arg(long, default_value_t = 0)]
    sender_prefix: u32,
    /// Prompt tokens the receiver has cached: their full blocks are not sent.
    #[arg(long, default_value_t = 0)]
    receiver_prefix: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_chunk(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("chunk `{s}` is not `start:end`"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|e| format!("chunk `{s}`: `{v}` is not a token index ({e})"))
    };
    Ok((parse(a)?, parse(b)?))
}

/// The whole report of `kvpipe plan`.
#[derive(Debug, Serialize)]
pub(crate) struct PlanReport {
    prompt_tokens: u32,
    tokens_per_block: u32,
    total_blocks: u32,
    sender_prefix: u32,
    receiver_prefix: u32,
    groups: Vec<GroupInfo>,
    chunks: Vec<ChunkReport>,
}

/// One layer group of the report.
#[derive(Debug, Serialize)]
struct GroupInfo {
    group: u16,
    window: Option<u32>,
    /// Whether the window is shorter than the prompt (otherwise it streams as full attention).
    windowed: bool,
    stale_boundary: u32,
    /// First ordinal the receiver registered (after its cached prefix / the stale boundary).
    receiver_first_ordinal: u32,
}

/// One chunk of the report.
#[derive(Debug, Serialize)]
struct ChunkReport {
    start: u32,
    end: u32,
    is_last: bool,
    groups: Vec<GroupReport>,
}

/// One group of one chunk.
#[derive(Debug, Serialize)]
struct GroupReport {
    group: u16,
    /// `None` when the group sends nothing in this chunk.
    block_begin: Option<u32>,
    block_end: Option<u32>,
    src_first_ordinal: Option<u32>,
    src_blocks: u32,
    paired_blocks: u32,
    bytes: u64,
    extents: Vec<ExtentReport>,
}

/// One coalesced write.
#[derive(Debug, Serialize, PartialEq, Eq)]
struct ExtentReport {
    src_region: u32,
    src_offset: u64,
    dst_region: u32,
    dst_offset: u64,
    len: u64,
}

/// A group of `layers` layers with a typical head geometry (8 KV heads of 128 bf16 elements).
fn group_spec(pool_split: &[u16], window: Option<u32>) -> GroupSpec {
    GroupSpec {
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        window,
        ..GroupSpec::full(pool_split.iter().sum(), pool_split)
    }
}

/// Computes the report (no printing).
pub(crate) fn report(args: &PlanArgs) -> Result<PlanReport, CliError> {
    let tpb = args.tokens_per_block;
    preflight::at_least("--prompt-tokens", args.prompt_tokens.into(), 1)?;
    preflight::at_least("--tokens-per-block", tpb.into(), 1)?;
    if let Some(w) = args.window {
        preflight::at_least("--window", w.into(), 1)?;
    }
    for (flag, prefix) in [
        ("--sender-prefix", args.sender_prefix),
        ("--receiver-prefix", args.receiver_prefix),
    ] {
        if prefix > args.prompt_tokens {
            return Err(format!(
                "{flag} {prefix} is longer than the prompt ({} tokens)",
                args.prompt_tokens
            )
            .into());
        }
    }
    let total = total_blocks(args.prompt_tokens, tpb)?;
    // Both sides' block tables, and the block lists of the longest chunk.
    let longest = args
        .chunks
        .iter()
        .map(|&(a, b)| u64::from(b.saturating_sub(a)).div_ceil(u64::from(tpb)) + 1)
        .max()
        .unwrap_or(0);
    let groups = 1 + u64::from(args.window.is_some());
    preflight::MemoryNeed::new("--prompt-tokens, or raise --tokens-per-block")
        .add(
            format!("block tables of {total} blocks on both sides"),
            preflight::tables(2, groups, total.into(), longest),
        )
        .check()?;
    let mut start = args.sender_prefix;
    for (i, &(a, b)) in args.chunks.iter().enumerate() {
        if i > 0 && start == args.prompt_tokens {
            return Err(format!(
                "chunk {i} ({a}:{b}) comes after chunk {} ({}:{start}), which ends at the \
                 prompt's end and is the final chunk: a sender refuses a chunk after the last \
                 one, so drop chunk {i}",
                i - 1,
                args.chunks[i - 1].0
            )
            .into());
        }
        if a != start {
            return Err(format!(
                "chunk {i} ({a}:{b}) must start at token {start}: chunks are consecutive and \
                 the first starts at the sender prefix"
            )
            .into());
        }
        start = b;
    }
    if start != args.prompt_tokens {
        return Err(format!(
            "the chunks end at token {start}, not at the prompt's end {}",
            args.prompt_tokens
        )
        .into());
    }
    let mut groups = vec![group_spec(&[2, 2], None)];
    if let Some(w) = args.window {
        groups.push(group_spec(&[4], Some(w)));
    }
    let spec = |first_region| CacheSpec {
        tokens_per_block: tpb,
        groups: groups.clone(),
        slots_per_group: total,
        first_region,
        slot_order_seed: None,
        materialize: false,
    };
    let request = RequestId(1);
    let mut sender = ReferenceCache::new(&spec(1))?;
    let mut receiver = ReferenceCache::new(&spec(101))?;
    sender.begin_prefill(
        request,
        args.prompt_tokens,
        args.sender_prefix,
        AllocationStyle::FullPrompt,
    )?;
    let runs = receiver.register_destination(request, args.prompt_tokens, args.receiver_prefix)?;
    let layouts = sender.layouts();
    let infos = layouts
        .iter()
        .zip(&runs)
        .enumerate()
        .map(|(g, (layout, run))| {
            Ok(GroupInfo {
                group: g as u16,
                window: layout.window,
                windowed: layout.is_windowed_for(args.prompt_tokens),
                stale_boundary: StaleBoundary::for_group(args.prompt_tokens, layout)?.ordinal(),
                receiver_first_ordinal: run.first_ordinal,
            })
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    let mut planner = ChunkPlanner::new(layouts.clone(), receiver.layouts(), runs);
    let mut chunks = Vec::new();
    for &(a, b) in &args.chunks {
        sender.compute_chunk(request, a, b)?;
        let chunk = ChunkSpec {
            start: a,
            end: b,
            prompt_len: args.prompt_tokens,
            prepopulated_len: args.sender_prefix,
            is_last: b == args.prompt_tokens,
            prefix_sent_early: false,
        };
        planner.clear();
        let mut reports = Vec::new();
        for g in 0..layouts.len() {
            let planned = planner.plan_group(&mut sender, request, &chunk, GroupIndex(g as u16))?;
            let report = match planned {
                None => GroupReport {
                    group: g as u16,
                    block_begin: None,
                    block_end: None,
                    src_first_ordinal: None,
                    src_blocks: 0,
                    paired_blocks: 0,
                    bytes: 0,
                    extents: Vec::new(),
                },
                Some(p) => GroupReport {
                    group: g as u16,
                    block_begin: Some(p.window.begin),
                    block_end: Some(p.window.end),
                    src_first_ordinal: Some(p.src_first_ordinal),
                    src_blocks: p.src_blocks,
                    paired_blocks: p.stats.paired_blocks,
                    bytes: p.stats.bytes,
                    extents: planner.plan().extents()[p.extents.0..p.extents.1]
                        .iter()
                        .map(|e| ExtentReport {
                            src_region: e.src_region.0,
                            src_offset: e.src_offset,
                            dst_region: e.dst_region.0,
                            dst_offset: e.dst_offset,
                            len: e.len,
                        })
                        .collect(),
                },
            };
            reports.push(report);
        }
        chunks.push(ChunkReport {
            start: a,
            end: b,
            is_last: chunk.is_last,
            groups: reports,
        });
    }
    Ok(PlanReport {
        prompt_tokens: args.prompt_tokens,
        tokens_per_block: tpb,
        total_blocks: total,
        sender_prefix: args.sender_prefix,
        receiver_prefix: args.receiver_prefix,
        groups: infos,
        chunks,
    })
}

pub(crate) fn run(args: PlanArgs) -> Result<ExitCode, CliError> {
    let report = report(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "prompt {} tokens, {} tokens per block = {} blocks; sender prefix {}, receiver prefix {}",
        report.prompt_tokens,
        report.tokens_per_block,
        report.total_blocks,
        report.sender_prefix,
        report.receiver_prefix
    );
    for g in &report.groups {
        let kind = match (g.window, g.windowed) {
            (None, _) => "full attention".to_string(),
            (Some(w), false) => format!("window {w} tokens (covers the prompt: full attention)"),
            (Some(w), true) => format!(
                "window {w} tokens, stale boundary {}: blocks from there on are sent by the \
                 chunk that computes them, blocks below it never",
                g.stale_boundary
            ),
        };
        println!(
            "group {}: {kind}; receiver registers from block {}",
            g.group, g.receiver_first_ordinal
        );
    }
    println!();
    println!(
        "{:<12} {:>5}  {:<10} {:<10} {:>6} {:>7} {:>12}",
        "chunk", "group", "blocks", "src run", "paired", "extents", "bytes"
    );
    for c in &report.chunks {
        for g in &c.groups {
            let tokens = format!("{}..{}{}", c.start, c.end, if c.is_last { "*" } else { "" });
            let (window, src) = match (g.block_begin, g.block_end, g.src_first_ordinal) {
                (Some(b), Some(e), Some(s)) => (
                    format!("[{b}, {e})"),
                    format!("[{s}, {})", s + g.src_blocks),
                ),
                _ => ("-".to_string(), "-".to_string()),
            };
            println!(
                "{:<12} {:>5}  {:<10} {:<10} {:>6} {:>7} {:>12}",
                tokens,
                g.group,
                window,
                src,
                g.paired_blocks,
                g.extents.len(),
                g.bytes
            );
            for e in &g.extents {
                println!(
                    "{:>14}region#{} +{} -> region#{} +{}  ({} bytes)",
                    "", e.src_region, e.src_offset, e.dst_region, e.dst_offset, e.len
                );
            }
        }
    }
    println!("\n(* final chunk; '-' = the group sends nothing in this chunk)");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn args(line: &str) -> PlanArgs {
        let cli = Cli::try_parse_from(line.split_whitespace()).unwrap();
        match cli.command {
            Command::Plan(a) => a,
            other => panic!("parsed as {other:?}"),
        }
    }

    fn windows(r: &PlanReport, group: usize) -> Vec<Option<(u32, u32)>> {
        r.chunks
            .iter()
            .map(|c| {
                let g = &c.groups[group];
                g.block_begin.zip(g.block_end)
            })
            .collect()
    }

    #[test]
    fn reference_chunking() {
        let r = report(&args(
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:6,6:12,12:32 --window 10",
        ))
        .unwrap();
        assert_eq!(windows(&r, 0), [Some((0, 1)), Some((1, 3)), Some((3, 8))]);
        assert_eq!(windows(&r, 1), [None, None, Some((5, 8))]);
        // Contiguous slots on both sides: one extent per pool per chunk.
        let last = &r.chunks[2].groups[0];
        assert_eq!(last.extents.len(), 2);
        let layer_bytes = 2 * 8 * 4 * 128 * 2;
        assert_eq!(
            last.extents[0],
            ExtentReport {
                src_region: 1,
                src_offset: 3 * 2 * layer_bytes,
                dst_region: 101,
                dst_offset: 3 * 2 * layer_bytes,
                len: 5 * 2 * layer_bytes,
            }
        );
        assert_eq!(last.bytes, 5 * 4 * layer_bytes);
        assert!(serde_json::to_string(&r)
            .unwrap()
            .contains("\"block_begin\":3"));
    }

    #[test]
    fn windowed_group_streams_from_its_stale_boundary() {
        let r = report(&args(
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:6,6:22,22:26,26:32 \
             --window 10",
        ))
        .unwrap();
        assert_eq!(r.groups[1].stale_boundary, 5);
        // Below the boundary nothing; from there each chunk sends the blocks it computed.
        assert_eq!(windows(&r, 1), [None, None, Some((5, 6)), Some((6, 8))]);
        assert_eq!(
            windows(&r, 0),
            [Some((0, 1)), Some((1, 5)), Some((5, 6)), Some((6, 8))]
        );
    }

    #[test]
    fn prefixes_on_both_sides() {
        let r = report(&args(
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 6:14,14:32 \
             --sender-prefix 6 --receiver-prefix 9",
        ))
        .unwrap();
        assert_eq!(windows(&r, 0), [Some((0, 3)), Some((3, 8))]);
        // The receiver holds blocks 0 and 1: of the first chunk's 3 blocks only 1 is written.
        assert_eq!(r.chunks[0].groups[0].src_blocks, 3);
        assert_eq!(r.chunks[0].groups[0].paired_blocks, 1);
        assert_eq!(r.groups[0].receiver_first_ordinal, 2);
    }

    #[test]
    fn chunks_must_tile_the_prompt() {
        let bad = [
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:6,7:32",
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:6,6:30",
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:32 --sender-prefix 4",
        ];
        for line in bad {
            assert!(report(&args(line)).is_err(), "{line}");
        }
        // An empty chunk after the final one would be a second final chunk.
        for line in [
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:32,32:32",
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0:6,6:32,32:32,32:32",
        ] {
            let err = report(&args(line)).expect_err(line).to_string();
            assert!(
                err.contains("after chunk") && err.contains("is the final chunk"),
                "{line}: {err}"
            );
        }
        // A prompt the sender has whole is one empty final chunk, which stays allowed.
        assert!(report(&args(
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 32:32 --sender-prefix 32"
        ))
        .is_ok());
        assert!(Cli::try_parse_from(
            "kvpipe plan --prompt-tokens 32 --tokens-per-block 4 --chunks 0-6".split_whitespace()
        )
        .is_err());
    }
}
