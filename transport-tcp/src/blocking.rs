//! The blocking backend: each connection's reader and writer on a std thread of its own. Both
//! are thin loops over the connection's sans-IO halves ([`Inbound`], [`Outbound`]); only the
//! socket calls are here.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::thread;

use kvpipe_core::PeerId;

use crate::conn::{Inbound, Next, Outbound, Stop, WriteEnd};
use crate::node::Spawn;

/// Starts connection halves on threads.
pub(crate) struct Threads;

impl Spawn for Threads {
    fn start(&self, peer: PeerId, stream: TcpStream, inbound: Inbound, outbound: Outbound) -> u32 {
        let Ok(write_half) = stream.try_clone() else {
            return 0;
        };
        let reader = thread::Builder::new()
            .name(format!("kvpipe-tcp-rd-{}", peer.0))
            .spawn(move || read_loop(inbound, stream));
        let writer = thread::Builder::new()
            .name(format!("kvpipe-tcp-wr-{}", peer.0))
            .spawn(move || write_loop(outbound, write_half));
        u32::from(reader.is_ok()) + u32::from(writer.is_ok())
    }
}

/// A read shorter than this was of frames rather than payload: the next read waits with
/// [`wait_readable`] first.
const SMALL_READ: usize = 64 << 10;

fn read_loop(mut inbound: Inbound, mut stream: TcpStream) {
    // The first reads are the handshake's frames.
    let mut last_small = true;
    let stop = loop {
        if last_small && wait_readable(&stream).is_err() {
            break Stop::Io;
        }
        match stream.read(inbound.buffer()) {
            Ok(0) => break Stop::Eof,
            Ok(n) => {
                last_small = n < SMALL_READ;
                if let Err(end) = inbound.consumed(n) {
                    break Stop::Ended(end);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break Stop::Io,
        }
    };
    inbound.finish(stop);
}

/// Waits until `stream` has bytes to read, its peer ended the stream, or it failed.
///
/// A reader that mostly waits for control frames, such as the prefill side's reader of a data
/// connection, waits here instead of in a blocking `read`: a thread parked in `recv` is woken
/// by every wake-up of the socket's wait queue, including the write-space ones that the busy
/// writer of the same socket causes, and each of those takes the socket's lock against that
/// writer. `poll` is woken only for the events it asked for.
fn wait_readable(stream: &TcpStream) -> std::io::Result<()> {
    use rustix::event::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        match poll(&mut fds, None) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn write_loop(mut outbound: Outbound, mut stream: TcpStream) {
    let end = loop {
        match outbound.next() {
            Next::Write => {
                let written = stream.write_vectored(&outbound.slices());
                match written {
                    Ok(0) => break WriteEnd::Failed,
                    Ok(n) => outbound.written(n),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    // Includes a write blocked past the stall timeout.
                    Err(_) => break WriteEnd::Failed,
                }
            }
            Next::Wait => outbound.queue().wait(),
            Next::Close => match stream.shutdown(Shutdown::Write) {
                Ok(()) => break WriteEnd::Closed,
                Err(_) => break WriteEnd::Failed,
            },
            Next::Stop => break WriteEnd::Failed,
        }
    };
    outbound.finish(end);
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::time::Duration;

    use super::wait_readable;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    /// Runs `wait_readable` on a thread; the receiver gets its result.
    fn waiting(stream: &TcpStream) -> mpsc::Receiver<std::io::Result<()>> {
        let stream = stream.try_clone().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(wait_readable(&stream)));
        rx
    }

    #[test]
    fn wait_readable_returns_for_bytes_not_for_writes_on_the_same_socket() {
        let (mut a, mut b) = pair();
        let done = waiting(&a);
        // The waiting side's own writes (and the acknowledgements they bring) do not end it.
        a.write_all(&[7; 64 << 10]).unwrap();
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err());
        b.write_all(b"frame").unwrap();
        assert!(done.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
    }

    #[test]
    fn wait_readable_returns_when_the_peer_ends_or_the_node_shuts_the_socket_down() {
        let (a, b) = pair();
        let done = waiting(&a);
        b.shutdown(Shutdown::Write).unwrap();
        assert!(done.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());

        let (a, _b) = pair();
        let done = waiting(&a);
        assert!(done.recv_timeout(Duration::from_millis(100)).is_err());
        // How a node stops a connection's reader.
        a.shutdown(Shutdown::Both).unwrap();
        assert!(done.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
    }
}
