//! The async driver (`tokio` feature): the same node — core endpoint, grants, held results,
//! deadlines — with each connection's reader and writer running as tasks on a tokio runtime
//! instead of threads. Payloads are still read straight into the destination region and data
//! writes still leave with one vectored write of header and source bytes.
//!
//! [`TcpSender`] and [`TcpReceiver`] dereference to the blocking handles for the engine's
//! commands (none of them waits on the network); connect and wait for events with the async
//! methods here. The node's timer and (when listening) accept loop run on one helper thread
//! each, as in the blocking driver. Dropping a node waits (bounded) for its connection tasks to
//! end: drop it where the runtime keeps running other tasks (a multi-threaded runtime, or
//! outside the runtime).

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvpipe_core::session::Counters;
use kvpipe_core::wire::{DataWrite, Frame, FrameHeader, HEADER_LEN};
use kvpipe_core::{Event, PeerId, Receiver, ReceiverConfig, Sender, SenderConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Handle;

use crate::blocking::conn::{end_of, refuse, verdict, Job, DRAIN_CHUNK, PIECES_PER_CALL};
use crate::blocking::node::{Backend, CloseError, Node, ReaderEnd, Shared};
use crate::config::TcpConfig;
use crate::endpoint::Endpoint;
use crate::grant::WriteVerdict;
use crate::memory::RegionTable;
use crate::pieces::Piece;
use crate::preamble::Preamble;
use crate::stats::bump;

/// Starts the reader and writer tasks of one connection; returns how many started.
#[allow(clippy::too_many_arguments)]
pub(crate) fn spawn_connection<E: Endpoint>(
    handle: &Handle,
    node: Arc<Shared<E>>,
    peer: PeerId,
    read_half: std::net::TcpStream,
    write_half: std::net::TcpStream,
    rx: tokio::sync::mpsc::UnboundedReceiver<Job>,
    closing: Arc<AtomicBool>,
    negotiated: Arc<AtomicU16>,
) -> u32 {
    let _entered = handle.enter();
    let Ok(shutdown_handle) = write_half.try_clone() else {
        return 0;
    };
    if read_half.set_nonblocking(true).is_err() {
        return 0;
    }
    let (Ok(r), Ok(w)) = (
        tokio::net::TcpStream::from_std(read_half),
        tokio::net::TcpStream::from_std(write_half),
    ) else {
        return 0;
    };
    handle.spawn(reader_task(node.clone(), peer, r, closing, negotiated));
    handle.spawn(writer_task(node, peer, w, shutdown_handle, rx));
    2
}

/// Fills `buf`, waking every poll interval to check `closing`. `Ok(false)`: the stream ended
/// before the first byte.
async fn read_all(
    stream: &mut tokio::net::TcpStream,
    buf: &mut [u8],
    closing: &AtomicBool,
    poll: Duration,
) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        match tokio::time::timeout(poll, stream.read(&mut buf[done..])).await {
            Err(_) => {
                if closing.load(Ordering::Acquire) {
                    return Err(io::ErrorKind::ConnectionAborted.into());
                }
            }
            Ok(Ok(0)) if done == 0 => return Ok(false),
            Ok(Ok(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(n)) => done += n,
            Ok(Err(e)) => return Err(e),
        }
    }
    Ok(true)
}

/// Fills `buf`; the stream ending first is an error.
async fn read_full(
    stream: &mut tokio::net::TcpStream,
    buf: &mut [u8],
    closing: &AtomicBool,
    poll: Duration,
) -> io::Result<()> {
    match read_all(stream, buf, closing, poll).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(io::ErrorKind::UnexpectedEof.into()),
        Err(e) => Err(e),
    }
}

async fn drain(
    stream: &mut tokio::net::TcpStream,
    mut len: u64,
    scratch: &mut [u8],
    closing: &AtomicBool,
    poll: Duration,
) -> io::Result<()> {
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        read_full(stream, &mut scratch[..n], closing, poll).await?;
        len -= n as u64;
    }
    Ok(())
}

