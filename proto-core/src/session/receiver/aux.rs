//! Aux data: the writers' first tokens and counts, which must agree.

use super::*;

impl Receiver {
    /// A writer's aux data. A successful one is taken while the session is active, even at or
    /// after the receiver's aux deadline: the writer sent it only because the engine's data
    /// came before the sender's deadline, and its session already finished (see the
    /// `Receiver` doc, "Aux deadline").
    pub(super) fn on_aux(&mut self, now: Instant, peer: PeerId, aux: AuxResult) {
        let request = aux.request;
        let Some(w) = self.locate(now, peer, request, "AuxResult") else {
            return;
        };
        let session = self.sessions.live.get_mut(&request).expect("located");
        if !session.phase.is_active() || session.writers[w].aux {
            self.shell.counters.duplicates += 1;
            return;
        }
        if aux.status != TransferStatus::Success {
            self.stop(now, request, Stop::by(peer, aux.status));
            return;
        }
        let len = aux.data.slot_len();
        let capacity = session.frame.aux_capacity;
        if len > u64::from(capacity) {
            self.stop_protocol(
                now,
                request,
                peer,
                ProtocolError::AuxTooLarge {
                    request,
                    len,
                    capacity,
                },
            );
            return;
        }
        if session.aux.as_ref().is_some_and(|known| *known != aux.data) {
            self.stop_protocol(now, request, peer, ProtocolError::AuxMismatch { request });
            return;
        }
        session.writers[w].aux = true;
        session.aux.get_or_insert(aux.data);
        self.note_progress(now, request);
        self.progress(now, request);
    }
}
