//! The simulated network and transport: one connection per sender rank to the receiver, each
//! ordered (the transport contract), over the seeded network emulation
//! ([`kvpipe_netem`]) — frames delayed, lost and retransmitted (or the connection reset),
//! duplicated, damaged; write batches executed against the caches' bytes after a latency, failed
//! part-way, stalled on a silently dead connection; connections killed (both ends told, one a
//! little later) or broken silently, and reconnected.
//!
//! The receiving transport lands every write through the receiver's admission, as a real one
//! would, and the oracle checks that every admitted byte lands in blocks of its own request.
//!
//! The [`Network`] acts on the [`Stage`] it is lent and reports to the [`Oracle`]; a method that
//! hands an endpoint an input says so ([`Called`]) and the world drains the endpoints.

use std::collections::BTreeMap;

use bytes::Bytes;
use kvpipe_core::session::{
    Admission, DataWriteHeaders, ReceiverInput, SenderInput, TransportInput, WriteBatchId,
};
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::{GrantId, RequestId, WritePlan};
use kvpipe_netem::{Direction, FrameFate, Link, Netem};

use crate::action::{sender_peer, Action, RECEIVER_PEER};
use crate::config::PlantedBug;
use crate::oracle::{foreign_owner, Oracle};
use crate::stage::{Called, Stage};
use crate::summary::frame_summary;
use crate::workload::RequestPlan;

/// Counters of what the simulated network and transport did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames handed to the network.
    pub frames: u64,
    /// Frames lost once (then retransmitted).
    pub losses: u64,
    /// Frames delivered twice.
    pub duplicates: u64,
    /// Frames held for a delay spike.
    pub delays: u64,
    /// Frames dropped because their connection was down or died.
    pub dropped: u64,
    /// Write batches executed.
    pub write_batches: u64,
    /// Write batches failed by fault injection.
    pub write_failures: u64,
    /// Connections that died (injected, or too many losses).
    pub link_deaths: u64,
    /// Connections closed at an endpoint's request.
    pub closes: u64,
    /// Writes that touched a block not owned by their request (a freed or reused block).
    pub stray_writes: u64,
    /// Writes the receiver's admission refused (never applied).
    pub refused_writes: u64,
    /// Frames whose header was damaged on the wire.
    pub corrupted: u64,
}

/// The connection between one sender rank and the receiver.
#[derive(Clone, Debug)]
pub(crate) struct SimLink {
    pub(crate) up: bool,
    /// Died silently: frames vanish and writes stall until an endpoint closes it.
    pub(crate) broken: bool,
    /// Bumped on every death and reconnection: a frame of an older epoch is not delivered.
    pub(crate) epoch: u64,
    /// Its latency and ordering.
    emulated: Link,
}

/// A write batch the simulated transport is carrying out.
#[derive(Clone, Debug)]
pub(crate) struct InFlightBatch {
    pub(crate) request: RequestId,
    grant: GrantId,
    plan: WritePlan,
    headers: DataWriteHeaders,
    fail: Option<TransferStatus>,
    /// Issued on a connection already down: none of it can land.
    stillborn: bool,
}

/// The links, the batches in flight and the network emulation that decides their fates.
#[derive(Debug)]
pub(crate) struct Network {
    pub(crate) netem: Netem,
    links: Vec<SimLink>,
    batches: BTreeMap<(usize, WriteBatchId), InFlightBatch>,
    pub(crate) counters: NetCounters,
}

impl Network {
    /// `links` connections, all down (the simulation connects them at time zero).
    pub(crate) fn new(mut netem: Netem, links: usize) -> Self {
        let links = (0..links)
            .map(|_| SimLink {
                up: false,
                broken: false,
                epoch: 0,
                emulated: netem.link(),
            })
            .collect();
        Network {
            netem,
            links,
            batches: BTreeMap::new(),
            counters: NetCounters::default(),
        }
    }

    /// The requests of the write batches still in flight.
    pub(crate) fn batch_requests(&self) -> Vec<RequestId> {
        self.batches.values().map(|b| b.request).collect()
    }

    /// Whether a write batch of `request` from sender rank `rank` is still in flight.
    pub(crate) fn has_batch(&self, rank: usize, request: RequestId) -> bool {
        self.batches
            .iter()
            .any(|((r, _), b)| *r == rank && b.request == request)
    }

    /// Counters, with the emulation's.
    pub(crate) fn counters(&self) -> NetCounters {
        let n = self.netem.counters();
        NetCounters {
            losses: n.lost,
            duplicates: n.duplicated,
            delays: n.delayed,
            corrupted: n.corrupted,
            ..self.counters
        }
    }

