//! # kvpipe-tcp
//!
//! The TCP transport: control frames and data writes over sockets, with payloads read from the
//! socket straight into the destination region and every write checked against the receiver's
//! grant.
//!
//! Status: the driver is not built yet; this crate currently exports nothing.
