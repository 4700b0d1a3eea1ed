//! One preflight for every subcommand, run before anything is allocated or bound: it checks
//! each flag's range, computes the memory the run will hold (both sides, every rank), and
//! compares it with what the operating system says is available (`MemAvailable` in
//! `/proc/meminfo`). A run that does not fit is refused with a message naming what it needs,
//! what is available and the flags that lower it; a run that fits goes ahead.

use std::fs::OpenOptions;
use std::net::{TcpListener, ToSocketAddrs};
use std::path::Path;

use kvpipe_conformance::cache::{split_rank, CacheSpec, GroupSpec};
use kvpipe_conformance::suite::demo::Model;

use super::CliError;

/// Most tensor-parallel ranks (or ranks of one side) a command runs side by side: each has its
/// own endpoints, caches and threads.
pub(crate) const MAX_RANKS: u64 = 1024;
/// Longest simulated compute time of one prefill chunk, in milliseconds (one minute).
pub(crate) const MAX_PREFILL_MS: u64 = 60_000;
/// Longest wait for a peer, in seconds (one week).
pub(crate) const MAX_WAIT_S: u64 = 7 * 24 * 3600;
/// Most copy threads a bench runs.
pub(crate) const MAX_THREADS: u64 = 256;
/// Most sender ranks the simulator runs.
pub(crate) const MAX_SIM_SENDERS: u64 = 1024;

/// Memory of one rank of an in-process demo beside its caches: its threads' stacks, the
/// endpoints and the transport's queues.
const RANK_OVERHEAD: u64 = 1 << 20;
/// What the process holds before a run: code, allocator, runtime.
const BASE: u64 = 32 << 20;
/// The demo also checks, below this many KV bytes, the content and the untouched blocks (a
/// snapshot of the receiver's memory): `suite::demo`'s threshold.
const THOROUGH_BYTES: u64 = 96 << 20;
/// A simulated request's plan, oracle entry and engine state, with a wide margin (measured:
/// about 600 bytes).
const SIM_REQUEST: u64 = 4 << 10;
/// A simulated sender rank's cache, endpoint and link, with a wide margin (measured: about
/// 140 KiB at one token per block).
const SIM_SENDER: u64 = 512 << 10;

/// Bytes of memory the kernel says are available (`MemAvailable`), on Linux.
pub(crate) fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `value` of `flag` must be at least `min`.
pub(crate) fn at_least(flag: &str, value: u64, min: u64) -> Result<(), CliError> {
    if value < min {
        return Err(format!("{flag} must be at least {min} (got {value})").into());
    }
    Ok(())
}

/// The first of `rules` — `(given, applies, flag, mode)`: `flag` was given, and whether this
/// run is the `mode` it applies to — that is given where it does not apply, refused naming
/// its mode and what the run `has`.
pub(crate) fn refuse_misplaced(
    rules: &[(bool, bool, &str, &str)],
    has: &str,
) -> Result<(), CliError> {
    match rules
        .iter()
        .find(|(given, applies, _, _)| *given && !*applies)
    {
        Some((_, _, flag, mode)) => {
            Err(format!("{flag} applies to {mode}; this run has {has}").into())
        }
        None => Ok(()),
    }
}

/// [`refuse_misplaced`] for a run with `transport` and `memory` (`with`: the rest of what the
/// run has, e.g. " with --connect"): the rules of every such command — `--device` (`device`
/// given) applies to verbs, `--gpu` (`gpu` given) to device memory — then the command's own
/// `rules`.
pub(crate) fn refuse_outside_mode(
    (transport, memory, with): (&str, &str, &str),
    (device, gpu): (bool, bool),
    rules: &[(bool, bool, &str, &str)],
) -> Result<(), CliError> {
    let mut all = vec![
        (
            device,
            transport == "verbs",
            "--device",
            "--transport verbs",
        ),
        (gpu, memory == "device", "--gpu", "--memory device"),
    ];
    all.extend_from_slice(rules);
    refuse_misplaced(
        &all,
        &format!("--transport {transport} and --memory {memory}{with}"),
    )
}

/// `value` of `flag` must be at most `max`; `what` says what the bound is.
pub(crate) fn at_most(flag: &str, value: u64, max: u64, what: &str) -> Result<(), CliError> {
    if value > max {
        return Err(format!("{flag} must be at most {max} ({what}; got {value})").into());
    }
    Ok(())
}

