//! The run loop: finished write batches reported, due timers fired, due frames delivered and
//! the endpoints' outputs carried out, until nothing is left; waiting for the next thing.

use super::*;

impl MemNetwork {
    /// Does everything that can be done now without blocking: reports finished write batches,
    /// fires due timers, delivers due frames and carries out the endpoints' outputs, until
    /// nothing is left.
    pub fn pump(&mut self) -> Result<(), DriveError> {
        for _ in 0..MAX_STEPS {
            let mut progressed = false;
            while let Some(done) = self.worker.try_done() {
                self.accept_report(done);
            }
            let now = self.now();
            let mut i = 0;
            while i < self.held.len() {
                if self.held[i].0 <= now {
                    let (_, done) = self.held.swap_remove(i);
                    self.reports.push_back(done);
                } else {
                    i += 1;
                }
            }
            progressed |= self.report_writes()?;
            let now = self.now();
            for s in 0..self.senders.len() {
                if self.sender_alive[s]
                    && self.senders[s].poll_timeout().is_some_and(|at| at <= now)
                {
                    self.feed_sender(s, now, TransportInput::Timeout)?;
                    progressed = true;
                }
            }
            for r in 0..self.receivers.len() {
                if self.receiver_alive[r]
                    && self.receivers[r].poll_timeout().is_some_and(|at| at <= now)
                {
                    self.feed_receiver(r, now, TransportInput::Timeout)?;
                    progressed = true;
                }
            }
            progressed |= self.deliver(now)?;
            progressed |= self.drain_outputs(now)?;
            if !progressed {
                return Ok(());
            }
        }
        Err(DriveError::Livelock(MAX_STEPS))
    }

    /// When something is due next without outside input: a timer, a delayed frame or a stalled
    /// write report.
    pub fn next_wake(&mut self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |at: Option<Instant>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        for (s, sender) in self.senders.iter_mut().enumerate() {
            if self.sender_alive[s] {
                consider(sender.poll_timeout());
            }
        }
        for (r, receiver) in self.receivers.iter_mut().enumerate() {
            if self.receiver_alive[r] {
                consider(receiver.poll_timeout());
            }
        }
        for link in &self.links {
            consider(link.to_receiver.next_due());
            consider(link.to_sender.next_due());
        }
        for (at, _) in &self.held {
            consider(Some(*at));
        }
        next
    }

    /// Blocks until a write batch finishes, a timer, delayed frame or stalled report is due, or
    /// `max` passed — whichever comes first. Never blocks longer than `max`. While a batch
    /// touching device memory is in flight it polls for its report for up to a millisecond
    /// before it sleeps: a GPU copies a chunk in about the time a sleeping thread takes to
    /// wake.
    pub fn wait(&mut self, max: std::time::Duration) {
        let mut limit = max;
        if let Some(at) = self.next_wake() {
            limit = limit.min(self.clock.until(at));
        }
        if !self.reports.is_empty() || limit.is_zero() {
            return;
        }
        if self.in_flight > self.held.len() {
            if let Some(done) = self.worker.done_within(limit) {
                self.accept_report(done);
            }
        } else {
            std::thread::sleep(limit);
        }
    }

    /// Pumps and waits until `done(self)` holds, for at most `limit`.
    pub fn drive_until(
        &mut self,
        limit: std::time::Duration,
        done: impl FnMut(&mut Self) -> bool,
    ) -> Result<(), DriveError> {
        drive(self, limit, Self::pump, Self::wait, done)
    }

    // ----- internals -----

    /// Hands `input` to sender `s` (and its observer).
    pub(super) fn feed_sender(
        &mut self,
        s: usize,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), DriveError> {
        self.sender_obs[s].input(now, &input);
        self.senders[s]
            .handle_transport(now, input)
            .map_err(usage(Node::Sender(s)))
    }