    /// Hands an encoded frame to the connection of sender rank `link`.
    pub(crate) fn send_frame(
        &mut self,
        stage: &mut Stage,
        link: usize,
        to_receiver: bool,
        frame: Frame,
        bytes: Bytes,
    ) {
        self.counters.frames += 1;
        // Every frame crosses the wire as the bytes the endpoint encoded: they must decode to
        // the frame it meant.
        match Frame::parse(&bytes) {
            Ok((decoded, n)) if decoded == frame && n == bytes.len() => {}
            other => {
                let line = format!(
                    "frame {} does not cross the wire: {other:?}",
                    frame_summary(&frame)
                );
                stage.anomaly(line);
                return;
            }
        }
        let l = &mut self.links[link];
        if !l.up || l.broken {
            self.counters.dropped += 1;
            return;
        }
        let direction = if to_receiver {
            Direction::ToReceiver
        } else {
            Direction::ToSender
        };
        let epoch = l.epoch;
        let now = stage.sched.now();
        match self.netem.frame(now, &mut l.emulated, direction, bytes) {
            FrameFate::Deliver {
                at, copies, bytes, ..
            } => {
                for _ in 0..copies {
                    stage.sched.schedule(
                        at,
                        Action::Deliver {
                            link,
                            to_receiver,
                            epoch,
                            bytes: bytes.clone(),
                        },
                    );
                }
            }
            // The stream gives up: the connection resets.
            FrameFate::Reset { at } => {
                let losses = stage.cfg.rates.loss_reset_after;
                stage.note(|| format!("link S{link} lost a frame {losses} times"));
                stage.sched.schedule(
                    at,
                    Action::KillLink {
                        link,
                        injected: true,
                        silent: false,
                    },
                );
            }
            FrameFate::Dropped => {}
        }
    }

    /// Delivers a frame that crossed the connection of sender rank `link` (unless the
    /// connection died since it was sent).
    pub(crate) fn deliver(
        &mut self,
        stage: &mut Stage,
        link: usize,
        to_receiver: bool,
        epoch: u64,
        bytes: Bytes,
    ) -> Called {
        let l = &self.links[link];
        if !l.up || l.epoch != epoch {
            self.counters.dropped += 1;
            return Called::Nothing;
        }
        let now = stage.sched.now();
        let res = if to_receiver {
            stage.hosts.receiver.handle_transport(
                now,
                TransportInput::FrameReceived {
                    peer: sender_peer(link),
                    bytes,
                },
            )
        } else {
            stage.hosts.senders[link].handle_transport(
                now,
                TransportInput::FrameReceived {
                    peer: RECEIVER_PEER,
                    bytes,
                },
            )
        };
        stage.check(res, || format!("deliver on link {link}"));
        Called::Endpoint
    }

    /// Starts a write batch of sender rank `rank`; its outcome is reported when the emulation
    /// says it is done.
    #[allow(clippy::too_many_arguments)] // the parts of one `ExecuteWrites` output
    pub(crate) fn issue_batch(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        plans: &[RequestPlan],
        rank: usize,
        batch: WriteBatchId,
        request: RequestId,
        grant: GrantId,
        plan: WritePlan,
        headers: DataWriteHeaders,
    ) {
        let now = stage.sched.now();
        self.counters.write_batches += 1;
        let l = &mut self.links[rank];
        let fate = self
            .netem
            .batch(now, &mut l.emulated, rank, plan.total_bytes());
        // The transport cannot start it on a connection that is down: failed at once.
        let stillborn = !l.up;
        let (at, fail) = if stillborn {
            (now, Some(TransferStatus::PeerLost))
        } else {
            (fate.done_at, fate.fail)
        };
        let broken = l.broken;
        self.batches.insert(
            (rank, batch),
            InFlightBatch {
                request,
                grant,
                plan,
                headers,
                fail,
                stillborn,
            },
        );
        stage.sched.schedule(
            at,
            Action::WriteDone {
                sender: rank,
                batch,
            },
        );
        if broken {
            // It stalls on the silently dead connection: the writer cannot complete.
            mark_fatal(stage, oracle, plans, rank, request);
        }
    }

