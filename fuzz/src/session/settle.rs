//! The checks after a case's steps: every request ends and quiesces once the network and
//! transport catch up and the deadlines pass, and replaying each endpoint's recorded inputs
//! gives the same outputs.

use kvpipe_core::session::{Receiver, Sender};

use super::case::Step;
use super::world::{receiver_config, sender_config};
use super::Pair;

impl Pair {
    /// Lets the network and transport catch up while twelve seconds pass (no engine input), then
    /// checks that nothing waits without a deadline: every registered request ended and
    /// quiesced on the receiver; every request opened on the sender whose last chunk was
    /// submitted, or that the engine cancelled, ended and quiesced there. (A sender session
    /// still waiting for its engine's chunks may wait: that wait is the engine's.)
    pub(super) fn settle(&mut self) {
        for _ in 0..12 {
            self.apply(Step::Pump);
            self.apply(Step::Advance { millis: 999 });
        }
        self.apply(Step::Pump);
        for r in &self.registered {
            let t = self.recv_track.get(r).cloned().unwrap_or_default();
            assert!(
                t.terminal && t.quiesced,
                "receiver: {r} registered, still waiting after 12 s: {t:?}"
            );
        }
        for r in &self.opened {
            if self.last_submitted.contains(r) || self.cancelled.contains(r) {
                let t = self.send_track.get(r).cloned().unwrap_or_default();
                assert!(
                    t.terminal && t.quiesced,
                    "sender: {r} (last chunk or cancel given) still waiting after 12 s: {t:?}"
                );
            }
        }
    }

    /// Replays each endpoint's recorded inputs into a fresh one: the outputs are the same.
    pub(super) fn check_replay(&mut self) {
        let mut sender = Sender::new(sender_config()).expect("a supported configuration");
        let mut outputs = Vec::new();
        for input in self.sender.take_recorded_inputs() {
            sender
                .handle_input(input.clone())
                .unwrap_or_else(|e| panic!("the replayed sender refused {input:?}: {e}"));
            outputs.extend(std::iter::from_fn(|| sender.poll_output()));
        }
        assert!(
            outputs == self.sender_outputs,
            "the replayed sender's outputs differ"
        );
        let mut receiver = Receiver::new(receiver_config()).expect("a supported configuration");
        let mut outputs = Vec::new();
        for input in self.receiver.take_recorded_inputs() {
            receiver
                .handle_input(input.clone())
                .unwrap_or_else(|e| panic!("the replayed receiver refused {input:?}: {e}"));
            outputs.extend(std::iter::from_fn(|| receiver.poll_output()));
        }
        assert!(
            outputs == self.receiver_outputs,
            "the replayed receiver's outputs differ"
        );
    }
}
