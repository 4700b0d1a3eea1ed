//! The versioned wire format: every frame's representation and its encoding.
//!
//! `frame` holds the validated representations (what the state machines read and write).
//! The encoding (header view, `parse`/`emit`, decode errors) lives beside it.

mod frame;

pub use frame::*;