    /// A write batch is done: its extents land (all, or part of a failed one) and the sender
    /// is told.
    pub(crate) fn write_done(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        plans: &[RequestPlan],
        rank: usize,
        batch: WriteBatchId,
    ) -> Called {
        let now = stage.sched.now();
        if self.links[rank].broken
            && self
                .batches
                .get(&(rank, batch))
                .is_some_and(|b| !b.stillborn)
        {
            // The connection died silently: the batch stalls until the connection is closed.
            return Called::Nothing;
        }
        let Some(b) = self.batches.remove(&(rank, batch)) else {
            // Dropped with its connection.
            return Called::Nothing;
        };
        let input = match b.fail {
            None => {
                self.land(stage, oracle, rank, &b, b.plan.len());
                stage.note(|| format!("S{rank} {batch} completed"));
                TransportInput::WritesCompleted { batch }
            }
            Some(status) => {
                let part = self.netem.landed_extents(b.plan.len());
                if !b.stillborn {
                    self.land(stage, oracle, rank, &b, part);
                    self.counters.write_failures += 1;
                    mark_fatal(stage, oracle, plans, rank, b.request);
                    if let Some(i) = oracle.find(b.request) {
                        oracle.records[i].exposed = true;
                    }
                }
                stage.note(|| format!("S{rank} {batch} failed: {status:?}"));
                TransportInput::WritesFailed { batch, status }
            }
        };
        let res = stage.hosts.senders[rank].handle_input(SenderInput::Transport { now, input });
        stage.check(res, || format!("S{rank} report {batch}"));
        Called::Endpoint
    }

    /// Lands the first `extents` extents of `b` as the receiving transport would: each is
    /// admitted by the receiver, copied from sender `rank`'s memory to the receiver's, and
    /// reported landed. The oracle checks that every block an admitted write touched still
    /// belongs to the request.
    fn land(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        rank: usize,
        b: &InFlightBatch,
        extents: usize,
    ) {
        let now = stage.sched.now();
        let grant_ok = stage.hosts.receiver.grant(b.request) == Some(b.grant);
        let mut stray: Vec<Option<RequestId>> = Vec::new();
        for e in &b.plan.extents()[..extents] {
            let header = b.headers.frame(e.dst_region, e.dst_offset, e.len);
            let ticket = match stage
                .hosts
                .receiver
                .admit_write(now, sender_peer(rank), &header)
            {
                Admission::Apply { ticket, .. } => {
                    if let Some(i) = oracle.find(b.request) {
                        oracle.records[i].last_landing = Some(now);
                    }
                    ticket
                }
                Admission::Discard { .. } => continue,
                Admission::Refuse(reason) => {
                    self.counters.refused_writes += 1;
                    stage.note(|| format!("S{rank} write refused: {reason}"));
                    break;
                }
            };
            if !grant_ok {
                stray.push(None);
            }
            for (cache, region, offset) in [
                (&stage.hosts.sender_caches[rank], e.src_region, e.src_offset),
                (&stage.hosts.receiver_cache, e.dst_region, e.dst_offset),
            ] {
                if let Some(other) = foreign_owner(cache, region, offset, e.len, b.request) {
                    stray.push(other);
                }
            }
            let src = stage.hosts.sender_caches[rank]
                .region(e.src_region)
                .and_then(|m| m.get(e.src_offset as usize..(e.src_offset + e.len) as usize));
            let dst = stage
                .hosts
                .receiver_cache
                .region_mut(e.dst_region)
                .and_then(|m| m.get_mut(e.dst_offset as usize..(e.dst_offset + e.len) as usize));
            match (src, dst) {
                (Some(s), Some(d)) => {
                    d.copy_from_slice(s);
                    if stage.cfg.planted_bug == Some(PlantedBug::FlipByte(b.request)) {
                        d[0] ^= 0x5a;
                    }
                }
                _ => stray.push(None),
            }
            let res = stage.hosts.receiver.handle_transport(
                now,
                TransportInput::WriteFinished {
                    ticket,
                    landed: true,
                },
            );
            stage.check(res, || format!("S{rank} write landed"));
        }
        if !stray.is_empty() {
            self.counters.stray_writes += stray.len() as u64;
            let request = b.request;
            stage.note(|| format!("STRAY write of {request} ({} extents)", stray.len()));
            stage.trace.anomalies.push(format!(
                "stray write of {request} at {now}: {} extents outside its blocks or grant",
                stray.len()
            ));
            for r in std::iter::once(Some(request)).chain(stray) {
                if let Some(i) = r.and_then(|r| oracle.find(r)) {
                    oracle.records[i].corrupted = true;
                }
            }
        }
    }