async fn reader_task<E: Endpoint>(
    node: Arc<Shared<E>>,
    peer: PeerId,
    mut stream: tokio::net::TcpStream,
    closing: Arc<AtomicBool>,
    negotiated: Arc<AtomicU16>,
) {
    let poll = node.config.poll_interval;
    let mut buf = vec![0u8; HEADER_LEN];
    let mut scratch = Vec::new();
    let end = loop {
        buf.resize(HEADER_LEN, 0);
        match read_all(&mut stream, &mut buf, &closing, poll).await {
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
        if let Err(e) = read_full(&mut stream, &mut buf[HEADER_LEN..], &closing, poll).await {
            break end_of(&e);
        }
        let parsed = match neg {
            Some(v) => Frame::parse_negotiated(&buf, v),
            None => Frame::parse(&buf),
        };
        let Ok((frame, _)) = parsed else {
            bump(&node.stats.decode_errors, 1);
            break ReaderEnd::Failed;
        };
        match frame {
            Frame::DataWrite(w) => {
                if scratch.is_empty() {
                    scratch = vec![0u8; DRAIN_CHUNK];
                }
                if !data_write(&node, peer, &mut stream, w, &mut scratch, &closing).await {
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

async fn data_write<E: Endpoint>(
    node: &Shared<E>,
    peer: PeerId,
    stream: &mut tokio::net::TcpStream,
    w: DataWrite,
    scratch: &mut [u8],
    closing: &AtomicBool,
) -> bool {
    let poll = node.config.poll_interval;
    let Some(v) = verdict(node, peer, &w) else {
        return false;
    };
    match v {
        WriteVerdict::Apply(revoked) => {
            let region = node.regions.get(w.region).expect("checked").clone();
            let mut done = 0u64;
            let mut result = Ok(());
            while done < w.len {
                if revoked.load(Ordering::Acquire) {
                    bump(&node.stats.bytes_drained, w.len - done);
                    result = drain(stream, w.len - done, scratch, closing, poll).await;
                    break;
                }
                // SAFETY: as in the blocking reader: the grant reserved these bytes for this
                // request's writers, the engine does not touch them before the request's
                // `Quiesced` (which waits for this reader), and the range is in bounds.
                let dst = match unsafe { region.slice_mut(w.offset + done, w.len - done) } {
                    Ok(d) => d,
                    Err(_) => break,
                };
                match tokio::time::timeout(poll, stream.read(dst)).await {
                    Err(_) => {
                        if closing.load(Ordering::Acquire) {
                            result = Err(io::ErrorKind::ConnectionAborted.into());
                            break;
                        }
                    }
                    Ok(Ok(0)) => {
                        result = Err(io::ErrorKind::UnexpectedEof.into());
                        break;
                    }
                    Ok(Ok(n)) => done += n as u64,
                    Ok(Err(e)) => {
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
            if drain(stream, w.len, scratch, closing, poll).await.is_err() {
                return false;
            }
            node.finish_write(peer, w.request, w.len, false);
            true
        }
        WriteVerdict::Refuse(_) => {
            refuse(node, peer, &w);
            false
        }
    }
}

async fn write_pieces(stream: &mut tokio::net::TcpStream, pieces: &[Piece]) -> io::Result<u64> {
    let mut bytes = 0;
    for group in pieces.chunks(PIECES_PER_CALL) {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(group.len() * 2);
        for p in group {
            slices.push(IoSlice::new(&p.header));
            // SAFETY: the source blocks stay pinned until the request's `Quiesced`, which the
            // core emits only after this batch is reported or this peer's tasks have ended.
            let src = unsafe { p.src.slice(p.src_offset, p.len) }
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            slices.push(IoSlice::new(src));
            bytes += p.len;
        }
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let n = stream.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
    }
    Ok(bytes)
}

async fn writer_task<E: Endpoint>(
    node: Arc<Shared<E>>,
    peer: PeerId,
    mut stream: tokio::net::TcpStream,
    shutdown_handle: std::net::TcpStream,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Job>,
) {
    let stall = node.config.write_stall_timeout;
    let mut failed = false;
    while let Some(job) = rx.recv().await {
        let step = async {
            match job {
                Job::Frame(bytes) => stream.write_all(&bytes).await.map(|_| true),
                Job::Data { batch, pieces } => {
                    let bytes = write_pieces(&mut stream, &pieces).await?;
                    bump(&node.stats.writes_sent, pieces.len() as u64);
                    bump(&node.stats.bytes_sent, bytes);
                    drop(pieces);
                    node.part_done(batch);
                    Ok(true)
                }
                Job::Close => {
                    stream.flush().await?;
                    shutdown_handle.shutdown(std::net::Shutdown::Write)?;
                    Ok(false)
                }
            }
        };
        let outcome = match stall {
            Some(limit) => tokio::time::timeout(limit, step)
                .await
                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            None => step.await,
        };
        match outcome {
            Ok(true) => {}
            Ok(false) => break,
            Err(_) => {
                failed = true;
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

async fn connect_bundle<E: Endpoint>(
    shared: &Arc<Shared<E>>,
    addr: SocketAddr,
) -> io::Result<PeerId> {
    let count = shared.config.connections_per_peer.clamp(1, 255);
    let token = shared.new_token();
    let mut streams = Vec::with_capacity(count);
    for index in 0..count {
        let mut s = tokio::time::timeout(
            shared.config.preamble_timeout,
            tokio::net::TcpStream::connect(addr),
        )
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let pre = Preamble {
            index: index as u8,
            count: count as u8,
            token,
        };
        s.write_all(&pre.encode()).await?;
        let s = s.into_std()?;
        shared.configure(&s)?;
        streams.push((pre, s));
    }
    shared.adopt_bundle(streams)
}

async fn next_event<E: Endpoint>(node: &Node<E>, timeout: Duration) -> Option<Event> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let notified = node.shared.events_notify.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        if let Some((_, e)) = node.shared.lock().events.pop_front() {
            return Some(e);
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return node.shared.lock().events.pop_front().map(|(_, e)| e);
        }
    }
}

/// A prefill-side node whose connections run as tokio tasks (see the module doc). Engine
/// commands are the blocking handle's, through `Deref`.
pub struct TcpSender {
    inner: crate::TcpSender,
}

impl TcpSender {
    /// A node around a core sender, its connection tasks on `runtime`.
    pub fn new(
        config: SenderConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        runtime: Handle,
    ) -> Self {
        TcpSender {
            inner: crate::TcpSender::with_backend(config, tcp, regions, Backend::Tokio(runtime)),
        }
    }

    /// Connects to a receiver at `addr`; the handshake runs in the background.
    pub async fn connect(&self, addr: SocketAddr) -> io::Result<PeerId> {
        connect_bundle(&self.inner.node().shared, addr).await
    }

    /// The next event, waiting up to `timeout` without blocking the runtime.
    pub async fn next_event(&self, timeout: Duration) -> Option<Event> {
        next_event(self.inner.node(), timeout).await
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        self.inner.counters()
    }

    /// Closes every peer in order, waiting at most `within` (see *Closing* in the crate doc),
    /// on a blocking thread so the runtime keeps driving the connections.
    pub async fn close(self, within: Duration) -> Result<(), CloseError> {
        let inner = self.inner;
        tokio::task::spawn_blocking(move || inner.close(within))
            .await
            .unwrap_or(Err(CloseError::Interrupted))
    }

    /// The handle with the blocking event methods (its connections stay on the runtime).
    pub fn into_inner(self) -> crate::TcpSender {
        self.inner
    }
}

impl std::ops::Deref for TcpSender {
    type Target = crate::TcpSender;
    fn deref(&self) -> &crate::TcpSender {
        &self.inner
    }
}

/// A decode-side node whose connections run as tokio tasks (see the module doc). Engine
/// commands are the blocking handle's, through `Deref`.
pub struct TcpReceiver {
    inner: crate::TcpReceiver,
}

impl TcpReceiver {
    /// A node around a core receiver, its connection tasks on `runtime`.
    pub fn new(
        config: ReceiverConfig,
        tcp: TcpConfig,
        regions: RegionTable,
        runtime: Handle,
    ) -> Self {
        TcpReceiver {
            inner: crate::TcpReceiver::with_backend(config, tcp, regions, Backend::Tokio(runtime)),
        }
    }

    /// Connects to a sender at `addr`.
    pub async fn connect(&self, addr: SocketAddr) -> io::Result<PeerId> {
        connect_bundle(&self.inner.node().shared, addr).await
    }

    /// The next event, waiting up to `timeout` without blocking the runtime.
    pub async fn next_event(&self, timeout: Duration) -> Option<Event> {
        next_event(self.inner.node(), timeout).await
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        self.inner.counters()
    }

    /// Closes every peer in order, waiting at most `within` (see *Closing* in the crate doc),
    /// on a blocking thread so the runtime keeps driving the connections.
    pub async fn close(self, within: Duration) -> Result<(), CloseError> {
        let inner = self.inner;
        tokio::task::spawn_blocking(move || inner.close(within))
            .await
            .unwrap_or(Err(CloseError::Interrupted))
    }

    /// The handle with the blocking event methods (its connections stay on the runtime).
    pub fn into_inner(self) -> crate::TcpReceiver {
        self.inner
    }
}

impl std::ops::Deref for TcpReceiver {
    type Target = crate::TcpReceiver;
    fn deref(&self) -> &crate::TcpReceiver {
        &self.inner
    }
}

// The handles are used from async code on any worker.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TcpSender>();
    send_sync::<TcpReceiver>();
    let _ = (
        std::marker::PhantomData::<Sender>,
        std::marker::PhantomData::<Receiver>,
    );
};