    /// Hands `input` to receiver `r` (and its observer).
    pub(super) fn feed_receiver(
        &mut self,
        r: usize,
        now: Instant,
        input: TransportInput,
    ) -> Result<(), DriveError> {
        self.receiver_obs[r].input(now, &input);
        self.receivers[r]
            .handle_transport(now, input)
            .map_err(usage(Node::Receiver(r)))
    }

    /// Takes a report from the copy worker: queued for the sender, or held if the batch stalls.
    fn accept_report(&mut self, done: Done) {
        match self.stalls.remove(&(done.sender, done.batch)) {
            Some(d) => self.held.push((self.clock.now() + d, done)),
            None => self.reports.push_back(done),
        }
    }

    /// Reports finished write batches to their senders.
    pub(super) fn report_writes(&mut self) -> Result<bool, DriveError> {
        let mut any = false;
        while let Some(done) = self.reports.pop_front() {
            any = true;
            self.in_flight -= 1;
            let l = self.link(done.sender, done.receiver);
            self.links[l].in_flight -= 1;
            self.stats.batches += 1;
            if let Some((bytes, issued)) = self.issued.remove(&(done.sender, done.batch)) {
                keep_recent(
                    &mut self.timings,
                    MAX_BATCH_TIMINGS,
                    BatchTiming {
                        sender: done.sender,
                        receiver: done.receiver,
                        batch: done.batch,
                        bytes,
                        issued,
                        copy_started: done.started,
                        copy_finished: done.finished,
                        reported: self.clock.now(),
                    },
                );
            }
            let landed = done.status == TransferStatus::Success;
            if landed {
                self.stats.bytes_copied += done.bytes;
            } else {
                self.stats.failed_batches += 1;
            }
            let now = self.now();
            // The receiver learns the bytes landed before the sender can report them.
            self.finish_tickets(done.receiver, &done.tickets, landed)?;
            if !self.sender_alive[done.sender] {
                continue;
            }
            let input = if landed {
                TransportInput::WritesCompleted { batch: done.batch }
            } else {
                TransportInput::WritesFailed {
                    batch: done.batch,
                    status: done.status,
                }
            };
            self.feed_sender(done.sender, now, input)?;
        }
        Ok(any)
    }

    /// Delivers every frame that is due, on every link.
    fn deliver(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        let receivers = self.receivers.len();
        for l in 0..self.links.len() {
            let (s, r) = (l / receivers, l % receivers);
            while let Some(bytes) = self.links[l].to_receiver.pop_due(now) {
                any = true;
                if self.receiver_alive[r] {
                    let input = TransportInput::FrameReceived {
                        peer: sender_peer(s),
                        bytes,
                    };
                    self.feed_receiver(r, now, input)?;
                }
            }
            while let Some(bytes) = self.links[l].to_sender.pop_due(now) {
                any = true;
                if self.sender_alive[s] {
                    let input = TransportInput::FrameReceived {
                        peer: receiver_peer(r),
                        bytes,
                    };
                    self.feed_sender(s, now, input)?;
                }
            }
        }
        Ok(any)
    }

