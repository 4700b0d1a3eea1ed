//! The scenarios: each builds a [`Workload`], runs it and checks what must hold.

use kvpipe_core::session::Wait;
use kvpipe_core::wire::{Role, TransferStatus, VersionRange};
use kvpipe_core::{Duration, Event, RequestId};

use super::engine::run_workload;
use super::report::{Outcome, RunReport};
use super::workload::{Interrupt, RequestPlan, TransferMode, Workload};
use super::{FaultKind, FaultPlan, Harness, SuiteError};
use crate::cache::{AllocationStyle, GroupSpec};

/// One scenario of the suite.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// Its name (also the `#[test]` name made by `conformance_tests!`).
    pub name: &'static str,
    /// What it checks, in one line.
    pub about: &'static str,
    /// Faults the transport must be able to inject (otherwise the scenario is skipped).
    pub needs: &'static [FaultKind],
    build: fn() -> Workload,
    check: fn(&RunReport) -> Result<(), String>,
}

impl Scenario {
    /// Runs the scenario over `harness`: `Ok(None)` when skipped because the transport cannot
    /// inject a fault it needs.
    pub fn run<H: Harness>(&self, harness: &H) -> Result<Option<RunReport>, SuiteError> {
        if self.needs.iter().any(|k| !harness.supports(*k)) {
            return Ok(None);
        }
        let report = run_workload(harness, &(self.build)())?;
        check_clean(&report)?;
        (self.check)(&report).map_err(SuiteError::Check)?;
        Ok(Some(report))
    }
}

/// The checks every run must pass whatever its outcome: nothing left in flight, no session
/// left after retiring, nothing written outside granted blocks, no wrong byte in a completed
/// request.
pub fn check_clean(report: &RunReport) -> Result<(), SuiteError> {
    if report.leftover_writes != 0 {
        return Err(SuiteError::Check(format!(
            "{} write batch(es) still in flight after every request quiesced",
            report.leftover_writes
        )));
    }
    if report.leftover_sessions != 0 {
        return Err(SuiteError::Check(format!(
            "{} session(s) left after retiring every request",
            report.leftover_sessions
        )));
    }
    if !report.stray_writes.is_empty() {
        return Err(SuiteError::Check(format!(
            "bytes outside the granted blocks changed: {:?}",
            report.stray_writes
        )));
    }
    for r in &report.requests {
        if r.mismatched_blocks != 0 {
            return Err(SuiteError::Check(format!(
                "{}: {} destination block(s) differ from the sender's",
                r.id, r.mismatched_blocks
            )));
        }
        if r.source_blocks_changed != 0 {
            return Err(SuiteError::Check(format!(
                "{}: {} sender block(s) changed under the transfer",
                r.id, r.source_blocks_changed
            )));
        }
        // A writer completes only on its receiver's word (`RecvComplete`): a sender that
        // completed alone reported a success its receiver never had. (The other way round is
        // the last frame's inherent race: a receiver that completed while its word was lost
        // leaves the writer failed, with the whole KV on the decode side.)
        if r.sender.is_completed() && !r.receiver.is_completed() && r.receiver.is_end() {
            return Err(SuiteError::Check(format!(
                "{}: the sender completed but the receiver ended {:?}",
                r.id, r.receiver
            )));
        }
    }
    Ok(())
}

/// Every scenario, in a fixed order.
pub fn scenarios() -> Vec<Scenario> {
    SCENARIOS.to_vec()
}

/// The scenario called `name`.
pub fn scenario(name: &str) -> Option<Scenario> {
    SCENARIOS.iter().find(|s| s.name == name).copied()
}

fn all_verified(r: &RunReport) -> Result<(), String> {
    for q in &r.requests {
        if !q.sender.is_completed() || !q.receiver.is_completed() {
            return Err(format!(
                "{} did not complete: sender {:?}, receiver {:?}",
                q.id, q.sender, q.receiver
            ));
        }
        if let Outcome::Completed { bytes, .. } = q.receiver {
            if bytes > 0 && q.bytes_verified < bytes {
                return Err(format!(
                    "{}: {} bytes written but only {} compared",
                    q.id, bytes, q.bytes_verified
                ));
            }
        }
    }
    if !r.verified() {
        return Err("the run is not verified".into());
    }
    Ok(())
}

