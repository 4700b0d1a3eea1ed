//! The two threads of one connection: a reader that decodes frames and lands data writes
//! straight in registered memory, and a writer that sends queued frames and data writes.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use kvpipe_core::session::WriteBatchId;
use kvpipe_core::wire::{DataWrite, Frame, FrameHeader, HEADER_LEN};
use kvpipe_core::PeerId;

use super::node::{ReaderEnd, Shared};
use crate::endpoint::Endpoint;
use crate::grant::{WriteRefusal, WriteVerdict};
use crate::pieces::Piece;
use crate::stats::bump;

/// Work for a connection's writer thread.
pub(crate) enum Job {
    /// An encoded control frame.
    Frame(Vec<u8>),
    /// This connection's part of a write batch.
    Data {
        /// The batch.
        batch: WriteBatchId,
        /// The data writes, in order.
        pieces: Vec<Piece>,
    },
    /// Flush what is queued before, then shut the sending side down (the reader reads on).
    Close,
}

/// Pieces per `write_vectored` call (two slices each).
pub(crate) const PIECES_PER_CALL: usize = 64;
/// Scratch buffer for draining refused or late payloads.
pub(crate) const DRAIN_CHUNK: usize = 64 << 10;

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// How a reader that stopped on `err` ended.
pub(crate) fn end_of(err: &io::Error) -> ReaderEnd {
    if err.kind() == io::ErrorKind::ConnectionAborted {
        ReaderEnd::Stopped
    } else {
        ReaderEnd::Failed
    }
}

/// Fills `buf`, waking every poll interval to check `closing`. `Ok(false)`: the stream ended
/// before the first byte.
fn read_all(stream: &mut TcpStream, buf: &mut [u8], closing: &AtomicBool) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        match stream.read(&mut buf[done..]) {
            Ok(0) if done == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) => {
                if closing.load(Ordering::Acquire) {
                    return Err(io::ErrorKind::ConnectionAborted.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Fills `buf`; the stream ending first is an error.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], closing: &AtomicBool) -> io::Result<()> {
    match read_all(stream, buf, closing) {
        Ok(true) => Ok(()),
        Ok(false) => Err(io::ErrorKind::UnexpectedEof.into()),
        Err(e) => Err(e),
    }
}

/// Reads and discards `len` bytes.
fn drain(
    stream: &mut TcpStream,
    mut len: u64,
    scratch: &mut [u8],
    closing: &AtomicBool,
) -> io::Result<()> {
    while len > 0 {
        let n = (len.min(scratch.len() as u64)) as usize;
        read_full(stream, &mut scratch[..n], closing)?;
        len -= n as u64;
    }
    Ok(())
}

pub(crate) fn reader_loop<E: Endpoint>(
    node: Arc<Shared<E>>,
    peer: PeerId,
    mut stream: TcpStream,
    closing: Arc<AtomicBool>,
    negotiated: Arc<AtomicU16>,
) {
    let mut buf = vec![0u8; HEADER_LEN];
    let mut scratch = Vec::new();
    let end = loop {
        buf.resize(HEADER_LEN, 0);
        match read_all(&mut stream, &mut buf, &closing) {
            Ok(true) => {}
            Ok(false) => break ReaderEnd::Eof,
            Err(e) => break end_of(&e),
        }
        let neg = match negotiated.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v),
        };
        let checked = FrameHeader::view(&buf)
            .ok_or(())
            .and_then(|h| h.check(neg).map(|_| h.frame_len()).map_err(|_| ()));
        let Ok(total) = checked else {
            bump(&node.stats.decode_errors, 1);
            break ReaderEnd::Failed;
        };
        buf.resize(total, 0);
        if let Err(e) = read_full(&mut stream, &mut buf[HEADER_LEN..], &closing) {
            break end_of(&e);
        }
        let parsed = match neg {
            Some(v) => Frame::parse_negotiated(&buf, v),
            None => Frame::parse(&buf),
        };
        let frame = match parsed {
            Ok((frame, _)) => frame,
            Err(_) => {
                bump(&node.stats.decode_errors, 1);
                break ReaderEnd::Failed;
            }
        };
        match frame {
            Frame::DataWrite(w) => {
                if scratch.is_empty() {
                    scratch = vec![0u8; DRAIN_CHUNK];
                }
                if !data_write(&node, peer, &mut stream, w, &mut scratch, &closing) {
                    break if closing.load(Ordering::Acquire) {
                        ReaderEnd::Stopped
                    } else {
                        ReaderEnd::Failed
                    };
                }
            }
            frame => node.deliver_frame(peer, frame),
        }
    };
    node.reader_end(peer, end);
    node.thread_exit(peer);
}

