//! What a connection's halves report, as endpoint inputs: each report takes the lock, hands one
//! input to the endpoint and carries out its outputs.

use bytes::Bytes;
use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::DataWrite;
use kvpipe_core::{Admission, Endpoint, PeerId, TransportInput, WriteTicket};
use kvpipe_driver::{deadline_after, Arrival};

use super::link::LinkPhase;
use super::{NodePhase, Shared};
use crate::conn::{HalfEnd, NodeHooks, ReadEnd, WriteEnd};
use crate::stats::bump;

impl<E: Endpoint + Send + 'static> Shared<E> {
    /// Hands `input` to the endpoint and carries out its outputs.
    fn input(&self, input: TransportInput) {
        self.driver.deliver(Arrival::Input(input));
    }
}

impl<E: Endpoint + Send + 'static> NodeHooks for Shared<E> {
    fn frame(&self, peer: PeerId, bytes: Bytes) {
        self.input(TransportInput::FrameReceived { peer, bytes });
    }

    fn body_limit(&self, peer: PeerId) -> u32 {
        self.lock().endpoint.frame_body_limit(peer)
    }

    fn admit(&self, peer: PeerId, header: &DataWrite) -> Admission {
        let mut st = self.lock();
        let now = self.now();
        let admission = st.endpoint.admit_write(now, peer, header);
        self.drain(&mut st, now);
        admission
    }

    fn data_arriving(&self, peer: PeerId) {
        self.input(TransportInput::DataArriving { peer });
    }

    fn write_finished(&self, ticket: WriteTicket, landed: bool) {
        self.input(TransportInput::WriteFinished { ticket, landed });
    }

    fn batch_written(&self, batch: WriteBatchId) {
        self.driver.deliver(Arrival::BatchDone { batch, ok: true });
    }

    /// A peer lives and dies as a whole: a failed half aborts the link, the peer's end of
    /// stream starts an orderly close of every connection. When the last half stopped the link
    /// is removed and the core hears `PeerDisconnected`: no half of the peer touches memory any
    /// more.
    fn half_ended(&self, peer: PeerId, end: HalfEnd) {
        let mut st = self.lock();
        let now = self.now();
        let st = &mut *st;
        let Some(link) = st.io.links.get_mut(peer) else {
            return;
        };
        let closing = match end {
            HalfEnd::Read(ReadEnd::Eof | ReadEnd::Refused) => {
                let until = deadline_after(self.config.close_grace);
                let started = link.close_orderly(until);
                if started {
                    self.wake_timer_by(st, until);
                }
                started
            }
            HalfEnd::Write(WriteEnd::Closed) => false,
            HalfEnd::Read(ReadEnd::Failed) | HalfEnd::Write(WriteEnd::Failed) => link.abort(),
        };
        if closing {
            bump(&self.stats.peers_closed, 1);
        }
        let Some(link) = st.io.links.get_mut(peer) else {
            return;
        };
        link.halves = link.halves.saturating_sub(1);
        if link.halves > 0 {
            return;
        }
        debug_assert!(!matches!(link.phase, LinkPhase::Assembling { .. }));
        let orderly = link.closing_cleanly();
        st.io.links.remove(peer);
        if let NodePhase::Closing(outcomes) = &mut st.io.phase {
            outcomes.insert(peer, orderly);
        }
        st.apply(now, Arrival::PeerGone(peer));
        self.drain(st, now);
        self.peers_gone.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use kvpipe_core::session::LocalHello;
    use kvpipe_core::wire::Topology;
    use kvpipe_core::{InstanceId, PeerId, Receiver, ReceiverConfig};

    use crate::config::TcpConfig;
    use crate::conn::{Inbound, Outbound, Stop, WriteEnd};
    use crate::memory::RegionTable;
    use crate::node::lifecycle::Node;
    use crate::node::Spawn;
    use crate::preamble::Preamble;

    type Halves = Arc<Mutex<Vec<(TcpStream, Inbound, Outbound)>>>;

    /// A backend that starts nothing: it keeps the halves for the test to end by hand.
    struct Held(Halves);

    impl Spawn for Held {
        fn start(&self, _: PeerId, stream: TcpStream, i: Inbound, o: Outbound) -> u32 {
            self.0.lock().unwrap().push((stream, i, o));
            2
        }
    }

    #[test]
    fn the_core_hears_of_a_disconnect_only_when_every_half_stopped() {
        let halves = Halves::default();
        let config = ReceiverConfig::new(
            LocalHello::new(InstanceId(1), Topology::default(), vec![]),
            7,
        );
        let node = Node::new(
            Receiver::new(config).unwrap(),
            TcpConfig::default(),
            RegionTable::new(),
            Box::new(Held(halves.clone())),
        );
        let addr = node.listen("127.0.0.1:0").unwrap();
        let _clients: Vec<TcpStream> = (0..3u8)
            .map(|index| {
                let mut s = TcpStream::connect(addr).unwrap();
                let pre = Preamble {
                    index,
                    count: 3,
                    token: 42,
                    flags: 0,
                };
                s.write_all(&pre.encode()).unwrap();
                s
            })
            .collect();
        let peers = || node.shared.lock().endpoint.peer_count();
        let start = std::time::Instant::now();
        while halves.lock().unwrap().len() < 3 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "bundle not started"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(peers(), 1);
        let started: Vec<_> = halves.lock().unwrap().drain(..).collect();
        let mut left = 2 * started.len();
        for (i, (_stream, inbound, outbound)) in started.into_iter().enumerate() {
            // The first reader fails: the whole peer is aborted, yet it stays connected for the
            // core until its last half stopped.
            inbound.finish(if i == 0 { Stop::Io } else { Stop::Eof });
            left -= 1;
            assert_eq!(peers(), 1, "{left} halves still run");
            outbound.finish(WriteEnd::Failed);
            left -= 1;
            assert_eq!(peers(), usize::from(left > 0), "{left} halves still run");
        }
        assert!(node.peers().is_empty());
    }
}
