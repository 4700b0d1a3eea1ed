//! The engine settings pipelined transfer depends on, checked in one place, once, before any
//! request is streamed (DESIGN §3).

use thiserror::Error;

/// How the decode side schedules a new request against ongoing generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum SchedulingPolicy {
    /// The receiver registers a request's destination blocks before its prefill starts, so
    /// every chunk finds them posted. Required by pipelined mode.
    #[default]
    GenerationFirst,
    /// The receiver registers only when prefill is done (whole-request transfer).
    ContextFirst,
}

/// The engine settings pipelined (per-chunk) transfer depends on. Build it from the engine's
/// configuration and call [`PipelineConfig::validate`] once, at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PipelineConfig {
    /// Whether prefill runs in chunks (otherwise there is nothing to pipeline).
    pub chunked_prefill: bool,
    /// The decode side's scheduling policy.
    pub scheduling: SchedulingPolicy,
    /// Beams per request.
    pub beam_width: u32,
    /// Pipeline-parallel size of the prefill (sender) side.
    pub sender_pp_size: u32,
    /// Whether KV goes through an intermediate bounce buffer instead of straight from the cache.
    pub bounce_buffer: bool,
    /// Number of recurrent / hybrid (e.g. Mamba) state groups in the model; their state is
    /// rewritten in place by every chunk, so it cannot be streamed block by block.
    pub recurrent_state_groups: u32,
}

impl Default for PipelineConfig {
    /// The one configuration pipelined mode accepts.
    fn default() -> Self {
        PipelineConfig {
            chunked_prefill: true,
            scheduling: SchedulingPolicy::GenerationFirst,
            beam_width: 1,
            sender_pp_size: 1,
            bounce_buffer: false,
            recurrent_state_groups: 0,
        }
    }
}

impl PipelineConfig {
    /// Checks every requirement of pipelined mode; returns the first violation, in the order
    /// of [`PipelineConfig::violations`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.violations().next() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Every requirement this configuration violates, in a fixed order (chunked prefill,
    /// scheduling, beam width, sender PP size, bounce buffer, state groups), so a caller can
    /// report them all at once.
    pub fn violations(&self) -> impl Iterator<Item = ConfigError> {
        let c = *self;
        [
            (!c.chunked_prefill).then_some(ConfigError::ChunkedPrefillOff),
            (c.scheduling != SchedulingPolicy::GenerationFirst)
                .then_some(ConfigError::NotGenerationFirst(c.scheduling)),
            (c.beam_width != 1).then_some(ConfigError::BeamWidth(c.beam_width)),
            (c.sender_pp_size != 1)
                .then_some(ConfigError::SenderPipelineParallel(c.sender_pp_size)),
            c.bounce_buffer.then_some(ConfigError::BounceBuffer),
            (c.recurrent_state_groups != 0)
                .then_some(ConfigError::RecurrentState(c.recurrent_state_groups)),
        ]
        .into_iter()
        .flatten()
    }
}