    /// Carries out every output every endpoint has queued.
    fn drain_outputs(&mut self, now: Instant) -> Result<bool, DriveError> {
        let mut any = false;
        let mut close = Vec::new();
        for s in 0..self.senders.len() {
            while self.sender_alive[s] {
                let Some(out) = self.senders[s].poll_output() else {
                    break;
                };
                any = true;
                self.sender_obs[s].output(now, &out);
                match out {
                    Output::Transmit { peer, bytes, .. } => match receiver_index(peer) {
                        Some(r) if r < self.receivers.len() => {
                            self.transmit(s, r, Direction::ToReceiver, now, bytes);
                        }
                        _ => self.stats.misaddressed += 1,
                    },
                    Output::ExecuteWrites {
                        peer,
                        batch,
                        request,
                        slice,
                        plan,
                        headers,
                        ..
                    } => {
                        #[cfg(feature = "cuda")]
                        let after = self.gate(s, request, slice);
                        #[cfg(not(feature = "cuda"))]
                        let _ = (request, slice);
                        let job = self.execute(now, s, peer, batch, &plan, &headers)?;
                        if let Some(job) = job {
                            #[cfg(feature = "cuda")]
                            let job = Job { after, ..job };
                            self.worker.submit(job);
                        }
                    }
                    Output::ClosePeer { peer, .. } => {
                        if let Some(r) = receiver_index(peer).filter(|&r| r < self.receivers.len())
                        {
                            close.push((s, r));
                        }
                    }
                    Output::Event(e) => {
                        #[cfg(feature = "cuda")]
                        if let Event::Quiesced { request } = e {
                            self.gates.remove(&(s, request));
                        }
                        let at = self.clock.now();
                        self.events.push_back((Node::Sender(s), at, e));
                    }
                    // The in-process transport offers no data path of its own.
                    Output::DataPath(_) => {}
                }
            }
        }
        for r in 0..self.receivers.len() {
            while self.receiver_alive[r] {
                let Some(out) = self.receivers[r].poll_output() else {
                    break;
                };
                any = true;
                self.receiver_obs[r].output(now, &out);
                match out {
                    Output::Transmit { peer, bytes, .. } => match sender_index(peer) {
                        Some(s) if s < self.senders.len() => {
                            self.transmit(s, r, Direction::ToSender, now, bytes);
                        }
                        _ => self.stats.misaddressed += 1,
                    },
                    // A receiver never writes; nothing to carry out.
                    Output::ExecuteWrites { .. } => {}
                    Output::ClosePeer { peer, .. } => {
                        if let Some(s) = sender_index(peer).filter(|&s| s < self.senders.len()) {
                            close.push((s, r));
                        }
                    }
                    Output::Event(e) => {
                        let at = self.clock.now();
                        self.events.push_back((Node::Receiver(r), at, e));
                    }
                    // The in-process transport offers no data path of its own.
                    Output::DataPath(_) => {}
                }
            }
        }
        if any {
            for (obs, sender) in self.sender_obs.iter_mut().zip(&self.senders) {
                obs.counters(sender);
            }
            for (obs, receiver) in self.receiver_obs.iter_mut().zip(&self.receivers) {
                obs.counters(receiver);
            }
        }
        for (s, r) in close {
            self.disconnect(s, r)?;
        }
        Ok(any)
    }

    /// Queues the encoded frame `bytes` on the link between sender `s` and receiver `r`, as
    /// the network emulation decides (dropped, delayed, duplicated, reordered, damaged).
    fn transmit(&mut self, s: usize, r: usize, direction: Direction, now: Instant, bytes: Bytes) {
        let l = self.link(s, r);
        let to_alive = match direction {
            Direction::ToReceiver => self.receiver_alive[r],
            Direction::ToSender => self.sender_alive[s],
        };
        if !self.links[l].connected || !to_alive {
            return;
        }
        self.stats.frames += 1;
        self.stats.frame_bytes += bytes.len() as u64;
        let link = &mut self.links[l];
        let fate = self.netem.frame(now, &mut link.emulated, direction, bytes);
        match direction {
            Direction::ToReceiver => link.to_receiver.push(fate),
            Direction::ToSender => link.to_sender.push(fate),
        }
    }

