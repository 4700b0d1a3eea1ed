//! The core endpoint a handle drives: [`Sender`] (prefill) or [`Receiver`] (decode).

use kvpipe_core::{Endpoint, Receiver, Sender};
use kvpipe_mem::MemPair;

mod sealed {
    pub trait Sealed {}
    impl Sealed for kvpipe_core::Sender {}
    impl Sealed for kvpipe_core::Receiver {}
}

/// The core endpoint of a role: [`Sender`] (prefill) or [`Receiver`] (decode).
pub trait Role: Endpoint + Send + sealed::Sealed + 'static {
    /// This role's endpoint in an in-process pair.
    #[doc(hidden)]
    fn of_pair(pair: &mut MemPair) -> &mut Self;
}

impl Role for Sender {
    fn of_pair(pair: &mut MemPair) -> &mut Self {
        pair.sender_mut()
    }
}

impl Role for Receiver {
    fn of_pair(pair: &mut MemPair) -> &mut Self {
        pair.receiver_mut()
    }
}