/// A listen address that parses, resolves and can be bound now (checked before the caches are
/// allocated; the socket is closed again at once).
pub(crate) fn listen_address(flag: &str, addr: &str) -> Result<(), CliError> {
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| format!("{flag} {addr:?}: {e}"))?
        .collect();
    TcpListener::bind(&addrs[..]).map_err(|e| format!("{flag} {addr:?}: cannot listen: {e}"))?;
    Ok(())
}

/// An address that parses and resolves (checked before the caches are allocated).
pub(crate) fn connect_address(flag: &str, addr: &str) -> Result<(), CliError> {
    let mut addrs = addr
        .to_socket_addrs()
        .map_err(|e| format!("{flag} {addr:?}: {e}"))?;
    if addrs.next().is_none() {
        return Err(format!("{flag} {addr:?} resolves to no address").into());
    }
    Ok(())
}

/// A file the run will write at its end (a picture) that can be written now: its directory
/// exists and it can be created or opened for writing there. A file that did not exist is
/// removed again, so a run refused later leaves nothing behind; one that did is left as it was.
pub(crate) fn output_file(flag: &str, path: &Path) -> Result<(), CliError> {
    let refuse = |e: &dyn std::fmt::Display| -> CliError {
        format!("{flag} {}: cannot write there: {e}", path.display()).into()
    };
    if path.is_dir() {
        return Err(refuse(&"it is a directory"));
    }
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(_) => std::fs::remove_file(path).map_err(|e| refuse(&e)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => OpenOptions::new()
            .write(true)
            .open(path)
            .map(drop)
            .map_err(|e| refuse(&e)),
        Err(e) => Err(refuse(&e)),
    }
}

/// The memory a run will hold, part by part, and the flags that lower it.
#[derive(Debug)]
pub(crate) struct MemoryNeed {
    parts: Vec<(String, Option<u64>)>,
    lower: String,
}

impl MemoryNeed {
    /// An empty need (plus what the process holds anyway); `lower` names the flags that lower
    /// it, for the refusal.
    pub(crate) fn new(lower: impl Into<String>) -> Self {
        MemoryNeed {
            parts: vec![("the program".into(), Some(BASE))],
            lower: lower.into(),
        }
    }

    /// Adds a part (`None`: so large it does not fit in 64 bits).
    pub(crate) fn add(&mut self, what: impl Into<String>, bytes: Option<u64>) -> &mut Self {
        self.parts.push((what.into(), bytes));
        self
    }

    /// The whole need (`None`: past 64 bits).
    pub(crate) fn total(&self) -> Option<u64> {
        self.parts
            .iter()
            .try_fold(0u64, |sum, (_, b)| sum.checked_add((*b)?))
    }

    /// Refuses the run if it needs more memory than the system has available.
    pub(crate) fn check(&self) -> Result<(), CliError> {
        self.check_against(mem_available())
    }

    /// [`MemoryNeed::check`] against `available` (`None`: unknown, so only what no machine
    /// can hold is refused).
    pub(crate) fn check_against(&self, available: Option<u64>) -> Result<(), CliError> {
        let parts = || {
            self.parts
                .iter()
                .filter(|(_, b)| *b != Some(0))
                .map(|(what, b)| match b {
                    Some(b) => format!("{what} {}", human(*b)),
                    None => format!("{what} more than 16 EiB"),
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let limit = available.unwrap_or(isize::MAX as u64);
        match self.total() {
            Some(need) if need <= limit => Ok(()),
            Some(need) => Err(format!(
                "this run needs {} of memory ({}), but {} {}; lower {}",
                human(need),
                parts(),
                human(limit),
                if available.is_some() {
                    "is available (MemAvailable)"
                } else {
                    "is the most one process can address"
                },
                self.lower
            )
            .into()),
            None => Err(format!(
                "this run needs more memory than any machine has ({}); lower {}",
                parts(),
                self.lower
            )
            .into()),
        }
    }
}

/// `bytes` for people: GiB, MiB or KiB with two decimals.
pub(crate) fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", b / f64::from(1u32 << 30))
    } else if bytes >= 1 << 20 {
        format!("{:.2} MiB", b / f64::from(1u32 << 20))
    } else {
        format!("{:.2} KiB", b / 1024.0)
    }
}

/// The cache spec both sides of a demo build: `blocks × requests + spare` slots per group.
pub(crate) fn cache_spec(
    groups: Vec<GroupSpec>,
    tokens_per_block: u32,
    prompt_tokens: u32,
    requests: u32,
    spare: u32,
) -> Option<CacheSpec> {
    let slots = prompt_tokens
        .div_ceil(tokens_per_block.max(1))
        .checked_mul(requests)?
        .checked_add(spare)?;
    Some(CacheSpec {
        tokens_per_block: tokens_per_block.max(1),
        groups,
        slots_per_group: slots,
        first_region: 1,
        slot_order_seed: None,
        materialize: true,
    })
}

/// The flags of a demo-like workload the preflight looks at.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Workload {
    pub(crate) model: Model,
    pub(crate) window: Option<u32>,
    pub(crate) prompt_tokens: u32,
    pub(crate) chunk_tokens: u32,
    pub(crate) tokens_per_block: u32,
    pub(crate) requests: u32,
}

