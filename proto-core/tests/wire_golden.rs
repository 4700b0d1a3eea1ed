//! Golden encodings of every frame kind and every status/reason value.
//!
//! These snapshots are the wire format. A diff here is a compatibility decision (a new
//! protocol version, or a break), never a routine snapshot update. The handshake frames
//! (`hello*`) are frozen for every version.

mod wire_support;

use kvpipe_core::wire::samples::{golden_frames, sample_groups};
use kvpipe_core::wire::*;
use wire_support::golden_dump;

#[test]
fn golden_encodings() {
    let frames = golden_frames();
    for (name, frame) in &frames {
        let bytes = frame.to_vec().unwrap();
        assert_eq!(bytes.len(), frame.encoded_len(), "{name}");
        insta::assert_snapshot!(name.as_str(), golden_dump(frame, &bytes));
    }
}

#[test]
fn golden_set_covers_every_kind_and_value() {
    let frames = golden_frames();
    for kind in FrameKind::ALL {
        assert!(
            frames.iter().any(|(_, f)| f.kind() == kind),
            "no golden {kind} frame"
        );
    }
    for &status in TransferStatus::ALL {
        assert!(
            frames
                .iter()
                .any(|(_, f)| matches!(f, Frame::KvResult(k) if k.status == status)),
            "no golden KvResult with status {status}"
        );
    }
    for &reason in RejectReason::ALL {
        assert!(frames
            .iter()
            .any(|(_, f)| matches!(f, Frame::HelloReject(r) if r.reason == reason)));
    }
    for &reason in CancelReason::ALL {
        assert!(frames
            .iter()
            .any(|(_, f)| matches!(f, Frame::Cancel(c) if c.reason == reason)));
    }
    let mut names: Vec<_> = frames.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), frames.len(), "golden names must be unique");
}

#[test]
fn golden_frames_round_trip_byte_for_byte() {
    for (name, frame) in golden_frames() {
        let bytes = frame.to_vec().unwrap();
        let (parsed, used) = Frame::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(used, bytes.len(), "{name}");
        assert_eq!(parsed, frame, "{name}");
        assert_eq!(parsed.to_vec().unwrap(), bytes, "{name}");
    }
}

/// The codes are part of the wire format too.
#[test]
fn golden_codes() {
    let mut out = String::new();
    for kind in FrameKind::ALL {
        out += &format!(
            "kind 0x{:02x} {kind} handshake={} max_body={}\n",
            kind.code(),
            kind.is_handshake(),
            kind.max_body_len()
        );
    }
    for r in Role::ALL {
        out += &format!("role {} {r}\n", r.code());
    }
    for r in RejectReason::ALL {
        out += &format!("reject {} {r}\n", r.code());
    }
    for s in TransferStatus::ALL {
        out += &format!("status {} {s}\n", s.code());
    }
    for r in CancelReason::ALL {
        out += &format!("cancel {} {r}\n", r.code());
    }
    out += &format!("magic {MAGIC:02x?} header_len {HEADER_LEN} max_body {MAX_BODY_LEN}\n");
    insta::assert_snapshot!("codes", out);
}

/// The compatibility hash of the sample layout: changing the hash rule is a compatibility
/// decision like changing an encoding.
#[test]
fn golden_compat_hash() {
    insta::assert_snapshot!(
        "compat_hash",
        format!(
            "sample layout: 0x{:016x}\nno groups: 0x{:016x}",
            compat_hash(&sample_groups()),
            compat_hash(&[])
        )
    );
}
