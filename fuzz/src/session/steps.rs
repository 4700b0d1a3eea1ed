//! Applying a case's [`Step`]s: the convenience steps built well-formed, the raw endpoint
//! inputs folded into the case's small world first.

use bytes::Bytes;
use kvpipe_core::session::{ReceiverInput, Registration, SendRequest, SenderInput};
use kvpipe_core::wire::{DataWrite, Frame};
use kvpipe_core::{AnchoredRun, BlockId, ChunkSpec, Duration, LayerRange};

use super::case::Step;
use super::world::{
    aux_data, fold, prompt_len, request, FixedSource, RECEIVER, RECEIVER_REGION, SENDER, SLOT, TPB,
};
use super::Pair;

impl Pair {
    pub(super) fn apply(&mut self, step: Step) {
        let now = self.now;
        match step {
            Step::Sender(input) => self.sender_input(input),
            Step::Receiver(input) => self.receiver_input(input),
            Step::Chunk {
                request: r,
                tokens,
                last,
            } => {
                let r = request(r);
                let prompt = prompt_len(r);
                let start = self.next_start.get(&r).copied().unwrap_or(0);
                let mut end = (start + u32::from(tokens)).min(prompt);
                if last {
                    end = prompt;
                }
                let spec = ChunkSpec {
                    start,
                    end,
                    prompt_len: prompt,
                    prepopulated_len: 0,
                    is_last: end == prompt,
                    prefix_sent_early: false,
                };
                let res = self.sender.submit_chunk(now, r, spec, &mut FixedSource);
                if res.is_ok() {
                    self.next_start.insert(r, end);
                    if spec.is_last {
                        self.last_submitted.insert(r);
                    }
                }
                self.count(res.map(|_| ()));
            }
            Step::ChunkLayers {
                request: r,
                tokens,
                last,
                layers,
            } => {
                let r = request(r);
                let count = self.sender.layer_count();
                let (spec, begin) = match (self.open_chunk.get(&r), self.sender.next_chunk_layer(r))
                {
                    (Some(spec), Some(next)) => (*spec, next),
                    _ => {
                        let prompt = prompt_len(r);
                        let start = self.next_start.get(&r).copied().unwrap_or(0);
                        let mut end = (start + u32::from(tokens)).min(prompt);
                        if last {
                            end = prompt;
                        }
                        let spec = ChunkSpec {
                            start,
                            end,
                            prompt_len: prompt,
                            prepopulated_len: 0,
                            is_last: end == prompt,
                            prefix_sent_early: false,
                        };
                        (spec, 0)
                    }
                };
                let end =
                    (begin + 1 + u32::from(layers) % count.saturating_sub(begin).max(1)).min(count);
                let range = LayerRange::new(begin, end);
                let res = self
                    .sender
                    .submit_chunk_layers(now, r, spec, range, &mut FixedSource);
                if res.is_ok() {
                    self.next_start.insert(r, spec.end);
                    if end == count {
                        self.open_chunk.remove(&r);
                        if spec.is_last {
                            self.last_submitted.insert(r);
                        }
                    } else {
                        self.open_chunk.insert(r, spec);
                    }
                }
                self.count(res.map(|_| ()));
            }
            Step::Open {
                request: r,
                several_beams,
            } => self.sender_input(SenderInput::Open {
                now,
                request: SendRequest {
                    request: request(r),
                    receivers: [RECEIVER].into_iter().collect(),
                    beam_width: if several_beams { 2 } else { 1 },
                },
            }),
            Step::Aux { request: r } => self.sender_input(SenderInput::Aux {
                now,
                request: request(r),
                data: aux_data(request(r)),
            }),
            Step::Register { request: r, cached } => {
                let r = request(r);
                let prompt = prompt_len(r);
                let blocks = prompt.div_ceil(TPB);
                let first = (u32::from(cached) % (prompt + 1)) / TPB;
                let ids: Vec<BlockId> = (first..blocks)
                    .map(|o| BlockId(20 * r.0 as u32 + o))
                    .collect();
                let registration = Registration {
                    request: r,
                    prompt_len: prompt,
                    groups: vec![AnchoredRun::from_ids(first, &ids)],
                    writers: [SENDER].into_iter().collect(),
                    aux_capacity: 256,
                    expected_part: None,
                };
                self.receiver_input(ReceiverInput::Register { now, registration });
            }
            Step::LandBatch { index } => self.land_batch(index.into()),
            Step::DataWrite {
                request: r,
                offset,
                len,
                stray,
            } => {
                let r = request(r);
                let grant = self.receiver.grant(r).unwrap_or_default();
                let base = 20 * r.0 * SLOT;
                let write = DataWrite {
                    request: r,
                    grant: if stray {
                        kvpipe_core::GrantId(grant.0 ^ 1)
                    } else {
                        grant
                    },
                    region: RECEIVER_REGION,
                    offset: base + 16 * u64::from(offset % 64),
                    len: 16 * u64::from(len % 16 + 1),
                };
                let _ = self.admit(&write);
            }
            Step::Deliver => self.deliver_due(),
            Step::DeliverAny { to_receiver, index } => {
                let q = if to_receiver {
                    &mut self.to_receiver
                } else {
                    &mut self.to_sender
                };
                if let Some(bytes) = q.take(index.into()) {
                    self.deliver(to_receiver, bytes);
                }
            }
            Step::Advance { millis } => {
                self.now += Duration::from_millis(u64::from(millis % 1000));
                self.deliver_due();
            }
            Step::Pump => self.pump(),
            Step::Frame {
                to_receiver,
                request: r,
                mut frame,
            } => {
                let r = request(r);
                match &mut frame {
                    Frame::RecvRegistration(f) => f.request = r,
                    Frame::KvResult(f) => f.request = r,
                    Frame::AuxResult(f) => f.request = r,
                    Frame::Cancel(f) => f.request = r,
                    Frame::DataWrite(f) => f.request = r,
                    _ => {}
                }
                if self.connected {
                    if let Ok(bytes) = frame.to_vec() {
                        self.deliver(to_receiver, Bytes::from(bytes));
                    }
                }
            }
        }
        self.drain();
        self.tick();
    }