/// A setting pipelined mode cannot run with; the message says what to change.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// Prefill is not chunked.
    #[error(
        "pipelined transfer needs chunked prefill: turn chunked prefill on in the prefill engine"
    )]
    ChunkedPrefillOff,
    /// The decode side does not register before prefill starts.
    #[error(
        "pipelined transfer needs generation-first scheduling (the receiver registers before \
         prefill starts), but the scheduling policy is {0:?}: set it to generation-first"
    )]
    NotGenerationFirst(SchedulingPolicy),
    /// More than one beam (or zero).
    #[error("pipelined transfer needs a beam width of 1, but it is {0}: set the beam width to 1")]
    BeamWidth(u32),
    /// The prefill side is pipeline-parallel.
    #[error(
        "pipelined transfer needs a sender pipeline-parallel size of 1, but it is {0}: run \
         prefill without pipeline parallelism"
    )]
    SenderPipelineParallel(u32),
    /// KV is staged through a bounce buffer.
    #[error("pipelined transfer writes straight from the KV cache: turn the bounce buffer off")]
    BounceBuffer,
    /// The model has recurrent / hybrid state groups.
    #[error(
        "pipelined transfer cannot stream recurrent/hybrid state: the model has {0} state \
         groups; use whole-request transfer for this model"
    )]
    RecurrentState(u32),
    /// The sender's layer order does not list its layers (see
    /// [`SenderConfig::layer_order`](crate::SenderConfig::layer_order)).
    #[error("{0}")]
    LayerOrder(#[from] crate::layers::LayerOrderError),
    /// A deadline is zero where a zero wait cannot work (see
    /// [`Deadlines::check`](crate::session::Deadlines::check)).
    #[error(
        "deadline {0} is zero: an endpoint cannot wait for nothing (a zero heartbeat interval \
         spins, a zero handshake or liveness timeout drops every peer at once); give it a \
         positive duration"
    )]
    ZeroDeadline(&'static str),
    /// The liveness timeout is not longer than the heartbeat interval, so a healthy idle peer
    /// would be declared lost before its next heartbeat could arrive.
    #[error(
        "deadline liveness_timeout ({liveness_timeout}) must be longer than heartbeat_interval \
         ({heartbeat_interval}), or an idle but healthy peer is lost before its next \
         heartbeat: raise liveness_timeout (several heartbeat intervals)"
    )]
    LivenessNotAboveHeartbeat {
        /// The configured liveness timeout.
        liveness_timeout: crate::time::Duration,
        /// The configured heartbeat interval.
        heartbeat_interval: crate::time::Duration,
    },
    /// A layer group of the node's own layout breaks a rule every layout keeps (see
    /// [`check_layout`](crate::plan::check_layout)): every transfer would fail or move nothing.
    #[error("layer group {group}: {error}")]
    Layout {
        /// The group (index in the layout).
        group: usize,
        /// What is wrong.
        error: crate::plan::PlanError,
    },
    /// The node's own place in the parallel topology is one no peer would accept (see
    /// [`check_topology`](crate::check_topology)).
    #[error("topology: {0}")]
    Topology(#[from] crate::shard::TopologyError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_configuration_is_valid() {
        assert_eq!(PipelineConfig::default().validate(), Ok(()));
        assert_eq!(PipelineConfig::default().violations().count(), 0);
    }

    #[test]
    fn each_requirement_has_its_own_error() {
        let ok = PipelineConfig::default();
        let cases = [
            (
                PipelineConfig {
                    chunked_prefill: false,
                    ..ok
                },
                ConfigError::ChunkedPrefillOff,
            ),
            (
                PipelineConfig {
                    scheduling: SchedulingPolicy::ContextFirst,
                    ..ok
                },
                ConfigError::NotGenerationFirst(SchedulingPolicy::ContextFirst),
            ),
            (
                PipelineConfig {
                    beam_width: 4,
                    ..ok
                },
                ConfigError::BeamWidth(4),
            ),
            (
                PipelineConfig {
                    beam_width: 0,
                    ..ok
                },
                ConfigError::BeamWidth(0),
            ),
            (
                PipelineConfig {
                    sender_pp_size: 2,
                    ..ok
                },
                ConfigError::SenderPipelineParallel(2),
            ),
            (
                PipelineConfig {
                    bounce_buffer: true,
                    ..ok
                },
                ConfigError::BounceBuffer,
            ),
            (
                PipelineConfig {
                    recurrent_state_groups: 3,
                    ..ok
                },
                ConfigError::RecurrentState(3),
            ),
        ];
        for (config, err) in cases {
            assert_eq!(config.validate(), Err(err.clone()));
            assert_eq!(config.violations().collect::<Vec<_>>(), vec![err]);
        }
    }

    #[test]
    fn violations_lists_every_problem_in_order() {
        let config = PipelineConfig {
            chunked_prefill: false,
            beam_width: 2,
            bounce_buffer: true,
            ..PipelineConfig::default()
        };
        assert_eq!(config.validate(), Err(ConfigError::ChunkedPrefillOff));
        assert_eq!(
            config.violations().collect::<Vec<_>>(),
            vec![
                ConfigError::ChunkedPrefillOff,
                ConfigError::BeamWidth(2),
                ConfigError::BounceBuffer
            ]
        );
        assert!(ConfigError::BeamWidth(2)
            .to_string()
            .contains("set the beam width to 1"));
    }
}