    /// Makes the copy worker's job for a write batch of sender `s` (or fails the batch at once
    /// if it cannot be resolved: `None`). Every extent is admitted by the receiver first, as a
    /// receiving transport would before applying it: refused ones fail the batch, discarded
    /// ones are not copied.
    fn execute(
        &mut self,
        now: Instant,
        s: usize,
        peer: PeerId,
        batch: WriteBatchId,
        plan: &kvpipe_core::WritePlan,
        headers: &DataWriteHeaders,
    ) -> Result<Option<Job>, DriveError> {
        let fail_now = |net: &mut Self, status: TransferStatus| {
            net.stats.failed_batches += 1;
            net.feed_sender(s, now, TransportInput::WritesFailed { batch, status })
                .map(|()| None)
        };
        let Some(r) = receiver_index(peer).filter(|&r| r < self.receivers.len()) else {
            return fail_now(self, TransferStatus::WriteFailed);
        };
        let l = self.link(s, r);
        if !self.links[l].connected || !self.receiver_alive[r] {
            return fail_now(self, TransferStatus::WriteFailed);
        }
        let mut writes = match ResolvedBatch::resolve(
            plan,
            &self.sender_regions[s],
            &self.receiver_regions[r],
        ) {
            Ok(w) => w,
            Err(_) => return fail_now(self, TransferStatus::WriteFailed),
        };
        // The whole batch is admitted in one call, as a receiving transport that applies it at
        // once would ask.
        let mut frames = std::mem::take(&mut self.scratch.frames);
        let mut admissions = std::mem::take(&mut self.scratch.admissions);
        frames.clear();
        admissions.clear();
        frames.extend(
            (plan.extents().iter()).map(|e| headers.frame(e.dst_region, e.dst_offset, e.len)),
        );
        self.receivers[r].admit_writes(now, sender_peer(s), &frames, &mut admissions);
        let mut tickets = Vec::with_capacity(plan.len());
        let mut keep = Vec::with_capacity(plan.len());
        let mut refused = false;
        for a in &admissions {
            match *a {
                Admission::Apply { ticket, .. } => {
                    tickets.push(ticket);
                    keep.push(true);
                }
                Admission::Discard { .. } => keep.push(false),
                Admission::Refuse(_) => {
                    refused = true;
                    break;
                }
            }
        }
        self.scratch = Scratch { frames, admissions };
        if refused {
            // The receiver failed the request and asked to close the link; the writes it
            // admitted are never applied.
            self.finish_tickets(r, &tickets, false)?;
            return fail_now(self, TransferStatus::GrantViolation);
        }
        writes.retain(&keep);
        let fate = self
            .netem
            .batch(now, &mut self.links[l].emulated, s, writes.bytes());
        if let Some(d) = fate.stall {
            self.stalls.insert((s, batch), d);
        }
        if fate.fail.is_some() {
            // A write that failed part-way: half of its bytes landed.
            writes.truncate_half();
        }
        let fail = fate.fail;
        self.in_flight += 1;
        self.links[l].in_flight += 1;
        self.issued.insert((s, batch), (writes.bytes(), now));
        Ok(Some(Job {
            batch,
            sender: s,
            receiver: r,
            writes,
            tickets,
            fail,
            #[cfg(feature = "cuda")]
            after: None,
        }))
    }

    /// Reports the admitted writes of a batch finished to receiver `r`.
    fn finish_tickets(
        &mut self,
        r: usize,
        tickets: &[WriteTicket],
        landed: bool,
    ) -> Result<(), DriveError> {
        if !self.receiver_alive[r] {
            return Ok(());
        }
        let now = self.now();
        // Straight to the receiver: its observer takes nothing from write landings.
        self.receivers[r]
            .writes_finished(now, tickets, landed)
            .map_err(usage(Node::Receiver(r)))
    }
}

/// Pumps `it` and waits until `done(it)` holds, for at most `limit`: the `drive_until` of the
/// network and of the pair.
pub(crate) fn drive<T>(
    it: &mut T,
    limit: std::time::Duration,
    pump: impl Fn(&mut T) -> Result<(), DriveError>,
    wait: impl Fn(&mut T, std::time::Duration),
    mut done: impl FnMut(&mut T) -> bool,
) -> Result<(), DriveError> {
    let start = std::time::Instant::now();
    loop {
        pump(it)?;
        if done(it) {
            return Ok(());
        }
        let elapsed = start.elapsed();
        if elapsed >= limit {
            return Err(DriveError::Stalled {
                waited_ms: elapsed.as_millis() as u64,
            });
        }
        wait(
            it,
            (limit - elapsed).min(std::time::Duration::from_millis(50)),
        );
    }
}