    /// The connection of sender rank `link` dies (`how`): writes in flight land in part, one
    /// end learns at once and the other a little later, and it comes back after a while.
    pub(crate) fn kill_link(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        plans: &[RequestPlan],
        link: usize,
        injected: bool,
        how: &str,
    ) -> Called {
        let now = stage.sched.now();
        let l = &mut self.links[link];
        if !l.up {
            return Called::Nothing;
        }
        l.up = false;
        l.broken = false;
        l.epoch += 1;
        oracle.expose_link(plans, link);
        self.counters.link_deaths += u64::from(injected);
        stage.note(|| format!("link S{link} {how}"));
        // Writes in flight either landed before the death or never will.
        let dying: Vec<(usize, WriteBatchId)> = self
            .batches
            .keys()
            .filter(|(r, _)| *r == link)
            .copied()
            .collect();
        for key in dying {
            let b = self.batches.remove(&key).expect("listed");
            let part = self.netem.landed_extents(b.plan.len());
            if !b.stillborn {
                self.land(stage, oracle, link, &b, part);
            }
        }
        let notice = self.netem.death_notice();
        stage.sched.schedule(
            now + notice.other_after,
            Action::NotifyDown {
                link,
                to_receiver: !notice.receiver_first,
                injected,
            },
        );
        stage
            .sched
            .schedule(now + notice.reconnect_after, Action::Reconnect { link });
        self.notify_down(stage, oracle, plans, link, notice.receiver_first, injected)
    }

    /// Tells one side that the connection of sender rank `link` is gone.
    ///
    /// An injected death is fatal for every request whose session on that sender rank is still
    /// active when the sender learns of it, unless the session had handed everything over and
    /// waited only for the receiver's `RecvComplete` (then the receiver either lost those
    /// frames too, or completed: the protocol's inherent race of the last frame, see the
    /// oracle).
    pub(crate) fn notify_down(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        plans: &[RequestPlan],
        link: usize,
        to_receiver: bool,
        injected: bool,
    ) -> Called {
        let now = stage.sched.now();
        // Requests that started while the death was not yet noticed are touched by it too.
        oracle.expose_link(plans, link);
        if injected && !to_receiver {
            for request in oracle.open_on_link(plans, link) {
                mark_fatal(stage, oracle, plans, link, request);
            }
        }
        stage.note(|| {
            format!(
                "{} learns link S{link} is down",
                if to_receiver { "R" } else { "S" }
            )
        });
        let res = if to_receiver {
            stage.hosts.receiver.handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: sender_peer(link),
                },
            })
        } else {
            stage.hosts.senders[link].handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: RECEIVER_PEER,
                },
            })
        };
        if res.is_ok() {
            let (side, peer) = if to_receiver {
                (None, sender_peer(link))
            } else {
                (Some(link), RECEIVER_PEER)
            };
            oracle.told_disconnected(side, peer);
        }
        stage.check(res, || format!("link S{link} down"));
        Called::Endpoint
    }

    /// The connection of sender rank `link` dies silently: nobody is told; frames vanish and
    /// writes stall until an endpoint's deadline closes it.
    pub(crate) fn break_link(
        &mut self,
        stage: &mut Stage,
        oracle: &mut Oracle,
        plans: &[RequestPlan],
        link: usize,
        injected: bool,
    ) {
        let l = &mut self.links[link];
        if !l.up || l.broken {
            return;
        }
        l.broken = true;
        l.epoch += 1;
        oracle.expose_link(plans, link);
        self.counters.link_deaths += u64::from(injected);
        stage.note(|| format!("link S{link} died silently"));
        // A writer with a batch stalled on it can complete neither side.
        let stalled: Vec<RequestId> = self
            .batches
            .iter()
            .filter(|((r, _), _)| *r == link)
            .map(|(_, b)| b.request)
            .collect();
        for request in stalled {
            mark_fatal(stage, oracle, plans, link, request);
        }
    }

    /// The connection of sender rank `link` is up (again): both ends start a handshake.
    pub(crate) fn reconnect(&mut self, stage: &mut Stage, link: usize) -> Called {
        let now = stage.sched.now();
        let l = &mut self.links[link];
        if l.up {
            return Called::Nothing;
        }
        l.up = true;
        l.broken = false;
        l.epoch += 1;
        l.emulated.restart(now);
        stage.note(|| format!("link S{link} connected"));
        let res = stage.hosts.senders[link].handle_input(SenderInput::Transport {
            now,
            input: TransportInput::PeerConnected {
                peer: RECEIVER_PEER,
            },
        });
        stage.check(res, || format!("S{link} connect"));
        let res = stage.hosts.receiver.handle_input(ReceiverInput::Transport {
            now,
            input: TransportInput::PeerConnected {
                peer: sender_peer(link),
            },
        });
        stage.check(res, || format!("R connect S{link}"));
        Called::Endpoint
    }
}

/// Marks `request`'s writer `rank` as hit by a fatal fault if its session is still active.
fn mark_fatal(
    stage: &Stage,
    oracle: &mut Oracle,
    plans: &[RequestPlan],
    rank: usize,
    request: RequestId,
) {
    oracle.mark_fatal(plans, &stage.hosts.senders[rank], rank, request);
}