impl Workload {
    /// The ranges every demo-like command shares: sizes and counts positive, a window of at
    /// least a token, prefixes inside the prompt, a bounded compute time.
    pub(crate) fn check_ranges(&self, prefixes: &[(&str, u32)]) -> Result<(), CliError> {
        at_least("--prompt-tokens", self.prompt_tokens.into(), 1)?;
        at_least("--chunk-tokens", self.chunk_tokens.into(), 1)?;
        at_least("--tokens-per-block", self.tokens_per_block.into(), 1)?;
        at_least("--requests", self.requests.into(), 1)?;
        if let Some(w) = self.window {
            at_least("--window", w.into(), 1)?;
        }
        for &(flag, prefix) in prefixes {
            if prefix > self.prompt_tokens {
                return Err(format!(
                    "{flag} {prefix} is longer than the prompt ({} tokens)",
                    self.prompt_tokens
                )
                .into());
            }
        }
        Ok(())
    }

    /// The footprint of one side's cache of one rank (`None`: past 64 bits).
    pub(crate) fn cache_bytes(&self) -> Option<u64> {
        self.spec()?.footprint(self.requests, self.chunk_tokens)
    }

    fn spec(&self) -> Option<CacheSpec> {
        cache_spec(
            self.model.groups(self.window),
            self.tokens_per_block,
            self.prompt_tokens,
            self.requests,
            1,
        )
    }

    /// An in-process run of `ranks` ranks, each with both sides' caches (and, for a small run,
    /// the snapshot the thorough check takes of the receiver's memory).
    pub(crate) fn in_process(&self, ranks: u32, lower: &str) -> MemoryNeed {
        let spec = self.spec();
        let cache = spec
            .as_ref()
            .and_then(|s| s.footprint(self.requests, self.chunk_tokens));
        let snapshot = spec.as_ref().and_then(|s| {
            let pools = s.pool_bytes()?;
            let spare = s.groups.iter().try_fold(0u64, |sum, g| {
                sum.checked_add(g.block_bytes(s.tokens_per_block)?)
            })?;
            Some(if pools <= THOROUGH_BYTES.saturating_add(spare) {
                pools
            } else {
                0
            })
        });
        let per_rank = (|| {
            cache?
                .checked_mul(2)?
                .checked_add(snapshot?)?
                .checked_add(RANK_OVERHEAD)
        })();
        let mut need = MemoryNeed::new(lower);
        need.add(
            format!(
                "{ranks} rank(s) × both sides' caches of {} request(s) of {} tokens",
                self.requests, self.prompt_tokens
            ),
            per_rank.and_then(|b| b.checked_mul(u64::from(ranks))),
        );
        need
    }

    /// One side's cache in a two-process run (`kvpipe serve`, `kvpipe demo --connect`).
    pub(crate) fn one_side(&self, lower: &str) -> MemoryNeed {
        let mut need = MemoryNeed::new(lower);
        need.add(
            format!(
                "this side's cache of {} request(s) of {} tokens",
                self.requests, self.prompt_tokens
            ),
            self.cache_bytes(),
        );
        need
    }

