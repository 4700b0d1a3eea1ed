//! One request timed through a connected prefill/decode node pair on the node driver, as the
//! TCP, TCP-device and verbs benches run it, written once: registered and opened, every chunk and the aux data
//! submitted, timed until the decode side completes, then both sides quiesced and the request
//! retired on both.

use std::time::{Duration, Instant};

use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    AnchoredRun, BlockSource, ChunkSpec, Event, PeerId, Receiver, RequestId, Sender,
};
use kvpipe_driver::{Driver, Io};

use crate::CliError;

/// How long a timed request waits for each step before the bench gives up.
#[derive(Clone, Copy, Debug)]
pub(super) struct Patience {
    /// For the prefill side to see the registration.
    pub(super) registered: Duration,
    /// For the decode side to complete, from the first chunk.
    pub(super) completed: Duration,
    /// For each side to quiesce.
    pub(super) quiesced: Duration,
}

/// Two connected nodes, as the benches time requests through them.
pub(super) struct Pair<'a, T: Io, R: Io> {
    tx: &'a Driver<Sender, T>,
    rx: &'a Driver<Receiver, R>,
    /// How the decode node names the prefill node.
    sender_peer: PeerId,
    /// How the prefill node names the decode node.
    receiver_peer: PeerId,
}

impl<'a, T: Io, R: Io> Pair<'a, T, R> {
    /// The pair once both nodes report their link ready (within `limit` each): the prefill node
    /// connected and names the decode node `receiver_peer`.
    pub(super) fn ready(
        tx: &'a Driver<Sender, T>,
        rx: &'a Driver<Receiver, R>,
        receiver_peer: PeerId,
        limit: Duration,
    ) -> Result<Self, CliError> {
        let mut sender_peer = PeerId(0);
        wait_event(
            |t| rx.next_event(t),
            limit,
            |e| match e {
                Event::PeerReady { peer, .. } => {
                    sender_peer = *peer;
                    true
                }
                _ => false,
            },
        )?;
        wait_event(
            |t| tx.next_event(t),
            limit,
            |e| matches!(e, Event::PeerReady { .. }),
        )?;
        Ok(Pair {
            tx,
            rx,
            sender_peer,
            receiver_peer,
        })
    }

    /// Moves `request` (`tokens` long, its blocks at `anchored` on the decode side, submitted as
    /// `specs`) and returns the seconds from the first chunk's submission to the decode side's
    /// completion; both sides have quiesced and retired it when this returns.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn timed_request(
        &self,
        request: RequestId,
        tokens: u32,
        anchored: &AnchoredRun,
        specs: &[ChunkSpec],
        source: &mut impl BlockSource,
        patience: Patience,
    ) -> Result<f64, CliError> {
        let (tx, rx) = (self.tx, self.rx);
        rx.register(Registration {
            request,
            prompt_len: tokens,
            groups: vec![anchored.clone()],
            writers: std::iter::once(self.sender_peer).collect(),
            aux_capacity: 64,
            expected_part: None,
        })?;
        tx.open_request(SendRequest {
            request,
            receivers: std::iter::once(self.receiver_peer).collect(),
            beam_width: 1,
        })?;
        wait_event(
            |t| tx.next_event(t),
            patience.registered,
            |e| matches!(e, Event::Registered { request: r, .. } if *r == request),
        )?;
        let t0 = Instant::now();
        for spec in specs {
            tx.submit_chunk(request, *spec, source)?;
        }
        tx.submit_aux(
            request,
            AuxData {
                prompt_tokens: tokens,
                ..AuxData::default()
            },
        )?;
        wait_event(
            |t| rx.next_event(t),
            patience.completed,
            |e| matches!(e, Event::Completed { request: r, .. } if *r == request),
        )?;
        let elapsed = t0.elapsed().as_secs_f64();
        let quiesced = |e: &Event| matches!(e, Event::Quiesced { request: r } if *r == request);
        wait_event(|t| rx.next_event(t), patience.quiesced, quiesced)?;
        wait_event(|t| tx.next_event(t), patience.quiesced, quiesced)?;
        tx.retire(request)?;
        rx.retire(request)?;
        Ok(elapsed)
    }
}

/// Waits up to `limit` for an event `pred` accepts; a failure, time-out or rejection on the way
/// is an error.
pub(super) fn wait_event(
    next: impl Fn(Duration) -> Option<Event>,
    limit: Duration,
    mut pred: impl FnMut(&Event) -> bool,
) -> Result<(), CliError> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(e) = next(Duration::from_millis(100)) {
            match &e {
                Event::Failed { .. } | Event::TimedOut { .. } | Event::PeerRejected { .. } => {
                    return Err(format!("transfer failed: {e:?}").into())
                }
                _ if pred(&e) => return Ok(()),
                _ => {}
            }
        }
    }
    Err("timed out waiting for the transfer".into())
}
