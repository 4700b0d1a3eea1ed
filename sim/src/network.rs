//! The simulated network and transport: one connection per sender rank to the receiver, each
//! ordered (the transport contract), over the seeded network emulation
//! ([`kvpipe_netem`]) — frames delayed, lost and retransmitted (or the connection reset),
//! duplicated, damaged; write batches executed against the caches' bytes after a latency, failed
//! part-way, stalled on a silently dead connection; connections killed (both ends told, one a
//! little later) or broken silently, and reconnected.
//!
//! The receiving transport lands every write through the receiver's admission, as a real one
//! would, and the oracle checks that every admitted byte lands in blocks of its own request.

use std::collections::BTreeMap;

use bytes::Bytes;
use kvpipe_core::session::{
    Admission, DataWriteHeaders, ReceiverInput, SenderInput, TransportInput, WriteBatchId,
};
use kvpipe_core::wire::{Frame, TransferStatus};
use kvpipe_core::{GrantId, RequestId, WritePlan};
use kvpipe_netem::{Direction, FrameFate, Link, Netem};

use super::config::PlantedBug;
use super::oracle::foreign_owner;
use super::world::{frame_summary, sender_peer, Action, Simulation, RECEIVER_PEER};

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
    pub(crate) links: Vec<SimLink>,
    pub(crate) batches: BTreeMap<(usize, WriteBatchId), InFlightBatch>,
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
}

