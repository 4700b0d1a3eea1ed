//! Connecting, disconnecting and killing a network's endpoints.

use super::*;

impl MemNetwork {
    /// Connects sender `s` and receiver `r` (both start their handshake).
    pub fn connect(&mut self, s: usize, r: usize) -> Result<(), DriveError> {
        if s >= self.senders.len() {
            return Err(DriveError::NoSuchNode(Node::Sender(s)));
        }
        if r >= self.receivers.len() {
            return Err(DriveError::NoSuchNode(Node::Receiver(r)));
        }
        if !self.sender_alive[s] || !self.receiver_alive[r] {
            return Ok(());
        }
        let now = self.now();
        let l = self.link(s, r);
        self.links[l].connected = true;
        self.links[l].emulated.restart(now);
        self.feed_sender(
            s,
            now,
            TransportInput::PeerConnected {
                peer: receiver_peer(r),
            },
        )?;
        self.feed_receiver(
            r,
            now,
            TransportInput::PeerConnected {
                peer: sender_peer(s),
            },
        )?;
        self.pump()
    }

    /// Connects every sender to every receiver.
    pub fn connect_all(&mut self) -> Result<(), DriveError> {
        for s in 0..self.senders.len() {
            for r in 0..self.receivers.len() {
                self.connect(s, r)?;
            }
        }
        Ok(())
    }

    /// Kills `node` as if its process died: it takes no more input, its frames vanish, and
    /// every endpoint connected to it learns the connection is lost once no write can still
    /// land.
    pub fn kill(&mut self, node: Node) -> Result<(), DriveError> {
        let links: Vec<(usize, usize)> = match node {
            Node::Sender(s) if s < self.senders.len() => {
                self.sender_alive[s] = false;
                (0..self.receivers.len()).map(|r| (s, r)).collect()
            }
            Node::Receiver(r) if r < self.receivers.len() => {
                self.receiver_alive[r] = false;
                (0..self.senders.len()).map(|s| (s, r)).collect()
            }
            _ => return Err(DriveError::NoSuchNode(node)),
        };
        for (s, r) in links {
            self.disconnect(s, r)?;
        }
        Ok(())
    }

    /// Tears the connection between sender `s` and receiver `r` down: waits (bounded) for its
    /// in-flight write batches, reports them, then reports the disconnect to both ends if alive.
    pub(super) fn disconnect(&mut self, s: usize, r: usize) -> Result<(), DriveError> {
        let l = self.link(s, r);
        if !self.links[l].connected {
            return Ok(());
        }
        self.links[l].connected = false;
        self.links[l].to_receiver.clear();
        self.links[l].to_sender.clear();
        let deadline = std::time::Instant::now() + DRAIN_LIMIT;
        let pending = |net: &Self| {
            net.links[l].in_flight
                > net
                    .reports
                    .iter()
                    .chain(net.held.iter().map(|(_, d)| d))
                    .filter(|d| d.sender == s && d.receiver == r)
                    .count()
        };
        while pending(self) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.worker.done_within(left) {
                Some(done) => self.reports.push_back(done),
                None => return Err(DriveError::WritesStuck(self.links[l].in_flight)),
            }
        }
        // Tearing the connection down ends the link's stalls: the bytes have landed.
        let (released, kept): (Vec<_>, Vec<_>) = self
            .held
            .drain(..)
            .partition(|(_, d)| d.sender == s && d.receiver == r);
        self.held = kept;
        self.reports.extend(released.into_iter().map(|(_, d)| d));
        self.stalls.retain(|(sender, _), _| *sender != s);
        self.report_writes()?;
        let now = self.now();
        if self.sender_alive[s] {
            self.feed_sender(
                s,
                now,
                TransportInput::PeerDisconnected {
                    peer: receiver_peer(r),
                },
            )?;
        }
        if self.receiver_alive[r] {
            self.feed_receiver(
                r,
                now,
                TransportInput::PeerDisconnected {
                    peer: sender_peer(s),
                },
            )?;
        }
        Ok(())
    }
}