    /// Folds a sender input into the case (see the module doc) and applies it.
    fn sender_input(&mut self, input: SenderInput) {
        let now = self.now;
        let input = match input {
            SenderInput::Transport { input, .. } => return self.sender_transport(input),
            SenderInput::Open { mut request, .. } => {
                request.request = fold(request.request);
                request.receivers = [RECEIVER].into_iter().collect();
                SenderInput::Open { now, request }
            }
            SenderInput::Chunk {
                request,
                spec,
                runs,
                ..
            } => SenderInput::Chunk {
                now,
                request: fold(request),
                spec,
                runs,
            },
            SenderInput::ChunkLayers {
                request,
                spec,
                layers,
                runs,
                ..
            } => SenderInput::ChunkLayers {
                now,
                request: fold(request),
                spec,
                layers,
                runs,
            },
            SenderInput::Prefix {
                request,
                prompt_len,
                prepopulated_len,
                runs,
                ..
            } => SenderInput::Prefix {
                now,
                request: fold(request),
                prompt_len,
                prepopulated_len,
                runs,
            },
            SenderInput::Aux { request, data, .. } => SenderInput::Aux {
                now,
                request: fold(request),
                data,
            },
            SenderInput::Cancel { request, .. } => SenderInput::Cancel {
                now,
                request: fold(request),
            },
            SenderInput::Retire { request, .. } => SenderInput::Retire {
                now,
                request: fold(request),
            },
        };
        let res = self.sender.handle_input(input.clone());
        if res.is_ok() {
            match input {
                SenderInput::Open { request, .. } => {
                    self.opened.insert(request.request);
                }
                SenderInput::Chunk { request, spec, .. } if spec.is_last => {
                    self.last_submitted.insert(request);
                }
                SenderInput::ChunkLayers {
                    request,
                    spec,
                    layers,
                    ..
                } if spec.is_last && layers.end == self.sender.layer_count() => {
                    self.last_submitted.insert(request);
                }
                SenderInput::Aux { request, .. } => {
                    self.aux_submitted.insert(request);
                }
                SenderInput::Cancel { request, .. } => {
                    self.send_track.entry(request).or_default().no_writes = true;
                    self.cancelled.insert(request);
                }
                SenderInput::Retire { request, .. } => {
                    let t = self.send_track.entry(request).or_default();
                    assert!(t.quiesced, "the sender retired {request} before Quiesced");
                    t.no_writes = true;
                }
                _ => {}
            }
        }
        self.count(res);
    }

    /// Folds a receiver input into the case (see the module doc) and applies it.
    fn receiver_input(&mut self, input: ReceiverInput) {
        let now = self.now;
        let input = match input {
            ReceiverInput::Transport { input, .. } => return self.receiver_transport(input),
            ReceiverInput::Register {
                mut registration, ..
            } => {
                registration.request = fold(registration.request);
                registration.writers = [SENDER].into_iter().collect();
                ReceiverInput::Register { now, registration }
            }
            ReceiverInput::Cancel { request, .. } => ReceiverInput::Cancel {
                now,
                request: fold(request),
            },
            ReceiverInput::Retire { request, .. } => ReceiverInput::Retire {
                now,
                request: fold(request),
            },
        };
        let res = self.receiver.handle_input(input.clone());
        if res.is_ok() {
            match input {
                ReceiverInput::Register { registration, .. } => {
                    self.registered.insert(registration.request);
                }
                ReceiverInput::Retire { request, .. } => {
                    let t = self.recv_track.entry(request).or_default();
                    assert!(t.quiesced, "the receiver retired {request} before Quiesced");
                    assert!(
                        !self.applying_for(request),
                        "the receiver retired {request} with a write still being applied"
                    );
                }
                _ => {}
            }
        }
        self.count(res);
    }
}