    /// Every rank of both sides of a heterogeneous split, each its own cache of its part of
    /// the whole model (`whole`: the whole model's groups).
    pub(crate) fn split(
        &self,
        whole: &[GroupSpec],
        sender_tp: u16,
        receiver: (u16, u16),
        lower: &str,
    ) -> Result<MemoryNeed, CliError> {
        let mut total = Some(0u64);
        let ranks = (0..sender_tp).map(|r| (sender_tp, r, 1, 0)).chain(
            (0..receiver.0)
                .flat_map(|t| (0..receiver.1).map(move |p| (receiver.0, t, receiver.1, p))),
        );
        for (tp, tp_rank, pp, pp_rank) in ranks {
            let shape = split_rank(whole, tp, tp_rank, pp, pp_rank)
                .map_err(|e| format!("cannot split {} this way: {e}", self.model.name()))?;
            let bytes = cache_spec(
                shape.groups,
                self.tokens_per_block,
                self.prompt_tokens,
                self.requests,
                1,
            )
            .and_then(|s| s.footprint(self.requests, self.chunk_tokens))
            .and_then(|b| b.checked_add(RANK_OVERHEAD));
            total = (|| total?.checked_add(bytes?))();
        }
        let mut need = MemoryNeed::new(lower);
        need.add(
            format!(
                "{} rank(s)' caches of {} request(s) of {} tokens",
                u32::from(sender_tp) + u32::from(receiver.0) * u32::from(receiver.1),
                self.requests,
                self.prompt_tokens
            ),
            total,
        );
        Ok(need)
    }
}

/// The simulator's memory: every request's plan and bookkeeping, every sender rank's cache and
/// endpoint.
pub(crate) fn simulation(requests: u64, senders: u64) -> MemoryNeed {
    let mut need = MemoryNeed::new("--requests or --senders");
    need.add(
        format!("{requests} simulated request(s)"),
        requests.checked_mul(SIM_REQUEST),
    )
    .add(
        format!("{senders} simulated sender rank(s)"),
        senders.checked_mul(SIM_SENDER),
    );
    need
}

/// Block tables of `caches` caches of `slots` slots in `groups` groups (no pool memory), and
/// the block lists of one chunk of `chunk_blocks` blocks per group.
pub(crate) fn tables(caches: u64, groups: u64, slots: u64, chunk_blocks: u64) -> Option<u64> {
    let spec = CacheSpec {
        tokens_per_block: 1,
        groups: vec![GroupSpec::full(1, &[1]); usize::try_from(groups).ok()?],
        slots_per_group: u32::try_from(slots).ok()?,
        first_region: 1,
        slot_order_seed: None,
        materialize: false,
    };
    spec.footprint(0, 0)?
        .checked_mul(caches)?
        .checked_add(chunk_blocks.checked_mul(groups)?.checked_mul(16)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_need_past_what_is_available_is_refused_naming_both_and_the_flags() {
        let mut need = MemoryNeed::new("--prompt-tokens or --requests");
        need.add("caches", Some(3 << 30));
        let err = need.check_against(Some(2 << 30)).unwrap_err().to_string();
        assert!(err.contains("3.03 GiB"), "{err}");
        assert!(err.contains("2.00 GiB is available"), "{err}");
        assert!(err.contains("lower --prompt-tokens or --requests"), "{err}");
        assert!(need.check_against(Some(4 << 30)).is_ok());
        need.add("more", None);
        let err = need.check_against(Some(u64::MAX)).unwrap_err().to_string();
        assert!(err.contains("more memory than any machine has"), "{err}");
    }

    #[test]
    fn the_demo_need_matches_its_caches() {
        // llama3-8b: 128 KiB per token; 4096 tokens × 2 requests = 1 GiB of KV per side, plus
        // a spare block and the tables.
        let w = Workload {
            model: Model::Llama3_8b,
            window: None,
            prompt_tokens: 4096,
            chunk_tokens: 512,
            tokens_per_block: 32,
            requests: 2,
        };
        let side = w.cache_bytes().unwrap();
        assert!(side >= (1 << 30) + (4 << 20), "{side}");
        assert!(side < (1 << 30) + (5 << 20), "{side}");
        let need = w.in_process(1, "").total().unwrap();
        assert!(need >= 2 * side && need < 2 * side + (64 << 20), "{need}");
        // Absurd sizes overflow instead of wrapping.
        let huge = Workload {
            prompt_tokens: u32::MAX,
            requests: u32::MAX,
            ..w
        };
        assert_eq!(huge.cache_bytes(), None);
    }
}