/// The request ended on both living sides without completing, and quiesced.
fn ended_not_completed(r: &RunReport, id: RequestId) -> Result<(), String> {
    let q = r.request(id).ok_or("no such request")?;
    if q.sender.is_completed() || q.receiver.is_completed() {
        return Err(format!(
            "{id} completed although it was interrupted: sender {:?}, receiver {:?}",
            q.sender, q.receiver
        ));
    }
    Ok(())
}

/// The first request failed with `WriteFailed` on both sides, and the sender's failure names
/// both slice ids.
fn write_failed(r: &RunReport) -> Result<(), String> {
    let q = &r.requests[0];
    let want = Outcome::Failed(TransferStatus::WriteFailed);
    if q.sender != want || q.receiver != want {
        return Err(format!(
            "expected WriteFailed on both sides, got sender {:?}, receiver {:?}",
            q.sender, q.receiver
        ));
    }
    let named = r.events.iter().any(|(side, _, e)| {
        *side == Role::Sender
            && matches!(
                e,
                Event::Failed {
                    sender_slice: Some(_),
                    receiver_slice: Some(_),
                    ..
                }
            )
    });
    if !named {
        return Err("the sender's failure does not name both slice ids".into());
    }
    Ok(())
}

/// Every request verified, and every chunk that sent blocks did so in more than one slice.
fn verified_in_layer_slices(r: &RunReport) -> Result<(), String> {
    all_verified(r)?;
    let whole = r
        .timeline
        .lanes
        .iter()
        .flat_map(|l| &l.chunks)
        .filter(|c| c.sliced && c.layers.is_none())
        .count();
    if whole != 0 {
        return Err(format!(
            "{whole} chunk(s) went out whole, not in layer ranges"
        ));
    }
    let slices = r
        .timeline
        .lanes
        .iter()
        .flat_map(|l| &l.chunks)
        .filter(|c| c.sliced)
        .count() as u64;
    if slices <= r.chunks {
        return Err(format!(
            "{slices} slice(s) for {} chunk(s): the chunks did not go out range by range",
            r.chunks
        ));
    }
    Ok(())
}

fn small(prompt: u32, chunk: u32) -> Workload {
    Workload::small(vec![RequestPlan::new(1, prompt, chunk)])
}

fn medium_group(layers: u16, split: &[u16]) -> GroupSpec {
    let mut g = GroupSpec::full(layers, split);
    g.kv_heads = 2;
    g.head_dim = 8;
    g.elem_bytes = 2;
    g
}

fn fast_deadlines(w: &mut Workload) {
    w.deadlines = kvpipe_core::session::Deadlines {
        handshake: Duration::from_millis(1_000),
        registration: Duration::from_millis(300),
        write_completion: Duration::from_secs(5),
        result_wait: Duration::from_millis(600),
        result_per_token: Duration::ZERO,
        result_idle: Duration::from_millis(600),
        aux_wait: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(100),
        liveness_timeout: Duration::from_secs(10),
        quiesce: Duration::from_millis(300),
    };
}

