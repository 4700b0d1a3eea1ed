//! The conformance suite over the TCP transport: a sender node and a receiver node in one
//! process, connected over loopback sockets (see [`TcpHarness`]).

use kvpipe_conformance::suite::TcpHarness;

mod one_connection {
    kvpipe_conformance::conformance_tests!(super::TcpHarness::blocking(1));
}

mod three_connections {
    kvpipe_conformance::conformance_tests!(super::TcpHarness::blocking(3));
}

#[cfg(feature = "tokio")]
mod tokio_two_connections {
    kvpipe_conformance::conformance_tests!(super::TcpHarness::tokio(2));
}
