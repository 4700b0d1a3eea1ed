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

fn read_loop(mut inbound: Inbound, mut stream: TcpStream) {
    let stop = loop {
        match stream.read(inbound.buffer()) {
            Ok(0) => break Stop::Eof,
            Ok(n) => {
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