fn interrupted(interrupt: Interrupt) -> Workload {
    let mut w = small(64, 8);
    w.groups = vec![medium_group(2, &[2])];
    w.requests[0].interrupt = Some((2, interrupt));
    w.prefill_per_chunk = std::time::Duration::from_millis(2);
    w
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "geometry_single_chunk",
        about: "a prompt prefilled in one chunk (its last block partly filled)",
        needs: &[],
        build: || small(37, 64),
        check: all_verified,
    },
    Scenario {
        name: "geometry_ragged_chunks",
        about: "chunks that are not multiples of the block size",
        needs: &[],
        build: || {
            let mut w = small(50, 7);
            w.groups = vec![medium_group(3, &[3])];
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "geometry_chunks_without_blocks",
        about: "chunks shorter than a block, several of which complete no block",
        needs: &[],
        build: || {
            let mut w = small(70, 5);
            w.tokens_per_block = 16;
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "geometry_prompt_shorter_than_block",
        about: "a prompt shorter than one block, in two chunks",
        needs: &[],
        build: || small(3, 2),
        check: all_verified,
    },
    Scenario {
        name: "geometry_fragmented_slots",
        about: "shuffled slot order, padded slots and different pool splits on the two sides",
        needs: &[],
        build: || {
            let mut w = small(61, 9);
            let mut g = medium_group(4, &[1, 3]);
            g.slot_padding = 8;
            w.groups = vec![g];
            w.receiver_pool_split = Some(vec![vec![2, 2]]);
            w.slot_order_seed = Some(17);
            w.spare_slots = 9;
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "geometry_mla",
        about: "MLA: one latent KV plane (kv_factor 1) of one head, verified byte for byte",
        needs: &[],
        build: || {
            let mut w = small(45, 8);
            let mut g = GroupSpec::full(3, &[3]);
            g.kv_factor = 1;
            g.kv_heads = 1;
            g.head_dim = 72;
            g.elem_bytes = 2;
            w.groups = vec![g];
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "geometry_empty_prompt",
        about: "a request with an empty prompt completes on both sides",
        needs: &[],
        build: || small(0, 8),
        check: all_verified,
    },
    Scenario {
        name: "sender_prefix_sent_early",
        about: "the sender's cached prefix leaves before the first chunk, in a full and a windowed group",
        needs: &[],
        build: || {
            let mut w = small(90, 16);
            w.requests[0].sender_prefix = 37;
            w.requests[0].prefix_early = true;
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(2, &[2]).windowed(24, 0),
            ];
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "sender_prefix_reuse",
        about: "the sender starts from a cached prefix: the first chunk reaches back to block 0",
        needs: &[],
        build: || {
            let mut w = small(40, 8);
            w.requests[0].sender_prefix = 13;
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "receiver_prefix_reuse",
        about: "the receiver holds a cached prefix: those blocks are not sent",
        needs: &[],
        build: || {
            let mut w = small(40, 8);
            w.requests[0].receiver_prefix = 17;
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "both_prefixes",
        about: "prefixes on both sides, of different lengths",
        needs: &[],
        build: || {
            let mut w = small(48, 6);
            w.requests[0].sender_prefix = 20;
            w.requests[0].receiver_prefix = 9;
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "windows_with_sinks",
        about: "a sliding-window group with sink tokens beside a full-attention group",
        needs: &[],
        build: || {
            let mut w = small(60, 8);
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(2, &[1, 1]).windowed(12, 4),
            ];
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "several_layer_groups",
        about: "three layer groups (one windowed), pools split differently on each side",
        needs: &[],
        build: || {
            let mut w = small(45, 10);
            w.groups = vec![
                medium_group(3, &[1, 2]),
                GroupSpec::full(2, &[2]).windowed(16, 0),
                GroupSpec::full(1, &[1]),
            ];
            w.receiver_pool_split = Some(vec![vec![3], vec![1, 1], vec![1]]);
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "concurrent_requests",
        about: "four requests of different shapes prefilled and transferred interleaved",
        needs: &[],
        build: || {
            let mut w = Workload::small(vec![
                RequestPlan::new(1, 40, 8),
                RequestPlan::new(2, 17, 5),
                RequestPlan::new(3, 64, 16),
                RequestPlan {
                    sender_prefix: 8,
                    receiver_prefix: 4,
                    ..RequestPlan::new(4, 33, 6)
                },
            ]);
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(2, &[2]).windowed(10, 2),
            ];
            w.slot_order_seed = Some(5);
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "incremental_allocation",
        about: "the sender allocates blocks chunk by chunk while windows evict",
        needs: &[],
        build: || {
            let mut w =
                Workload::small(vec![RequestPlan::new(1, 52, 8), RequestPlan::new(2, 30, 4)]);
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(1, &[1]).windowed(9, 0),
            ];
            w.allocation = AllocationStyle::Incremental;
            w.slot_order_seed = Some(99);
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "late_registration",
        about: "the receiver registers after two chunks, before the last, or after prefill: \
                queued slices are replayed in order",
        needs: &[],
        build: || {
            let mut w = small(48, 8);
            w.requests[0].register_after_chunks = 2;
            w.requests.push(RequestPlan {
                register_after_chunks: 5,
                ..RequestPlan::new(2, 48, 8)
            });
            // Registered only after the whole prefill: every slice is replayed.
            w.requests.push(RequestPlan {
                register_after_chunks: u32::MAX,
                ..RequestPlan::new(3, 30, 8)
            });
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "cancel_mid_prefill_sender",
        about: "the prefill engine cancels mid-prefill: both sides end and quiesce",
        needs: &[],
        build: || interrupted(Interrupt::Cancel(Role::Sender)),
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            let q = &r.requests[0];
            if q.sender != Outcome::Cancelled {
                return Err(format!("sender ended {:?}, expected Cancelled", q.sender));
            }
            Ok(())
        },
    },
    Scenario {
        name: "cancel_mid_prefill_receiver",
        about: "the decode engine cancels mid-prefill: both sides end and quiesce",
        needs: &[],
        build: || interrupted(Interrupt::Cancel(Role::Receiver)),
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            let q = &r.requests[0];
            if q.receiver != Outcome::Cancelled {
                return Err(format!(
                    "receiver ended {:?}, expected Cancelled",
                    q.receiver
                ));
            }
            if !q.sender.is_end() {
                return Err("the sender never learned of the cancel".into());
            }
            Ok(())
        },
    },
    Scenario {
        name: "cancel_before_registration",
        about: "the prefill engine cancels before the receiver registered: the late registration \
                is refused and both sides end",
        needs: &[],
        build: || {
            let mut w = interrupted(Interrupt::Cancel(Role::Sender));
            w.requests[0].interrupt = Some((0, Interrupt::Cancel(Role::Sender)));
            w.requests[0].register_after_chunks = 3;
            w.requests.push(RequestPlan::new(2, 24, 8));
            w
        },
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            let q = &r.requests[0];
            if !q.receiver.is_end() {
                return Err("the receiver never learned of the cancel".into());
            }
            let other = &r.requests[1];
            if !other.sender.is_completed() || !other.receiver.is_completed() {
                return Err(format!("the other request did not complete: {other:?}"));
            }
            Ok(())
        },
    },
    Scenario {
        name: "sender_death",
        about: "the prefill process dies mid-prefill: the receiver fails the request with PeerLost",
        needs: &[FaultKind::PeerDeath],
        build: || interrupted(Interrupt::Kill(Role::Sender)),
        check: |r| {
            let q = &r.requests[0];
            if q.receiver != Outcome::Failed(TransferStatus::PeerLost) {
                return Err(format!(
                    "receiver ended {:?}, expected PeerLost",
                    q.receiver
                ));
            }
            Ok(())
        },
    },
    Scenario {
        name: "receiver_death",
        about: "the decode process dies mid-prefill: the sender fails the request with PeerLost",
        needs: &[FaultKind::PeerDeath],
        build: || interrupted(Interrupt::Kill(Role::Receiver)),
        check: |r| {
            let q = &r.requests[0];
            if q.sender != Outcome::Failed(TransferStatus::PeerLost) {
                return Err(format!("sender ended {:?}, expected PeerLost", q.sender));
            }
            Ok(())
        },
    },
    Scenario {
        name: "registration_timeout",
        about: "every session frame is lost: both sides time out, fence the peer and quiesce",
        needs: &[FaultKind::Frames],
        build: || {
            let mut w = small(24, 8);
            w.faults = FaultPlan {
                drop: 1.0,
                ..FaultPlan::default()
            };
            fast_deadlines(&mut w);
            w
        },
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            let q = &r.requests[0];
            if !matches!(q.sender, Outcome::TimedOut(_))
                || !matches!(q.receiver, Outcome::TimedOut(_))
            {
                return Err(format!(
                    "expected timeouts on both sides, got sender {:?}, receiver {:?}",
                    q.sender, q.receiver
                ));
            }
            Ok(())
        },
    },
    Scenario {
        name: "write_failure",
        about: "the second write batch fails: both sides fail the request with WriteFailed",
        needs: &[FaultKind::Writes],
        build: || {
            let mut w = small(48, 8);
            w.faults = FaultPlan {
                fail_batches: vec![1],
                ..FaultPlan::default()
            };
            w.prefill_per_chunk = std::time::Duration::from_millis(1);
            w
        },
        check: write_failed,
    },
    Scenario {
        name: "write_timeout",
        about: "a write batch's completion never comes in time: the sender times out (in doubt), \
                fences the peer, and both sides quiesce only after the writes stopped",
        needs: &[FaultKind::Writes],
        build: || {
            let mut w = small(48, 8);
            w.faults = FaultPlan {
                stall_batches: vec![1],
                stall_ms: 3_000,
                ..FaultPlan::default()
            };
            fast_deadlines(&mut w);
            w.deadlines.write_completion = Duration::from_millis(200);
            w.prefill_per_chunk = std::time::Duration::from_millis(1);
            w
        },
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            let q = &r.requests[0];
            if q.sender != Outcome::TimedOut(Wait::Writes) {
                return Err(format!(
                    "sender ended {:?}, expected TimedOut(Writes)",
                    q.sender
                ));
            }
            Ok(())
        },
    },
    Scenario {
        name: "duplicated_frames",
        about: "a third of the session frames arrive twice: duplicates are ignored",
        needs: &[FaultKind::Frames],
        build: || {
            let mut w =
                Workload::small(vec![RequestPlan::new(1, 40, 8), RequestPlan::new(2, 21, 4)]);
            w.faults = FaultPlan {
                seed: 3,
                duplicate: 0.33,
                ..FaultPlan::default()
            };
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "delayed_frames",
        about: "session frames delayed by up to 3 ms (order kept): the transfer still completes",
        needs: &[FaultKind::Frames],
        build: || {
            let mut w =
                Workload::small(vec![RequestPlan::new(1, 40, 8), RequestPlan::new(2, 21, 4)]);
            w.faults = FaultPlan {
                seed: 4,
                delay: 0.5,
                max_delay_ms: 3,
                ..FaultPlan::default()
            };
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "reordered_frames",
        about:
            "session frames overtake each other: each request completes verified or fails cleanly",
        needs: &[FaultKind::Frames],
        build: || {
            let mut w =
                Workload::small(vec![RequestPlan::new(1, 40, 4), RequestPlan::new(2, 21, 4)]);
            w.faults = FaultPlan {
                seed: 5,
                reorder: 0.3,
                ..FaultPlan::default()
            };
            fast_deadlines(&mut w);
            w
        },
        check: |r| {
            for q in &r.requests {
                if q.sender.is_completed() != q.receiver.is_completed() {
                    return Err(format!(
                        "{}: one side completed, the other did not: sender {:?}, receiver {:?}",
                        q.id, q.sender, q.receiver
                    ));
                }
            }
            Ok(())
        },
    },
    Scenario {
        name: "chaos",
        about: "lost, duplicated, reordered and delayed frames and failed writes at once: every \
                request completes verified or fails cleanly on both sides",
        needs: &[FaultKind::Frames, FaultKind::Writes],
        build: || {
            let mut w = Workload::small(
                (1..=6)
                    .map(|i| RequestPlan::new(i, 20 + 7 * i as u32, 3 + i as u32))
                    .collect(),
            );
            w.groups = vec![
                GroupSpec::full(2, &[1, 1]),
                GroupSpec::full(1, &[1]).windowed(11, 3),
            ];
            w.faults = FaultPlan {
                seed: 8,
                drop: 0.03,
                duplicate: 0.1,
                reorder: 0.1,
                delay: 0.2,
                max_delay_ms: 4,
                fail_writes: 0.05,
                ..FaultPlan::default()
            };
            fast_deadlines(&mut w);
            w
        },
        check: |r| {
            for q in &r.requests {
                if !q.sender.is_end() || !q.receiver.is_end() {
                    return Err(format!("{} did not end on both sides", q.id));
                }
            }
            Ok(())
        },
    },
    Scenario {
        name: "version_mismatch",
        about: "a receiver speaking another wire version is rejected at the handshake, naming both",
        needs: &[],
        build: || {
            let mut w = small(16, 8);
            w.receiver_versions = Some(VersionRange { min: 3, max: 3 });
            fast_deadlines(&mut w);
            w
        },
        check: |r| {
            ended_not_completed(r, RequestId(1))?;
            for side in [Role::Sender, Role::Receiver] {
                let rejected = r.events.iter().any(|(s, _, e)| {
                    *s == side
                        && matches!(e, Event::PeerRejected { message, .. }
                            if message.contains('2') && message.contains('3'))
                });
                if !rejected {
                    return Err(format!(
                        "the {side:?} reported no rejection naming both versions; events: {:?}",
                        r.events
                    ));
                }
            }
            Ok(())
        },
    },
    Scenario {
        name: "monolithic_transfer",
        about: "the whole request sent as one slice after prefill (the bench baseline)",
        needs: &[],
        build: || {
            let mut w = small(50, 8);
            w.mode = TransferMode::Monolithic;
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(2, &[2]).windowed(12, 4),
            ];
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "layer_slices_full_attention",
        about: "full attention, each chunk in layer ranges of 2 as its layers are computed: \
                ranges that cross pools split differently on each side, shuffled slots, \
                ragged chunks",
        needs: &[],
        build: || {
            let mut w = small(61, 9);
            let mut g = medium_group(5, &[2, 3]);
            g.slot_padding = 8;
            w.groups = vec![g];
            w.receiver_pool_split = Some(vec![vec![1, 4]]);
            w.slot_order_seed = Some(23);
            w.spare_slots = 9;
            w.mode = TransferMode::LayerSlices(2);
            w.prefill_per_chunk = std::time::Duration::from_millis(1);
            w
        },
        check: verified_in_layer_slices,
    },
    Scenario {
        name: "layer_slices_windowed",
        about: "a sliding-window group evicting as it goes beside full-attention groups of \
                other layer counts, in layer ranges of 3; incremental allocation, two requests",
        needs: &[],
        build: || {
            let mut w =
                Workload::small(vec![RequestPlan::new(1, 70, 8), RequestPlan::new(2, 37, 6)]);
            w.groups = vec![
                medium_group(4, &[4]),
                GroupSpec::full(7, &[3, 4]).windowed(13, 0),
                GroupSpec::full(1, &[1]),
            ];
            w.receiver_pool_split = Some(vec![vec![2, 2], vec![7], vec![1]]);
            w.allocation = AllocationStyle::Incremental;
            w.mode = TransferMode::LayerSlices(3);
            // The groups' layers interleave as the engine computes them.
            let g = kvpipe_core::GroupIndex;
            w.layer_order = kvpipe_core::LayerOrder {
                groups: vec![
                    g(1), g(1), g(0), g(1), g(1), g(0), g(1), g(1), g(0), g(1), g(2), g(0),
                ],
            };
            w
        },
        check: verified_in_layer_slices,
    },
    Scenario {
        name: "layer_slices_sinks_and_prefixes",
        about: "sink tokens kept beside a window, the sender's prefix sent early, a cached \
                prefix on the receiver, and one layer per range",
        needs: &[],
        build: || {
            let mut w = small(90, 16);
            w.requests[0].sender_prefix = 37;
            w.requests[0].prefix_early = true;
            w.requests.push(RequestPlan {
                sender_prefix: 20,
                receiver_prefix: 9,
                ..RequestPlan::new(2, 48, 6)
            });
            w.groups = vec![
                GroupSpec::full(2, &[2]),
                GroupSpec::full(3, &[1, 2]).windowed(24, 4),
            ];
            w.mode = TransferMode::LayerSlices(1);
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "layer_slices_late_registration",
        about: "the receiver registers after two chunks or after prefill: the queued layer \
                slices are replayed in order, exactly once",
        needs: &[],
        build: || {
            let mut w = small(48, 8);
            w.groups = vec![medium_group(4, &[2, 2])];
            w.requests[0].register_after_chunks = 2;
            w.requests.push(RequestPlan {
                register_after_chunks: u32::MAX,
                ..RequestPlan::new(2, 30, 8)
            });
            w.mode = TransferMode::LayerSlices(2);
            w
        },
        check: all_verified,
    },
    Scenario {
        name: "layer_slices_write_failure",
        about: "a layer range's write batch fails: both sides fail the request with WriteFailed",
        needs: &[FaultKind::Writes],
        build: || {
            let mut w = small(48, 8);
            w.groups = vec![medium_group(4, &[4])];
            w.faults = FaultPlan {
                fail_batches: vec![3],
                ..FaultPlan::default()
            };
            w.mode = TransferMode::LayerSlices(1);
            w.prefill_per_chunk = std::time::Duration::from_millis(1);
            w
        },
        check: write_failed,
    },
];
