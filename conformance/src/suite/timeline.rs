//! What a run's timeline picture is drawn from: when each prefill chunk was computed, when the
//! write batch it produced was in flight, when each request's last chunk finished computing and
//! when the decode side completed it.
//!
//! The core has no clock, so the engine records these moments itself, on the link's clock, as
//! it drives the chunks (`TimelineRecorder`); the transport records its write batches
//! ([`BatchTiming`]). A batch names no request, so the recorder pairs them afterwards: a sender
//! with one receiver registered before prefill hands out exactly one write batch per slice, in
//! the order the slices were submitted, so the n-th batch issued belongs to the n-th chunk that
//! made a slice. A chunk submitted in layer ranges is recorded as one entry per range (each
//! range is a slice of its own, with its own compute span and batch). When the counts differ or a batch would precede its chunk (late registration,
//! faults), nothing is paired and [`Timeline::unpaired_batches`] says how many were left out.

use kvpipe_core::{Duration, Instant, RequestId};

use super::BatchTiming;

/// One prefill chunk of one request, on its run's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkTiming {
    /// The chunk's index within its request (0-based).
    pub index: u32,
    /// Its token range `[start, end)`.
    pub tokens: (u32, u32),
    /// The layer range `[begin, end)` this entry covers when the chunk was submitted in layer
    /// ranges (one entry per range, each with its own compute and write batch); `None`: the
    /// whole chunk.
    pub layers: Option<(u32, u32)>,
    /// When its compute began.
    pub compute_started: Instant,
    /// When its compute finished (its KV was in the cache).
    pub computed: Instant,
    /// When it was handed to the sender (`None`: not submitted, as a monolithic transfer's
    /// earlier chunks are not).
    pub submitted: Option<Instant>,
    /// Whether submitting it made a slice that writes (a chunk that completes no block makes
    /// none; a layer range of only groups the chunk sends no block of makes a slice without
    /// writes, counted as none here).
    pub sliced: bool,
    /// Its write batch, when paired (see the module doc).
    pub batch: Option<BatchSpan>,
}

/// One write batch while it was in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSpan {
    /// Bytes in the batch.
    pub bytes: u64,
    /// When the sender asked for it.
    pub issued: Instant,
    /// When its outcome reached the sender.
    pub reported: Instant,
    /// How long the bytes took to move (the transport's own measure).
    pub transfer: Duration,
    /// When the transport saw the bytes moved.
    pub copied: Instant,
}

/// One request's chunks and milestones: one lane of the picture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// The tensor-parallel rank the request ran on (0 with one rank).
    pub rank: u32,
    /// The request.
    pub request: RequestId,
    /// When its rank's run began (every time of the lane is measured from here).
    pub origin: Instant,
    /// Its chunks, in compute order.
    pub chunks: Vec<ChunkTiming>,
    /// When its last chunk's compute finished.
    pub last_computed: Option<Instant>,
    /// When the decode side completed it.
    pub completed: Option<Instant>,
}

impl Lane {
    /// The exposed tail: last chunk computed → decode side complete.
    pub fn exposed_tail(&self) -> Option<Duration> {
        Some(self.completed? - self.last_computed?)
    }

    /// Milliseconds from the lane's origin to `at`.
    pub fn ms(&self, at: Instant) -> f64 {
        (at - self.origin).as_nanos() as f64 / 1e6
    }
}

/// A run's lanes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// One lane per request (per rank), in plan order, rank by rank.
    pub lanes: Vec<Lane>,
    /// Write batches that could not be paired with a chunk (see the module doc).
    pub unpaired_batches: usize,
}

impl Timeline {
    /// Appends another rank's lanes, numbering them as rank `rank`.
    pub fn extend_with_rank(&mut self, rank: u32, other: Timeline) {
        self.unpaired_batches += other.unpaired_batches;
        self.lanes
            .extend(other.lanes.into_iter().map(|l| Lane { rank, ..l }));
    }
}

/// Records the chunks of a run as the engine drives them.
#[derive(Debug, Default)]
pub(crate) struct TimelineRecorder {
    /// (request index, chunk), in the order the chunks were computed.
    chunks: Vec<(usize, ChunkTiming)>,
}

