//! The metrics the observers record, with their kinds and labels. Every metric carries
//! `transport` (`mem`, `tcp`, `verbs`) and, except where noted, `role` (`sender` on a prefill
//! endpoint, `receiver` on a decode endpoint). Times are in seconds, sizes in bytes.
//!
//! | metric | kind | labels | what it counts |
//! |---|---|---|---|
//! | `kvpipe_bytes_sent_total` | counter | | bytes of write batches the transport reported written (sender) |
//! | `kvpipe_bytes_received_total` | counter | | bytes the writers' results reported written into this receiver |
//! | `kvpipe_write_batches_total` | counter | | write batches handed to the transport (sender) |
//! | `kvpipe_requests_total` | counter | `outcome`, `cause` | requests ended: `outcome` `completed` (cause `none`), `failed` (cause: the transfer status, e.g. `peer_lost`, `write_failed`), `timed_out` (cause: what was awaited, e.g. `registration`, `results`), `cancelled` (cause `local` or `peer`) |
//! | `kvpipe_writes_refused_total` | counter | | data writes the receiver's admission refused (outside the grant, wrong grant, …) |
//! | `kvpipe_protocol_errors_total` | counter | | rules a peer broke |
//! | `kvpipe_handshakes_refused_total` | counter | | handshakes refused, by either side |
//! | `kvpipe_open_sessions` | gauge | | sessions held (not yet retired) |
//! | `kvpipe_pinned_blocks` | gauge | | KV blocks the sessions keep pinned until they quiesce |
//! | `kvpipe_write_batch_seconds` | histogram | (no `role`: sender only) | one write batch, from handed to the transport to reported done |
//! | `kvpipe_exposed_tail_seconds` | histogram | `view` (no `role`) | the exposed tail of completed requests, last chunk computed → receiver complete. `view="both"`: from both sides' timings on one clock (`kvpipe demo`); `view="sender"`: last chunk computed → the sender finished (its last batch written, last result and aux data sent); `view="receiver"`: the request's last burst of data began → receiver complete ([`RequestTimings::receiver_tail`](kvpipe_core::session::RequestTimings::receiver_tail)) |
//! | `kvpipe_transfer_seconds` | histogram | `view` (no `role`) | the transfer of completed requests, first byte → last byte. `view="both"`: first byte sent → last byte landed, one clock; `view="sender"` / `view="receiver"`: that side's own first and last byte ([`RequestTimings::transfer`](kvpipe_core::session::RequestTimings::transfer)) |

/// Counter: bytes the transport reported written (sender).
pub const BYTES_SENT: &str = "kvpipe_bytes_sent_total";
/// Counter: bytes the writers reported written into this receiver.
pub const BYTES_RECEIVED: &str = "kvpipe_bytes_received_total";
/// Counter: write batches handed to the transport (sender).
pub const WRITE_BATCHES: &str = "kvpipe_write_batches_total";
/// Counter: requests ended, by `outcome` and `cause`.
pub const REQUESTS: &str = "kvpipe_requests_total";
/// Counter: data writes refused by admission (receiver).
pub const WRITES_REFUSED: &str = "kvpipe_writes_refused_total";
/// Counter: protocol errors seen from peers.
pub const PROTOCOL_ERRORS: &str = "kvpipe_protocol_errors_total";
/// Counter: handshakes refused (by either side).
pub const HANDSHAKES_REFUSED: &str = "kvpipe_handshakes_refused_total";
/// Gauge: sessions held.
pub const OPEN_SESSIONS: &str = "kvpipe_open_sessions";
/// Gauge: blocks pinned until their sessions quiesce.
pub const PINNED_BLOCKS: &str = "kvpipe_pinned_blocks";
/// Histogram: one write batch, handed to the transport → reported done (seconds).
pub const WRITE_BATCH_SECONDS: &str = "kvpipe_write_batch_seconds";
/// Histogram: exposed tail of completed requests (seconds), by `view`.
pub const EXPOSED_TAIL_SECONDS: &str = "kvpipe_exposed_tail_seconds";
/// Histogram: first byte → last byte of completed requests (seconds), by `view`.
pub const TRANSFER_SECONDS: &str = "kvpipe_transfer_seconds";

/// Registers the description and unit of every metric with the installed recorder (an
/// exporter prints them as help text). Call once after installing the recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        BYTES_SENT,
        Unit::Bytes,
        "Bytes of write batches reported written (sender)."
    );
    describe_counter!(
        BYTES_RECEIVED,
        Unit::Bytes,
        "Bytes the writers' results reported written into this receiver."
    );
    describe_counter!(
        WRITE_BATCHES,
        "Write batches handed to the transport (sender)."
    );
    describe_counter!(REQUESTS, "Requests ended, by outcome and cause.");
    describe_counter!(
        WRITES_REFUSED,
        "Data writes refused by the receiver's admission."
    );
    describe_counter!(PROTOCOL_ERRORS, "Protocol rules peers broke.");
    describe_counter!(HANDSHAKES_REFUSED, "Handshakes refused by either side.");
    describe_gauge!(OPEN_SESSIONS, "Sessions held (not yet retired).");
    describe_gauge!(
        PINNED_BLOCKS,
        "KV blocks pinned until their sessions quiesce."
    );
    describe_histogram!(
        WRITE_BATCH_SECONDS,
        Unit::Seconds,
        "One write batch, from handed to the transport to reported done."
    );
    describe_histogram!(
        EXPOSED_TAIL_SECONDS,
        Unit::Seconds,
        "Last chunk computed to receiver complete, by view (both sides, sender, receiver)."
    );
    describe_histogram!(
        TRANSFER_SECONDS,
        Unit::Seconds,
        "First byte to last byte of a request, by view (both sides, sender, receiver)."
    );
}
