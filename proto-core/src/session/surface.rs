//! The public surface both endpoints share, written once: the getters every endpoint has, the
//! output queue, input recording, the inputs that are the same for both roles (transport,
//! cancel, retire) and the [`Endpoint`](super::Endpoint) implementation. Each endpoint invokes
//! [`endpoint_surface!`] with its own type, role, input, phase and configuration; its own
//! inputs are applied by its `apply` method.

/// The inputs an endpoint applied since recording started, when it records.
#[derive(Clone, Debug)]
pub(crate) struct InputLog<I>(Option<Vec<I>>);

impl<I: Clone> InputLog<I> {
    /// A log that does not record.
    pub(crate) fn off() -> Self {
        InputLog(None)
    }

    /// Starts (a fresh log) or stops recording.
    pub(crate) fn set_recording(&mut self, on: bool) {
        self.0 = on.then(Vec::new);
    }

    /// The inputs recorded so far (recording goes on).
    pub(crate) fn take(&mut self) -> Vec<I> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether it records.
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// A copy of `input` to record once it applied, when recording (nothing to clone
    /// otherwise).
    pub(crate) fn copy(&self, input: &I) -> Option<I> {
        self.0.as_ref().map(|_| input.clone())
    }

    /// Records `input` when recording.
    pub(crate) fn push(&mut self, input: I) {
        if let Some(log) = &mut self.0 {
            log.push(input);
        }
    }

    /// Records the copy [`copy`](Self::copy) made, if it made one.
    pub(crate) fn push_copy(&mut self, copy: Option<I>) {
        if let (Some(log), Some(input)) = (&mut self.0, copy) {
            log.push(input);
        }
    }
}

/// Writes the shared surface of endpoint `$endpoint` (fields `config`, `shell`, `sessions`,
/// `recorded`; an inherent `apply($input)` for its own inputs, and `admit_write`).
macro_rules! endpoint_surface {
    ($endpoint:ident, $role:expr, $input:ident, $phase:ident, $config:ident) => {
        impl $endpoint {
            /// The configuration.
            pub fn config(&self) -> &$config {
                &self.config
            }

            /// What the endpoint has done so far.
            pub fn counters(&self) -> &Counters {
                &self.shell.counters
            }

            #[doc = concat!(
                "The phase of `request`'s session: `None` if unknown, [`",
                stringify!($phase),
                "::Retired`] if retired (and still remembered)."
            )]
            pub fn phase(&self, request: RequestId) -> Option<$phase> {
                self.sessions.phase(request)
            }

            /// Sessions held (not yet retired).
            pub fn session_count(&self) -> usize {
                self.sessions.live.len()
            }

            /// Connected peers (handshaking, ready or closing).
            pub fn peer_count(&self) -> usize {
                self.shell.peers.len()
            }

            /// Whether the handshake with `peer` completed.
            pub fn is_peer_ready(&self, peer: PeerId) -> bool {
                self.shell.peers.is_ready(peer)
            }

            #[doc = concat!(
                "Retired request ids remembered now (at most one horizon's retirements, see [`",
                stringify!($config),
                "::retired_horizon`](super::",
                stringify!($config),
                "::retired_horizon))."
            )]
            pub fn retired_count(&self) -> usize {
                self.sessions.retired.len()
            }

            /// The next output, or `None` when there is nothing to do until the next input.
            pub fn poll_output(&mut self) -> Option<Output> {
                self.shell.outputs.pop_front()
            }

            /// When to deliver [`TransportInput::Timeout`] next (`None`: no deadline pending).
            pub fn poll_timeout(&mut self) -> Option<Instant> {
                self.shell.timers.next()
            }

            /// Starts (or stops, with `false`) recording every input applied, for
            /// [`take_recorded_inputs`](Self::take_recorded_inputs). Inputs refused with a
            /// usage error are not recorded (they changed nothing).
            pub fn record_inputs(&mut self, on: bool) {
                self.recorded.set_recording(on);
            }

            /// The inputs applied since recording started (recording goes on).
            pub fn take_recorded_inputs(&mut self) -> Vec<$input> {
                self.recorded.take()
            }

            /// Applies one input. Returns a usage error, with nothing changed, for a caller bug.
            pub fn handle_input(&mut self, input: $input) -> Result<(), UsageError> {
                let copy = self.recorded.copy(&input);
                self.apply(input)?;
                self.recorded.push_copy(copy);
                Ok(())
            }

            #[doc = concat!(
                "Applies what the transport saw (see [`",
                stringify!($input),
                "::Transport`])."
            )]
            pub fn handle_transport(
                &mut self,
                now: Instant,
                input: TransportInput,
            ) -> Result<(), UsageError> {
                self.handle_input($input::Transport { now, input })
            }

            #[doc = concat!("Cancels `request` (see [`", stringify!($input), "::Cancel`]).")]
            pub fn cancel(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
                self.handle_input($input::Cancel { now, request })
            }

            #[doc = concat!("Retires `request` (see [`", stringify!($input), "::Retire`]).")]
            pub fn retire(&mut self, now: Instant, request: RequestId) -> Result<(), UsageError> {
                self.handle_input($input::Retire { now, request })
            }
        }

        impl Endpoint for $endpoint {
            fn role(&self) -> Role {
                $role
            }

            fn handle_transport(
                &mut self,
                now: Instant,
                input: TransportInput,
            ) -> Result<(), UsageError> {
                $endpoint::handle_transport(self, now, input)
            }

            fn admit_write(
                &mut self,
                now: Instant,
                peer: PeerId,
                header: &DataWrite,
            ) -> Admission {
                $endpoint::admit_write(self, now, peer, header)
            }

            fn poll_output(&mut self) -> Option<Output> {
                $endpoint::poll_output(self)
            }

            fn poll_timeout(&mut self) -> Option<Instant> {
                $endpoint::poll_timeout(self)
            }

            fn counters(&self) -> &Counters {
                $endpoint::counters(self)
            }

            fn is_peer_ready(&self, peer: PeerId) -> bool {
                $endpoint::is_peer_ready(self, peer)
            }

            fn frame_body_limit(&self, peer: PeerId) -> u32 {
                self.shell.peers.body_limit(peer)
            }

            fn peer_count(&self) -> usize {
                $endpoint::peer_count(self)
            }

            fn session_count(&self) -> usize {
                $endpoint::session_count(self)
            }
        }
    };
}

pub(crate) use endpoint_surface;