/// Handles one incoming data write; returns whether the connection goes on.
fn data_write<E: Endpoint>(
    node: &Shared<E>,
    peer: PeerId,
    stream: &mut TcpStream,
    w: DataWrite,
    scratch: &mut [u8],
    closing: &AtomicBool,
) -> bool {
    let Some(verdict) = verdict(node, peer, &w) else {
        return false;
    };
    match verdict {
        WriteVerdict::Apply(revoked) => {
            let region = node.regions.get(w.region).expect("checked").clone();
            let mut done = 0u64;
            let mut result = Ok(());
            while done < w.len {
                if revoked.load(Ordering::Acquire) {
                    bump(&node.stats.bytes_drained, w.len - done);
                    result = drain(stream, w.len - done, scratch, closing);
                    break;
                }
                // SAFETY: the grant check reserved these bytes for this request's writers and
                // the engine does not touch them before the request's `Quiesced`, which waits
                // for this reader to leave (`finish_write`). `region` is registered memory and
                // the range is in bounds (checked above).
                let dst = match unsafe { region.slice_mut(w.offset + done, w.len - done) } {
                    Ok(d) => d,
                    Err(_) => break,
                };
                match stream.read(dst) {
                    Ok(0) => {
                        result = Err(io::ErrorKind::UnexpectedEof.into());
                        break;
                    }
                    Ok(n) => done += n as u64,
                    Err(e) if is_timeout(&e) => {
                        if closing.load(Ordering::Acquire) {
                            result = Err(io::ErrorKind::ConnectionAborted.into());
                            break;
                        }
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            bump(&node.stats.writes_applied, 1);
            bump(&node.stats.bytes_applied, done.min(w.len));
            let ok = result.is_ok();
            node.finish_write(peer, w.request, if ok { w.len } else { 0 }, true);
            ok
        }
        WriteVerdict::Late => {
            bump(&node.stats.late_writes, 1);
            bump(&node.stats.bytes_drained, w.len);
            if drain(stream, w.len, scratch, closing).is_err() {
                return false;
            }
            node.finish_write(peer, w.request, w.len, false);
            true
        }
        WriteVerdict::Refuse(_reason) => {
            refuse(node, peer, &w);
            false
        }
    }
}

/// Checks an incoming write (`None`: the peer is gone or not trusted any more).
pub(crate) fn verdict<E: Endpoint>(
    node: &Shared<E>,
    peer: PeerId,
    w: &DataWrite,
) -> Option<WriteVerdict> {
    let mut st = node.lock();
    match st.peers.get(&peer) {
        None => return None,
        Some(l) if l.untrusted => return None,
        Some(_) => {}
    }
    if !st.endpoint.is_peer_ready(peer) {
        return Some(WriteVerdict::Refuse(WriteRefusal::BeforeHandshake(peer)));
    }
    Some(match st.grants.check(peer, w) {
        WriteVerdict::Apply(revoked)
            if !node
                .regions
                .get(w.region)
                .is_some_and(|r| r.contains(w.offset, w.len)) =>
        {
            // Granted by the layout but not backed by registered memory.
            if let Some(g) = st.grants.entries.get_mut(&w.request) {
                g.inside = g.inside.saturating_sub(1);
            }
            drop(revoked);
            WriteVerdict::Refuse(WriteRefusal::UnknownRegion {
                request: w.request,
                region: w.region,
            })
        }
        v => v,
    })
}

/// Refuses a write: counts it, fails its request towards the writer, and closes the peer once
/// the failure report is flushed. The payload is never read into memory.
pub(crate) fn refuse<E: Endpoint>(node: &Shared<E>, peer: PeerId, w: &DataWrite) {
    bump(&node.stats.writes_refused, 1);
    let mut st = node.lock();
    let now = node.now();
    if let Some(l) = st.peers.get_mut(&peer) {
        l.untrusted = true;
    }
    let known = st
        .grants
        .entries
        .get(&w.request)
        .is_some_and(|g| g.writers.iter().any(|a| a.peer == peer));
    if known {
        st.endpoint.write_refused(now, peer, w.request);
    }
    node.drain(&mut st, now);
    node.begin_close(&mut st, peer, true);
}

fn write_pieces(stream: &mut TcpStream, pieces: &[Piece]) -> io::Result<u64> {
    let mut bytes = 0;
    for group in pieces.chunks(PIECES_PER_CALL) {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(group.len() * 2);
        for p in group {
            slices.push(IoSlice::new(&p.header));
            // SAFETY: the source blocks stay pinned (unmodified) until the request's
            // `Quiesced`, which the core emits only after this batch is reported or the peer's
            // threads (this one included) have exited.
            let src = unsafe { p.src.slice(p.src_offset, p.len) }
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            slices.push(IoSlice::new(src));
            bytes += p.len;
        }
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let n = stream.write_vectored(rest)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
    }
    Ok(bytes)
}

pub(crate) fn writer_loop<E: Endpoint>(
    node: Arc<Shared<E>>,
    peer: PeerId,
    mut stream: TcpStream,
    rx: mpsc::Receiver<Job>,
) {
    let mut failed = false;
    for job in rx.iter() {
        match job {
            Job::Frame(bytes) => {
                if stream.write_all(&bytes).is_err() {
                    failed = true;
                    break;
                }
            }
            Job::Data { batch, pieces } => match write_pieces(&mut stream, &pieces) {
                Ok(bytes) => {
                    bump(&node.stats.writes_sent, pieces.len() as u64);
                    bump(&node.stats.bytes_sent, bytes);
                    drop(pieces);
                    node.part_done(batch);
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            },
            Job::Close => {
                if stream
                    .flush()
                    .and_then(|()| stream.shutdown(Shutdown::Write))
                    .is_err()
                {
                    failed = true;
                }
                break;
            }
        }
    }
    if failed {
        let mut st = node.lock();
        node.begin_close(&mut st, peer, false);
    }
    node.thread_exit(peer);
}