impl TimelineRecorder {
    /// Records chunk `chunk` of the request at `request` (its index in the plan).
    pub(crate) fn chunk(&mut self, request: usize, chunk: ChunkTiming) {
        self.chunks.push((request, chunk));
    }

    /// The timeline: `requests` (id, last chunk computed, completed) in plan order, the
    /// transport's `batches` paired with the chunks that made them.
    pub(crate) fn finish(
        mut self,
        origin: Instant,
        requests: impl IntoIterator<Item = (RequestId, Option<Instant>, Option<Instant>)>,
        batches: &[BatchTiming],
    ) -> Timeline {
        let mut batches = batches.to_vec();
        batches.sort_by_key(|b| b.issued);
        let mut sliced: Vec<&mut ChunkTiming> = self
            .chunks
            .iter_mut()
            .map(|(_, c)| c)
            .filter(|c| c.sliced)
            .collect();
        sliced.sort_by_key(|c| c.submitted);
        let pairs = sliced.len() == batches.len()
            && sliced
                .iter()
                .zip(&batches)
                .all(|(c, b)| c.submitted.is_some_and(|at| at <= b.issued));
        let unpaired_batches = if pairs {
            for (c, b) in sliced.into_iter().zip(&batches) {
                c.batch = Some(BatchSpan {
                    bytes: b.bytes,
                    issued: b.issued,
                    reported: b.reported,
                    transfer: b.transfer,
                    copied: b.copied,
                });
            }
            0
        } else {
            batches.len()
        };
        let lanes = requests
            .into_iter()
            .enumerate()
            .map(|(i, (request, last_computed, completed))| Lane {
                rank: 0,
                request,
                origin,
                chunks: self
                    .chunks
                    .iter()
                    .filter(|(r, _)| *r == i)
                    .map(|(_, c)| *c)
                    .collect(),
                last_computed,
                completed,
            })
            .collect();
        Timeline {
            lanes,
            unpaired_batches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn chunk(index: u32, computed: u64, sliced: bool) -> ChunkTiming {
        ChunkTiming {
            index,
            tokens: (index * 10, index * 10 + 10),
            layers: None,
            compute_started: at(computed - 5),
            computed: at(computed),
            submitted: Some(at(computed)),
            sliced,
            batch: None,
        }
    }

    fn batch(issued: u64) -> BatchTiming {
        BatchTiming {
            bytes: 1,
            issued: at(issued),
            transfer: Duration::from_millis(1),
            copied: at(issued + 1),
            reported: at(issued + 2),
        }
    }

    #[test]
    fn batches_pair_with_the_chunks_that_made_slices_in_order() {
        let mut r = TimelineRecorder::default();
        r.chunk(0, chunk(0, 10, true));
        r.chunk(1, chunk(0, 20, false));
        r.chunk(0, chunk(1, 30, true));
        let ids = [
            (RequestId(1), Some(at(30)), Some(at(33))),
            (RequestId(2), None, None),
        ];
        // Reported out of order: pairing goes by issue time.
        let t = r.finish(at(0), ids, &[batch(31), batch(11)]);
        assert_eq!(t.unpaired_batches, 0);
        let issued: Vec<_> = t.lanes[0]
            .chunks
            .iter()
            .map(|c| c.batch.map(|b| b.issued))
            .collect();
        assert_eq!(issued, [Some(at(11)), Some(at(31))]);
        assert_eq!(t.lanes[1].chunks[0].batch, None);
        assert_eq!(t.lanes[0].exposed_tail(), Some(Duration::from_millis(3)));
    }

    #[test]
    fn nothing_is_paired_when_the_batches_do_not_match_the_slices() {
        let mut r = TimelineRecorder::default();
        r.chunk(0, chunk(0, 10, true));
        let ids = [(RequestId(1), None, None)];
        let t = r.finish(at(0), ids, &[batch(11), batch(12)]);
        assert_eq!(t.unpaired_batches, 2);
        let mut r = TimelineRecorder::default();
        r.chunk(0, chunk(0, 10, true));
        // A batch issued before its chunk was submitted cannot be its.
        let t = r.finish(at(0), ids, &[batch(9)]);
        assert_eq!(t.unpaired_batches, 1);
        assert_eq!(t.lanes[0].chunks[0].batch, None);
    }
}
