//! Connections that have not proven who they are: accepted connections still sending their
//! preamble (held here), and peers whose bundle is assembling or whose handshake has not
//! completed (held as links). Each has its own deadline (the preamble timeout, the bundle's
//! assembly timeout, the core's handshake deadline), and together they are capped: a new
//! connection past [`TcpConfig::max_unauthenticated_per_address`] drops the oldest
//! unauthenticated connection from its address, past [`TcpConfig::max_unauthenticated`] the
//! oldest of all. Nobody can hold the accept path: preambles are read concurrently, one thread
//! each, and a flood only displaces itself.
//!
//! [`TcpConfig::max_unauthenticated_per_address`]: crate::TcpConfig::max_unauthenticated_per_address
//! [`TcpConfig::max_unauthenticated`]: crate::TcpConfig::max_unauthenticated

use std::collections::BTreeMap;
use std::net::{IpAddr, Shutdown, TcpStream};

use kvpipe_core::PeerId;

/// An accepted connection whose preamble is being read.
struct Pending {
    addr: IpAddr,
    since: std::time::Instant,
    /// A handle for shutting the socket down (its reading thread then returns at once).
    socket: TcpStream,
}

/// Something unauthenticated that can be dropped to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Victim {
    /// A connection reading its preamble (already shut down when returned).
    Pending(u64),
    /// A peer whose bundle is assembling or whose handshake has not completed.
    Link(PeerId),
}

/// One unauthenticated peer link, as [`Lobby::make_room`] weighs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Unproven {
    pub(crate) peer: PeerId,
    pub(crate) addr: IpAddr,
    /// When its first connection was accepted.
    pub(crate) since: std::time::Instant,
    /// Its connections.
    pub(crate) conns: usize,
}

/// The connections reading their preamble (see the module doc).
#[derive(Default)]
pub(crate) struct Lobby {
    next: u64,
    pending: BTreeMap<u64, Pending>,
}

impl Lobby {
    /// Holds an accepted connection while its preamble is read; returns its ticket.
    pub(crate) fn enter(
        &mut self,
        addr: IpAddr,
        since: std::time::Instant,
        socket: TcpStream,
    ) -> u64 {
        let id = self.next;
        self.next += 1;
        self.pending.insert(
            id,
            Pending {
                addr,
                since,
                socket,
            },
        );
        id
    }

    /// The connection's preamble was read (or failed): it leaves. `None` when it was dropped
    /// meanwhile; otherwise its address and acceptance time.
    pub(crate) fn leave(&mut self, id: u64) -> Option<(IpAddr, std::time::Instant)> {
        self.pending.remove(&id).map(|p| (p.addr, p.since))
    }

    /// Connections reading their preamble.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Shuts every waiting connection down (the node stops).
    pub(crate) fn clear(&mut self) {
        for p in std::mem::take(&mut self.pending).into_values() {
            let _ = p.socket.shutdown(Shutdown::Both);
        }
    }

    /// Chooses what to drop so that one more connection from `addr` stays within both caps
    /// (each at least 1): first the oldest from `addr` while that address is at its cap, then
    /// the oldest of all while the node is at its cap. Connections reading their preamble
    /// are shut down here; the caller drops the links returned. Links count with all their
    /// connections.
    pub(crate) fn make_room(
        &mut self,
        links: &[Unproven],
        addr: IpAddr,
        per_address_cap: usize,
        total_cap: usize,
    ) -> Vec<Victim> {
        let mut candidates: Vec<(std::time::Instant, IpAddr, usize, Victim)> = self
            .pending
            .iter()
            .map(|(&id, p)| (p.since, p.addr, 1, Victim::Pending(id)))
            .chain(
                links
                    .iter()
                    .map(|l| (l.since, l.addr, l.conns, Victim::Link(l.peer))),
            )
            .collect();
        candidates.sort_by_key(|c| c.0);
        let mut total: usize = candidates.iter().map(|c| c.2).sum();
        let mut here: usize = candidates.iter().filter(|c| c.1 == addr).map(|c| c.2).sum();
        let mut chosen = vec![false; candidates.len()];
        let mut victims = Vec::new();
        let mut drop_oldest = |only: Option<IpAddr>, total: &mut usize, here: &mut usize| {
            let found = candidates
                .iter()
                .enumerate()
                .find(|(i, c)| !chosen[*i] && only.is_none_or(|a| a == c.1));
            let Some((i, &(_, a, weight, victim))) = found else {
                return false;
            };
            chosen[i] = true;
            *total -= weight;
            if a == addr {
                *here -= weight;
            }
            victims.push(victim);
            true
        };
        while here >= per_address_cap.max(1) {
            if !drop_oldest(Some(addr), &mut total, &mut here) {
                break;
            }
        }
        while total >= total_cap.max(1) {
            if !drop_oldest(None, &mut total, &mut here) {
                break;
            }
        }
        for v in &victims {
            if let Victim::Pending(id) = v {
                if let Some(p) = self.pending.remove(id) {
                    let _ = p.socket.shutdown(Shutdown::Both);
                }
            }
        }
        victims
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};
    use std::time::{Duration, Instant};

    fn socket(listener: &TcpListener) -> TcpStream {
        TcpStream::connect(listener.local_addr().unwrap()).unwrap()
    }

    fn ip(last: u8) -> IpAddr {
        Ipv4Addr::new(10, 0, 0, last).into()
    }

    #[test]
    fn the_oldest_from_the_address_goes_first_then_the_oldest_of_all() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut lobby = Lobby::default();
        let a0 = lobby.enter(ip(1), at(0), socket(&listener));
        let b1 = lobby.enter(ip(2), at(1), socket(&listener));
        let a3 = lobby.enter(ip(1), at(3), socket(&listener));
        let links = [Unproven {
            peer: PeerId(4),
            addr: ip(1),
            since: at(2),
            conns: 2,
        }];
        // Address 1 holds 4 connections: with a cap of 3 per address, its oldest two go (the
        // pending one, then the link of two); the node's cap of 10 needs nothing more.
        let victims = lobby.make_room(&links, ip(1), 3, 10);
        assert_eq!(victims, [Victim::Pending(a0), Victim::Link(PeerId(4))]);
        assert_eq!(lobby.len(), 2);
        assert!(lobby.leave(a0).is_none(), "dropped");
        // Another address within its cap, the node at its cap of 2: the oldest of all goes.
        let victims = lobby.make_room(&[], ip(3), 3, 2);
        assert_eq!(victims, [Victim::Pending(b1)]);
        assert_eq!(lobby.leave(a3), Some((ip(1), at(3))));
        assert_eq!(lobby.len(), 0);
        assert!(lobby.make_room(&[], ip(1), 1, 1).is_empty());
    }

    #[test]
    fn a_dropped_connection_is_shut_down() {
        use std::io::Read;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = socket(&listener);
        let (accepted, _) = listener.accept().unwrap();
        let mut lobby = Lobby::default();
        lobby.enter(ip(1), Instant::now(), accepted);
        assert_eq!(lobby.make_room(&[], ip(1), 1, 8).len(), 1);
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            (&client).read(&mut buf).unwrap(),
            0,
            "the client sees the end"
        );
    }
}
