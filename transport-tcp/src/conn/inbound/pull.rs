//! The reader's peer-copy half ([`crate::peer_copy`]): on a **receiver**'s connection, each
//! data write's source follows its header; the reader admits the write, copies the bytes from
//! the sender's exported region into the admitted destination itself, waits for the copy,
//! reports the write landed and acknowledges it on the connection's writer. On a **sender**'s
//! connection, acknowledgements arrive between frames and report the batches they complete.

use std::sync::Arc;

use bytes::Bytes;
use kvpipe_core::stream::ReadInto;
use kvpipe_core::wire::DataWrite;
use kvpipe_core::{Admission, RegionId};

use super::Inbound;
use crate::conn::acks::PullAcks;
use crate::conn::hooks::ReadEnd;
use crate::conn::outbound::{Job, JobQueue};
use crate::gpu::{self, PullCopies};
use crate::memory::Registered;
use crate::peer_copy::{decode_ack, encode_ack, PeerMappings, Source, ACK_LEN, SOURCE_LEN};
use crate::stats::bump;

/// A receiver's reader on a peer-copy connection: the source that follows each data write's
/// header, the sender's regions it pulls from, and the writer its acknowledgements go out on.
pub(super) struct Puller {
    pub(super) mappings: Arc<PeerMappings>,
    pub(super) writer: Arc<JobQueue>,
    /// The header of the write whose source is being read.
    pub(super) header: Option<DataWrite>,
    pub(super) source: [u8; SOURCE_LEN],
    pub(super) filled: usize,
    pub(super) copies: PullCopies,
}

/// A sender's reader on a peer-copy connection: acknowledgements arrive between frames.
pub(super) struct AckReader {
    pub(super) acks: Arc<PullAcks>,
    /// The connection's writer, woken when acknowledged bytes make room in its lookahead.
    pub(super) writer: Arc<JobQueue>,
    /// Whether the stream is between frames (where an acknowledgement may come).
    pub(super) between: bool,
    pub(super) head: [u8; ACK_LEN],
    pub(super) filled: usize,
}

impl Inbound {
    /// (Receiver, peer copies) `n` more bytes of a write's source were read; once it is whole,
    /// the write is admitted and pulled.
    pub(super) fn source_read(&mut self, n: usize) -> Result<(), ReadEnd> {
        let p = self.puller.as_mut().expect("pulling");
        p.filled += n;
        if p.filled < SOURCE_LEN {
            return Ok(());
        }
        let header = p.header.take().expect("a source follows a header");
        let Some(source) = Source::decode(&p.source) else {
            tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, "a pulled write's source is malformed; the connection stops");
            return Err(ReadEnd::Failed);
        };
        let admission = self.hooks.admit(self.peer, &header);
        self.admit_pulled(admission, source)
    }

    /// (Receiver, peer copies) the core's answer to a pulled write: an admitted one is copied
    /// from the sender's region into the admitted bytes, waited for, and reported landed; a
    /// discarded one is dropped without a copy; a refused one stops the reader as on the socket
    /// path (the core fails the request and closes the peer). Every write admitted or discarded
    /// is then acknowledged to the sender, which keeps its source pinned until then.
    fn admit_pulled(&mut self, admission: Admission, source: Source) -> Result<(), ReadEnd> {
        let admission = match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } => {
                if let Err(why) = self.pull(source, region, offset, len) {
                    tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, %why, "a pulled write failed; the connection stops");
                    self.hooks.write_finished(ticket, false);
                    return Err(ReadEnd::Failed);
                }
                bump(&self.stats.bytes_applied, len);
                bump(&self.stats.writes_placed, 1);
                Admission::Apply {
                    ticket,
                    region,
                    offset,
                    len: 0,
                }
            }
            Admission::Discard { len } => {
                bump(&self.stats.late_writes, 1);
                bump(&self.stats.bytes_drained, len);
                Admission::Discard { len: 0 }
            }
            refused @ Admission::Refuse(_) => {
                bump(&self.stats.writes_refused, 1);
                refused
            }
        };
        let event = self
            .reader
            .admitted(admission)
            .map_err(|e| self.stream_error(e))?;
        self.on_event(event)?;
        if let Some(p) = &self.puller {
            // A writer that stopped takes nothing more: the peer is going away, and the
            // sender fails what it did not hear of.
            p.writer
                .push(Job::Frame(Bytes::copy_from_slice(&encode_ack(1))));
        }
        Ok(())
    }

    /// Copies `len` bytes from the sender's `source` into the admitted `offset` of `region`
    /// and waits for the copy.
    fn pull(
        &mut self,
        source: Source,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let Some(dst) = self
            .regions
            .registered(region)
            .filter(|r| r.contains(offset, len))
        else {
            // Granted by the layout, but the engine registered no memory behind it.
            bump(&self.stats.unbacked_writes, 1);
            return Err(format!("{region} holds no {len} bytes at {offset}"));
        };
        let p = self.puller.as_mut().expect("pulling");
        let Some((src_ordinal, src_addr)) = p.mappings.locate(source, len) else {
            return Err(format!(
                "the source ({len} bytes at {} of the sender's {}) is not in a region it exported",
                source.offset, source.region
            ));
        };
        let Registered::Device(d) = dst else {
            // Only device memory is pulled into; a build without the GPU path has no other
            // memory, and says so.
            return Err(gpu::supported()
                .map_or_else(|e| e.to_string(), |()| format!("{region} is host memory")));
        };
        let to = (d.ordinal(), d.ptr() + offset);
        // SAFETY: the destination bytes belong to a write the receiver admitted
        // (`Admission::Apply`) and not yet reported finished: admission guarantees that no
        // other write in flight overlaps them, and the engine does not touch a request's
        // blocks before its `Quiesced`, which waits for this write's report (made after this
        // copy completed, or after it was given up and left running for good). They lie
        // inside the registered region (checked above). The source lies inside a region the
        // sender exported (checked by `locate`); the sender keeps it pinned until this write
        // is acknowledged, which happens after the copy; the mapping stays open while this
        // reader holds `mappings`.
        unsafe { p.copies.copy((src_ordinal, src_addr), to, len) }.map_err(|e| e.to_string())
    }

    /// (Sender, peer copies) `n` more bytes between frames were read: an acknowledgement
    /// reports the batches it completes; anything else is a frame's first bytes, handed to the
    /// stream reader.
    pub(super) fn ack_read(&mut self, n: usize) -> Result<(), ReadEnd> {
        let a = self.acker.as_mut().expect("acking");
        a.filled += n;
        if a.filled < ACK_LEN {
            return Ok(());
        }
        a.filled = 0;
        let head = a.head;
        if let Some(count) = decode_ack(&head) {
            let Ok(acked) = a.acks.acked(count) else {
                tracing::warn!(target: "kvpipe::tcp", peer = %self.peer, count, "acknowledgements of pieces never sent; the connection stops");
                return Err(ReadEnd::Failed);
            };
            a.writer.poke();
            bump(&self.stats.bytes_placed, acked.bytes);
            for batch in acked.batches {
                self.hooks.batch_written(batch);
            }
            return Ok(());
        }
        a.between = false;
        let ReadInto::Frame(buf) = self.reader.read_into() else {
            return Err(ReadEnd::Failed);
        };
        if buf.len() < ACK_LEN {
            return Err(ReadEnd::Failed);
        }
        buf[..ACK_LEN].copy_from_slice(&head);
        let event = self
            .reader
            .advance(ACK_LEN)
            .map_err(|e| self.stream_error(e))?;
        self.on_event(event)
    }
}
