//! What a fuzz case is: the network's configuration ([`NetemCase`]) and the [`Step`]s, both
//! built by `arbitrary` from the fuzzer's bytes, and what a run saw ([`SessionStats`]).

use arbitrary::Arbitrary;
use kvpipe_core::session::{ReceiverInput, SenderInput};
use kvpipe_core::wire::Frame;
use kvpipe_core::Duration;
use kvpipe_netem::{LossModel, NetemConfig};

/// The network between the endpoints, as a case configures it (rates in 1/256).
#[derive(Arbitrary, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetemCase {
    /// Seed of the emulation.
    pub seed: u64,
    /// Frames lost for good.
    pub loss: u8,
    /// Frames delivered twice.
    pub duplicate: u8,
    /// Frames that overtake the one before them.
    pub reorder: u8,
    /// Frames held up to 50 ms.
    pub delay: u8,
}

impl NetemCase {
    pub(super) fn config(self) -> NetemConfig {
        let p = |x: u8| f64::from(x) / 256.0;
        NetemConfig {
            seed: self.seed,
            loss: p(self.loss),
            loss_model: LossModel::Drop,
            duplicate: p(self.duplicate),
            reorder: p(self.reorder),
            delay: p(self.delay),
            delay_range: (Duration::ZERO, Duration::from_millis(50)),
            spare_handshake: true,
            ..NetemConfig::default()
        }
    }
}

/// One step of a case.
#[derive(Arbitrary, Clone, Debug)]
pub enum Step {
    /// An input to the sender, folded into the case (see the module doc).
    Sender(SenderInput),
    /// An input to the receiver, folded into the case; a `WriteArrived` goes through
    /// [`Receiver::admit_write`].
    ///
    /// [`Receiver::admit_write`]: kvpipe_core::session::Receiver::admit_write
    Receiver(ReceiverInput),
    /// The prefill engine opens a request towards the receiver (a real [`SenderInput::Open`]).
    Open {
        /// Request (folded).
        request: u8,
        /// Two beams instead of one (pipelined transfer refuses it).
        several_beams: bool,
    },
    /// The prefill engine submits the next chunk of a request, its runs from a fixed block
    /// source (a real [`SenderInput::Chunk`]).
    Chunk {
        /// Request (folded).
        request: u8,
        /// Tokens in the chunk (0 is allowed).
        tokens: u8,
        /// Make it the last chunk (it then runs to the prompt's end).
        last: bool,
    },
    /// The prefill engine submits well-formed aux data (a real [`SenderInput::Aux`]).
    Aux {
        /// Request (folded).
        request: u8,
    },
    /// The decode engine registers a request with a well-formed destination.
    Register {
        /// Request (folded).
        request: u8,
        /// Prompt tokens the receiver has cached (modulo the prompt).
        cached: u8,
    },
    /// A pending write batch lands through the receiver's admission and is reported complete
    /// (as the in-process transport carries one out).
    LandBatch {
        /// Which (modulo the pending batches).
        index: u8,
    },
    /// A data-write header for a request, inside its grant unless `stray`, through
    /// [`Receiver::admit_write`].
    ///
    /// [`Receiver::admit_write`]: kvpipe_core::session::Receiver::admit_write
    DataWrite {
        /// Request (folded).
        request: u8,
        /// Destination offset, in 16-byte units.
        offset: u16,
        /// Length, in 16-byte units.
        len: u8,
        /// Carry a wrong grant or aim outside the registered blocks.
        stray: bool,
    },
    /// Frames due by now are delivered (both ways).
    Deliver,
    /// A queued frame is delivered now, whatever its time.
    DeliverAny {
        /// Towards the receiver.
        to_receiver: bool,
        /// Which (modulo the queue).
        index: u8,
    },
    /// Time passes; due frames arrive and due timers fire.
    Advance {
        /// Milliseconds (modulo 1000).
        millis: u16,
    },
    /// The network and transport catch up: pending batches land, admitted writes finish, and
    /// queued frames are delivered, until nothing is left.
    Pump,
    /// A structured frame from a hostile peer (its request folded), encoded at the build's
    /// version and delivered at once.
    Frame {
        /// Towards the receiver.
        to_receiver: bool,
        /// Request the frame is about (for session frames).
        request: u8,
        /// The frame.
        frame: Frame,
    },
    /// The prefill engine submits the next layer range of a request's chunk (a real
    /// [`SenderInput::ChunkLayers`], the first range's runs from the fixed block source): the
    /// open chunk's next range, or the first range of a new chunk as [`Step::Chunk`] makes it.
    ChunkLayers {
        /// Request (folded).
        request: u8,
        /// Tokens in a new chunk (0 is allowed).
        tokens: u8,
        /// Make a new chunk the last (it then runs to the prompt's end).
        last: bool,
        /// Layers in the range (modulo the layers left, plus one).
        layers: u8,
    },
}

/// A whole fuzz case.
#[derive(Arbitrary, Clone, Debug)]
pub struct SessionCase {
    /// The network.
    pub netem: NetemCase,
    /// The steps, in order.
    pub steps: Vec<Step>,
}

/// What a run saw (for tests over structured cases).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Sender completions.
    pub sender_completed: u64,
    /// Receiver completions.
    pub receiver_completed: u64,
    /// Terminal events other than completion (both sides).
    pub ended_otherwise: u64,
    /// Write batches issued.
    pub batches: u64,
    /// Data writes admitted.
    pub admitted: u64,
    /// Inputs an endpoint refused as a usage error.
    pub refused: u64,
}
