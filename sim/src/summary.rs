//! One readable line per frame, event and endpoint, for the trace.

use kvpipe_core::session::Event;
use kvpipe_core::wire::Frame;

/// How the trace names sender rank `from` (`None`: the receiver).
pub(crate) fn who(from: Option<usize>) -> String {
    match from {
        Some(r) => format!("S{r}"),
        None => "R".to_string(),
    }
}

/// One line about a frame (no grants or hashes: they are seeded values).
pub fn frame_summary(frame: &Frame) -> String {
    match frame {
        Frame::Hello(h) => format!("Hello {:?} inst#{}", h.role, h.instance.0),
        Frame::HelloAccept(a) => format!("HelloAccept v{}", a.version),
        Frame::HelloReject(r) => format!("HelloReject {:?}", r.reason),
        Frame::RecvRegistration(r) => format!(
            "RecvRegistration {} {} prompt={} groups={}",
            r.request,
            r.slice,
            r.prompt_len,
            r.groups
                .iter()
                .map(|g| format!("{}+{}", g.first_ordinal, g.block_count()))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Frame::KvResult(r) => format!(
            "KvResult {} {} {}{} {:?} {}B",
            r.request,
            r.sender_slice,
            r.receiver_slice,
            if r.is_last { " last" } else { "" },
            r.status,
            r.bytes_written
        ),
        Frame::AuxResult(a) => format!("AuxResult {} {:?}", a.request, a.status),
        Frame::Cancel(c) => format!("Cancel {} {:?}", c.request, c.reason),
        Frame::Heartbeat(h) => format!("Heartbeat {}", h.seq),
        Frame::DataWrite(d) => format!("DataWrite {} {}B", d.request, d.len),
        Frame::RecvComplete(c) => format!("RecvComplete {}", c.request),
    }
}

/// One line about an event.
pub fn event_summary(event: &Event) -> String {
    match event {
        Event::PeerReady { peer, role, .. } => format!("PeerReady {peer} {role:?}"),
        Event::PeerRejected { peer, reason, .. } => format!("PeerRejected {peer} {reason:?}"),
        Event::PeerLost { peer, reason } => format!("PeerLost {peer} {reason:?}"),
        Event::ProtocolViolation { peer, error } => format!("ProtocolViolation {peer}: {error}"),
        Event::Registered {
            request,
            peer,
            receiver_slice,
        } => format!("Registered {request} {peer} {receiver_slice}"),
        Event::Completed {
            request,
            bytes_written,
            aux,
            ..
        } => format!(
            "Completed {request} {bytes_written}B{}",
            if aux.is_some() { " +aux" } else { "" }
        ),
        Event::Failed {
            request,
            cause,
            peer,
            sender_slice,
            receiver_slice,
        } => format!(
            "Failed {request} {cause:?} peer={} sslice={} rslice={}",
            peer.map_or("-".into(), |p| p.to_string()),
            sender_slice.map_or("-".into(), |s| s.0.to_string()),
            receiver_slice.map_or("-".into(), |s| s.0.to_string()),
        ),
        Event::TimedOut {
            request,
            waiting_for,
        } => format!("TimedOut {request} {waiting_for:?}"),
        Event::Cancelled { request, origin } => format!("Cancelled {request} {origin:?}"),
        Event::Quiesced { request } => format!("Quiesced {request}"),
    }
}