impl Simulation {
    /// Hands an encoded frame to the connection of sender rank `link`.
    pub(crate) fn send_frame(
        &mut self,
        link: usize,
        to_receiver: bool,
        frame: Frame,
        bytes: Bytes,
    ) {
        self.net.counters.frames += 1;
        // Every frame crosses the wire as the bytes the endpoint encoded: they must decode to
        // the frame it meant.
        match Frame::parse(&bytes) {
            Ok((decoded, n)) if decoded == frame && n == bytes.len() => {}
            other => {
                let line = format!(
                    "frame {} does not cross the wire: {other:?}",
                    frame_summary(&frame)
                );
                self.anomaly(line);
                return;
            }
        }
        let l = &mut self.net.links[link];
        if !l.up || l.broken {
            self.net.counters.dropped += 1;
            return;
        }
        let direction = if to_receiver {
            Direction::ToReceiver
        } else {
            Direction::ToSender
        };
        let epoch = l.epoch;
        let now = self.sched.now();
        match self.net.netem.frame(now, &mut l.emulated, direction, bytes) {
            FrameFate::Deliver {
                at, copies, bytes, ..
            } => {
                for _ in 0..copies {
                    self.sched.schedule(
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
                let losses = self.cfg.rates.loss_reset_after;
                self.note(|| format!("link S{link} lost a frame {losses} times"));
                self.sched.schedule(
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
    pub(crate) fn deliver(&mut self, link: usize, to_receiver: bool, epoch: u64, bytes: Bytes) {
        let l = &self.net.links[link];
        if !l.up || l.epoch != epoch {
            self.net.counters.dropped += 1;
            return;
        }
        let now = self.sched.now();
        let res = if to_receiver {
            self.hosts.receiver.handle_transport(
                now,
                TransportInput::FrameReceived {
                    peer: sender_peer(link),
                    bytes,
                },
            )
        } else {
            self.hosts.senders[link].handle_transport(
                now,
                TransportInput::FrameReceived {
                    peer: RECEIVER_PEER,
                    bytes,
                },
            )
        };
        self.check(res, || format!("deliver on link {link}"));
        self.drain();
    }

    /// Starts a write batch of sender rank `rank`; its outcome is reported when the emulation
    /// says it is done.
    pub(crate) fn issue_batch(
        &mut self,
        rank: usize,
        batch: WriteBatchId,
        request: RequestId,
        grant: GrantId,
        plan: WritePlan,
        headers: DataWriteHeaders,
    ) {
        let now = self.sched.now();
        self.net.counters.write_batches += 1;
        let l = &mut self.net.links[rank];
        let fate = self
            .net
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
        self.net.batches.insert(
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
        self.sched.schedule(
            at,
            Action::WriteDone {
                sender: rank,
                batch,
            },
        );
        if broken {
            // It stalls on the silently dead connection: the writer cannot complete.
            self.mark_fatal(rank, request);
        }
    }

    /// A write batch is done: its extents land (all, or part of a failed one) and the sender
    /// is told.
    pub(crate) fn write_done(&mut self, rank: usize, batch: WriteBatchId) {
        let now = self.sched.now();
        if self.net.links[rank].broken
            && self
                .net
                .batches
                .get(&(rank, batch))
                .is_some_and(|b| !b.stillborn)
        {
            // The connection died silently: the batch stalls until the connection is closed.
            return;
        }
        let Some(b) = self.net.batches.remove(&(rank, batch)) else {
            // Dropped with its connection.
            return;
        };
        let input = match b.fail {
            None => {
                self.land(rank, &b, b.plan.len());
                self.note(|| format!("S{rank} {batch} completed"));
                TransportInput::WritesCompleted { batch }
            }
            Some(status) => {
                let part = self.net.netem.landed_extents(b.plan.len());
                if !b.stillborn {
                    self.land(rank, &b, part);
                    self.net.counters.write_failures += 1;
                    self.mark_fatal(rank, b.request);
                    if let Some(i) = self.oracle.find(b.request) {
                        self.oracle.records[i].exposed = true;
                    }
                }
                self.note(|| format!("S{rank} {batch} failed: {status:?}"));
                TransportInput::WritesFailed { batch, status }
            }
        };
        let res = self.hosts.senders[rank].handle_input(SenderInput::Transport { now, input });
        self.check(res, || format!("S{rank} report {batch}"));
        self.drain();
    }

    /// Lands the first `extents` extents of `b` as the receiving transport would: each is
    /// admitted by the receiver, copied from sender `rank`'s memory to the receiver's, and
    /// reported landed. The oracle checks that every block an admitted write touched still
    /// belongs to the request.
    fn land(&mut self, rank: usize, b: &InFlightBatch, extents: usize) {
        let now = self.sched.now();
        let grant_ok = self.hosts.receiver.grant(b.request) == Some(b.grant);
        let mut stray: Vec<Option<RequestId>> = Vec::new();
        for e in &b.plan.extents()[..extents] {
            let header = b.headers.encode(e.dst_region, e.dst_offset, e.len);
            let ticket = match self
                .hosts
                .receiver
                .admit_write(now, sender_peer(rank), &header)
            {
                Admission::Apply { ticket, .. } => {
                    if let Some(i) = self.oracle.find(b.request) {
                        self.oracle.records[i].last_landing = Some(now);
                    }
                    ticket
                }
                Admission::Discard { .. } => continue,
                Admission::Refuse(reason) => {
                    self.net.counters.refused_writes += 1;
                    self.note(|| format!("S{rank} write refused: {reason}"));
                    break;
                }
            };
            if !grant_ok {
                stray.push(None);
            }
            for (cache, region, offset) in [
                (&self.hosts.sender_caches[rank], e.src_region, e.src_offset),
                (&self.hosts.receiver_cache, e.dst_region, e.dst_offset),
            ] {
                if let Some(other) = foreign_owner(cache, region, offset, e.len, b.request) {
                    stray.push(other);
                }
            }
            let src = self.hosts.sender_caches[rank]
                .region(e.src_region)
                .and_then(|m| m.get(e.src_offset as usize..(e.src_offset + e.len) as usize));
            let dst = self
                .hosts
                .receiver_cache
                .region_mut(e.dst_region)
                .and_then(|m| m.get_mut(e.dst_offset as usize..(e.dst_offset + e.len) as usize));
            match (src, dst) {
                (Some(s), Some(d)) => {
                    d.copy_from_slice(s);
                    if self.cfg.planted_bug == Some(PlantedBug::FlipByte(b.request)) {
                        d[0] ^= 0x5a;
                    }
                }
                _ => stray.push(None),
            }
            let res = self.hosts.receiver.handle_transport(
                now,
                TransportInput::WriteFinished {
                    ticket,
                    landed: true,
                },
            );
            self.check(res, || format!("S{rank} write landed"));
        }
        if !stray.is_empty() {
            self.net.counters.stray_writes += stray.len() as u64;
            let request = b.request;
            self.note(|| format!("STRAY write of {request} ({} extents)", stray.len()));
            self.oracle.anomalies.push(format!(
                "stray write of {request} at {now}: {} extents outside its blocks or grant",
                stray.len()
            ));
            for r in std::iter::once(Some(request)).chain(stray) {
                if let Some(i) = r.and_then(|r| self.oracle.find(r)) {
                    self.oracle.records[i].corrupted = true;
                }
            }
        }
    }

    /// The connection of sender rank `link` dies (`how`): writes in flight land in part, one
    /// end learns at once and the other a little later, and it comes back after a while.
    pub(crate) fn kill_link(&mut self, link: usize, injected: bool, how: &str) {
        let now = self.sched.now();
        let l = &mut self.net.links[link];
        if !l.up {
            return;
        }
        l.up = false;
        l.broken = false;
        l.epoch += 1;
        self.oracle.expose_link(&self.engine.plans, link);
        self.net.counters.link_deaths += u64::from(injected);
        self.note(|| format!("link S{link} {how}"));
        // Writes in flight either landed before the death or never will.
        let dying: Vec<(usize, WriteBatchId)> = self
            .net
            .batches
            .keys()
            .filter(|(r, _)| *r == link)
            .copied()
            .collect();
        for key in dying {
            let b = self.net.batches.remove(&key).expect("listed");
            let part = self.net.netem.landed_extents(b.plan.len());
            if !b.stillborn {
                self.land(link, &b, part);
            }
        }
        let notice = self.net.netem.death_notice();
        self.sched.schedule(
            now + notice.other_after,
            Action::NotifyDown {
                link,
                to_receiver: !notice.receiver_first,
                injected,
            },
        );
        self.sched
            .schedule(now + notice.reconnect_after, Action::Reconnect { link });
        self.notify_down(link, notice.receiver_first, injected);
    }

    /// Tells one side that the connection of sender rank `link` is gone.
    ///
    /// An injected death is fatal for every request whose session on that sender rank is still
    /// active when the sender learns of it (a session that completed before, having handed its
    /// last frames to the dying connection, is the protocol's inherent race, not a fault it
    /// could act on).
    pub(crate) fn notify_down(&mut self, link: usize, to_receiver: bool, injected: bool) {
        let now = self.sched.now();
        // Requests that started while the death was not yet noticed are touched by it too.
        self.oracle.expose_link(&self.engine.plans, link);
        if injected && !to_receiver {
            for request in self.oracle.open_on_link(&self.engine.plans, link) {
                self.mark_fatal(link, request);
            }
        }
        self.note(|| {
            format!(
                "{} learns link S{link} is down",
                if to_receiver { "R" } else { "S" }
            )
        });
        let res = if to_receiver {
            self.hosts.receiver.handle_input(ReceiverInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: sender_peer(link),
                },
            })
        } else {
            self.hosts.senders[link].handle_input(SenderInput::Transport {
                now,
                input: TransportInput::PeerDisconnected {
                    peer: RECEIVER_PEER,
                },
            })
        };
        self.check(res, || format!("link S{link} down"));
        self.drain();
    }

    /// The connection of sender rank `link` dies silently: nobody is told; frames vanish and
    /// writes stall until an endpoint's deadline closes it.
    pub(crate) fn break_link(&mut self, link: usize, injected: bool) {
        let l = &mut self.net.links[link];
        if !l.up || l.broken {
            return;
        }
        l.broken = true;
        l.epoch += 1;
        self.oracle.expose_link(&self.engine.plans, link);
        self.net.counters.link_deaths += u64::from(injected);
        self.note(|| format!("link S{link} died silently"));
        // A writer with a batch stalled on it can complete neither side.
        let stalled: Vec<RequestId> = self
            .net
            .batches
            .iter()
            .filter(|((r, _), _)| *r == link)
            .map(|(_, b)| b.request)
            .collect();
        for request in stalled {
            self.mark_fatal(link, request);
        }
    }

    /// The connection of sender rank `link` is up (again): both ends start a handshake.
    pub(crate) fn reconnect(&mut self, link: usize) {
        let now = self.sched.now();
        let l = &mut self.net.links[link];
        if l.up {
            return;
        }
        l.up = true;
        l.broken = false;
        l.epoch += 1;
        l.emulated.restart(now);
        self.note(|| format!("link S{link} connected"));
        let res = self.hosts.senders[link].handle_input(SenderInput::Transport {
            now,
            input: TransportInput::PeerConnected {
                peer: RECEIVER_PEER,
            },
        });
        self.check(res, || format!("S{link} connect"));
        let res = self.hosts.receiver.handle_input(ReceiverInput::Transport {
            now,
            input: TransportInput::PeerConnected {
                peer: sender_peer(link),
            },
        });
        self.check(res, || format!("R connect S{link}"));
        self.drain();
    }

    /// Marks `request`'s writer `rank` as hit by a fatal fault if its session is still active.
    pub(crate) fn mark_fatal(&mut self, rank: usize, request: RequestId) {
        self.oracle
            .mark_fatal(&self.engine.plans, &self.hosts.senders[rank], rank, request);
    }
}
