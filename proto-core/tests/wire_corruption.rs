//! Corrupted, truncated and non-canonical input: every rejection is the right typed error and
//! nothing panics.

mod wire_support;

use kvpipe_core::wire::samples::{golden_frames, sample_hello};
use kvpipe_core::wire::*;
use kvpipe_core::{AnchoredRun, BlockId, IdRun};
use proptest::prelude::*;
use wire_support::arb_frame;

fn golden_bytes() -> Vec<(String, Vec<u8>)> {
    golden_frames()
        .into_iter()
        .map(|(name, frame)| (name, frame.to_vec().unwrap()))
        .collect()
}

fn encode(frame: &Frame) -> Vec<u8> {
    frame.to_vec().unwrap()
}

/// Rewrites the header's body length and appends/removes body bytes to match.
fn with_body_len(mut bytes: Vec<u8>, len: u32) -> Vec<u8> {
    bytes[8..12].copy_from_slice(&len.to_le_bytes());
    bytes.resize(HEADER_LEN + len as usize, 0);
    bytes
}

fn malformed(bytes: &[u8]) -> (FrameKind, &'static str, Malformation) {
    match Frame::parse(bytes) {
        Err(DecodeError::Malformed {
            kind,
            field,
            reason,
        }) => (kind, field, reason),
        other => panic!("expected a malformed body, got {other:?}"),
    }
}

fn registration(runs: Vec<IdRun>, first_ordinal: u32) -> Frame {
    Frame::RecvRegistration(RecvRegistration {
        request: kvpipe_core::RequestId(1),
        slice: kvpipe_core::ReceiverSliceId(2),
        prompt_len: 100,
        grant: kvpipe_core::GrantId(3),
        aux_capacity: 0,
        groups: vec![AnchoredRun {
            first_ordinal,
            runs: runs.into_iter().collect(),
        }],
    })
}

/// Encodes a registration with whatever runs it holds, bypassing the encoder's checks, by
/// patching a valid encoding with the same shape.
fn raw_registration(runs: &[(u32, u32)], first_ordinal: u32) -> Vec<u8> {
    let placeholder: Vec<IdRun> = (0..runs.len() as u32)
        .map(|i| IdRun {
            first: BlockId(i * 10),
            len: 1,
        })
        .collect();
    let mut bytes = encode(&registration(placeholder, first_ordinal));
    let base = HEADER_LEN + 30 + 8;
    for (i, (first, len)) in runs.iter().enumerate() {
        let at = base + 8 * i;
        bytes[at..at + 4].copy_from_slice(&first.to_le_bytes());
        bytes[at + 4..at + 8].copy_from_slice(&len.to_le_bytes());
    }
    bytes
}

#[test]
fn every_truncation_of_every_golden_frame_is_truncated() {
    for (name, bytes) in golden_bytes() {
        for cut in 0..bytes.len() {
            let needed = if cut < HEADER_LEN {
                HEADER_LEN
            } else {
                bytes.len()
            };
            assert_eq!(
                Frame::parse(&bytes[..cut]),
                Err(DecodeError::Truncated { needed, have: cut }),
                "{name} cut at {cut}"
            );
        }
    }
}

#[test]
fn flipped_magic_is_bad_magic() {
    for (name, bytes) in golden_bytes() {
        for i in 0..4 {
            let mut b = bytes.clone();
            b[i] ^= 0x20;
            let mut found = MAGIC;
            found[i] ^= 0x20;
            assert_eq!(
                Frame::parse(&b),
                Err(DecodeError::BadMagic { found }),
                "{name}"
            );
        }
    }
}

#[test]
fn session_frames_at_an_unsupported_version_name_both_versions() {
    for (name, bytes) in golden_bytes() {
        let kind = FrameKind::from_code(bytes[6]).unwrap();
        for version in [0u16, PROTOCOL_VERSION + 1, 0x0100, u16::MAX] {
            let mut b = bytes.clone();
            b[4..6].copy_from_slice(&version.to_le_bytes());
            let result = Frame::parse(&b);
            if kind.is_handshake() && version != 0 {
                let (frame, used) = result.unwrap_or_else(|e| panic!("{name} v{version}: {e}"));
                assert_eq!(used, b.len());
                let mut again = vec![0; used];
                frame.emit_versioned(version, &mut again).unwrap();
                assert_eq!(again, b, "{name}: frozen frames round-trip at any version");
            } else {
                let err = result.unwrap_err();
                assert_eq!(
                    err,
                    DecodeError::UnsupportedVersion {
                        version,
                        supported: VersionRange::SUPPORTED
                    },
                    "{name}"
                );
                let text = err.to_string();
                assert!(text.contains(&version.to_string()), "{text}");
                assert!(
                    text.contains(&VersionRange::SUPPORTED.to_string()),
                    "{text}"
                );
            }
        }
    }
}

#[test]
fn negotiated_parse_refuses_another_version() {
    let bytes = encode(&Frame::Heartbeat(Heartbeat { seq: 1 }));
    assert_eq!(
        Frame::parse_negotiated(&bytes, PROTOCOL_VERSION + 1),
        Err(DecodeError::VersionNotNegotiated {
            version: PROTOCOL_VERSION,
            negotiated: PROTOCOL_VERSION + 1
        })
    );
    // Handshake frames are not bound to the negotiated version.
    let hello = encode(&Frame::Hello(sample_hello(Role::Sender)));
    assert!(Frame::parse_negotiated(&hello, PROTOCOL_VERSION + 1).is_ok());
}

#[test]
fn unknown_kind_codes_are_typed_errors() {
    let bytes = encode(&Frame::Heartbeat(Heartbeat { seq: 1 }));
    for code in 0..=u8::MAX {
        if FrameKind::from_code(code).is_some() {
            continue;
        }
        let mut b = bytes.clone();
        b[6] = code;
        assert_eq!(Frame::parse(&b), Err(DecodeError::UnknownKind { code }));
        // At a version we do not speak, the version is the better explanation.
        b[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        assert!(matches!(
            Frame::parse(&b),
            Err(DecodeError::UnsupportedVersion { .. })
        ));
    }
}

#[test]
fn reserved_flags_are_rejected() {
    for (name, bytes) in golden_bytes() {
        let kind = FrameKind::from_code(bytes[6]).unwrap();
        for flags in [1u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[7] = flags;
            assert_eq!(
                Frame::parse(&b),
                Err(DecodeError::ReservedFlags { kind, flags }),
                "{name}"
            );
        }
    }
}

#[test]
fn body_lengths_over_the_cap_are_rejected_from_the_header_alone() {
    for (name, bytes) in golden_bytes() {
        let kind = FrameKind::from_code(bytes[6]).unwrap();
        let max = kind.max_body_len();
        for len in [max + 1, MAX_BODY_LEN + 1, u32::MAX] {
            let mut header = bytes[..HEADER_LEN].to_vec();
            header[8..12].copy_from_slice(&len.to_le_bytes());
            // Only the header is present: the cap is checked before waiting for the body.
            assert_eq!(
                Frame::parse(&header),
                Err(DecodeError::BodyTooLong { kind, len, max }),
                "{name}"
            );
        }
    }
}

#[test]
fn trailing_bytes_inside_a_variable_body_are_rejected() {
    // Bytes after a Hello's groups (or a HelloAccept's instance) start its optional data-path
    // section: three of them are a length cut short.
    for (name, field) in [
        ("hello", "data_path_offer"),
        ("hello_accept", "data_path_answer"),
    ] {
        let (_, frame) = golden_frames()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap();
        let bytes = encode(&frame);
        let body = (bytes.len() - HEADER_LEN) as u32;
        assert_eq!(
            malformed(&with_body_len(bytes, body + 3)),
            (
                frame.kind(),
                field,
                Malformation::Short { needed: 4, have: 3 }
            ),
            "{name}"
        );
    }
    for name in [
        "hello_data_path_offer",
        "hello_accept_data_path_answer",
        "hello_reject_role_mismatch",
        "recv_registration",
        "aux_result",
    ] {
        let (_, frame) = golden_frames()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap();
        let bytes = encode(&frame);
        let body = (bytes.len() - HEADER_LEN) as u32;
        let b = with_body_len(bytes, body + 3);
        assert_eq!(
            Frame::parse(&b),
            Err(DecodeError::TrailingBytes {
                kind: frame.kind(),
                extra: 3
            }),
            "{name}"
        );
    }
}

#[test]
fn fixed_bodies_cut_short_name_the_field() {
    let bytes = encode(&Frame::Heartbeat(Heartbeat { seq: 1 }));
    let b = with_body_len(bytes, 5);
    assert_eq!(
        malformed(&b),
        (
            FrameKind::Heartbeat,
            "seq",
            Malformation::Short { needed: 8, have: 5 }
        )
    );
}

#[test]
fn unknown_enum_codes_and_bad_booleans_are_rejected() {
    let kv = encode(&Frame::KvResult(KvResult {
        request: kvpipe_core::RequestId(1),
        sender_slice: kvpipe_core::SenderSliceId(2),
        receiver_slice: kvpipe_core::ReceiverSliceId(3),
        is_last: true,
        status: TransferStatus::Success,
        bytes_written: 9,
    }));
    let mut b = kv.clone();
    b[HEADER_LEN + 24] = 2;
    assert_eq!(
        malformed(&b),
        (
            FrameKind::KvResult,
            "is_last",
            Malformation::NotBool { value: 2 }
        )
    );
    let mut b = kv.clone();
    b[HEADER_LEN + 25] = 9;
    assert_eq!(
        malformed(&b),
        (
            FrameKind::KvResult,
            "status",
            Malformation::UnknownCode { code: 9 }
        )
    );

    let cancel = encode(&Frame::Cancel(Cancel {
        request: kvpipe_core::RequestId(1),
        reason: CancelReason::Engine,
    }));
    for code in [0u8, 5, 0xff] {
        let mut b = cancel.clone();
        b[HEADER_LEN + 8] = code;
        assert_eq!(
            malformed(&b),
            (
                FrameKind::Cancel,
                "reason",
                Malformation::UnknownCode { code }
            )
        );
    }

    let reject = encode(&Frame::HelloReject(HelloReject {
        reason: RejectReason::RoleMismatch,
        message: "x".into(),
    }));
    for code in [0u8, 6] {
        let mut b = reject.clone();
        b[HEADER_LEN] = code;
        assert_eq!(
            malformed(&b),
            (
                FrameKind::HelloReject,
                "reason",
                Malformation::UnknownCode { code }
            )
        );
    }
    let mut b = reject.clone();
    b[HEADER_LEN + 3] = 0xff;
    assert_eq!(
        malformed(&b),
        (FrameKind::HelloReject, "message", Malformation::InvalidUtf8)
    );

    let hello = encode(&Frame::Hello(sample_hello(Role::Sender)));
    for code in [0u8, 3] {
        let mut b = hello.clone();
        b[HEADER_LEN + 42] = code;
        assert_eq!(
            malformed(&b),
            (FrameKind::Hello, "role", Malformation::UnknownCode { code })
        );
    }
    let mut b = hello.clone();
    b[HEADER_LEN + 43 + 16] = 1; // first group's block layout
    assert_eq!(
        malformed(&b),
        (
            FrameKind::Hello,
            "groups[].block_layout",
            Malformation::UnknownCode { code: 1 }
        )
    );
}

#[test]
fn bad_version_fields_in_handshake_bodies_are_rejected() {
    let hello = encode(&Frame::Hello(sample_hello(Role::Sender)));
    let mut b = hello.clone();
    b[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&0u16.to_le_bytes());
    assert_eq!(
        malformed(&b),
        (FrameKind::Hello, "versions.min", Malformation::ZeroVersion)
    );
    let mut b = hello.clone();
    b[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&5u16.to_le_bytes());
    b[HEADER_LEN + 2..HEADER_LEN + 4].copy_from_slice(&4u16.to_le_bytes());
    assert_eq!(
        malformed(&b),
        (
            FrameKind::Hello,
            "versions",
            Malformation::InvertedRange { min: 5, max: 4 }
        )
    );
    let mut accept = encode(&Frame::HelloAccept(HelloAccept {
        version: 1,
        instance: kvpipe_core::InstanceId(1),
        data_path_answer: None,
    }));
    accept[HEADER_LEN] = 0;
    assert_eq!(
        malformed(&accept),
        (FrameKind::HelloAccept, "version", Malformation::ZeroVersion)
    );
}

#[test]
fn non_canonical_run_lists_are_rejected() {
    const F: &str = "groups[].runs[]";
    let k = FrameKind::RecvRegistration;
    assert!(Frame::parse(&raw_registration(&[(5, 2), (9, 1)], 0)).is_ok());
    assert_eq!(
        malformed(&raw_registration(&[(5, 0)], 0)),
        (k, F, Malformation::ZeroLengthRun)
    );
    assert_eq!(
        malformed(&raw_registration(&[(5, 2), (7, 1)], 0)),
        (k, F, Malformation::UnmergedRun)
    );
    assert_eq!(
        malformed(&raw_registration(&[(u32::MAX, 2)], 0)),
        (k, F, Malformation::BlockIdOverflow)
    );
    assert_eq!(
        malformed(&raw_registration(&[(0, 10)], u32::MAX - 5)),
        (k, F, Malformation::OrdinalOverflow)
    );
    // A run of u32::MAX blocks cannot grow, so the next one is not a continuation.
    assert!(Frame::parse(&raw_registration(&[(0, u32::MAX), (u32::MAX, 1)], 0)).is_ok());
}

#[test]
fn lying_counts_fail_before_allocating() {
    // A registration claiming u32::MAX runs in a tiny body.
    let mut b = raw_registration(&[(1, 1)], 0);
    let at = HEADER_LEN + 30 + 4;
    b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        malformed(&b),
        (
            FrameKind::RecvRegistration,
            "groups[].runs",
            Malformation::Short {
                needed: u32::MAX as usize * 8,
                have: 8
            }
        )
    );
    // A Hello claiming 65535 groups.
    let mut hello = encode(&Frame::Hello(sample_hello(Role::Sender)));
    hello[HEADER_LEN + 40..HEADER_LEN + 42].copy_from_slice(&u16::MAX.to_le_bytes());
    assert!(matches!(
        malformed(&hello),
        (FrameKind::Hello, "groups", Malformation::Short { .. })
    ));
    // Aux tokens.
    let mut aux = encode(&Frame::AuxResult(AuxResult {
        request: kvpipe_core::RequestId(1),
        status: TransferStatus::Success,
        data: AuxData::default(),
    }));
    aux[HEADER_LEN + 16..HEADER_LEN + 20].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        malformed(&aux),
        (
            FrameKind::AuxResult,
            "first_tokens",
            Malformation::Short { .. }
        )
    ));
}

#[test]
fn the_encoder_refuses_what_the_decoder_would_refuse() {
    let invalid = |frame: Frame, field: &'static str, reason: Malformation| {
        let kind = frame.kind();
        assert_eq!(
            frame.to_vec(),
            Err(EncodeError::Invalid {
                kind,
                field,
                reason
            })
        );
    };
    invalid(
        registration(
            vec![IdRun {
                first: BlockId(1),
                len: 0,
            }],
            0,
        ),
        "groups[].runs[]",
        Malformation::ZeroLengthRun,
    );
    invalid(
        registration(
            vec![
                IdRun {
                    first: BlockId(1),
                    len: 2,
                },
                IdRun {
                    first: BlockId(3),
                    len: 2,
                },
            ],
            0,
        ),
        "groups[].runs[]",
        Malformation::UnmergedRun,
    );
    let mut hello = sample_hello(Role::Sender);
    hello.groups[1].window = Some(0);
    invalid(
        Frame::Hello(hello),
        "groups[].window",
        Malformation::ZeroWindow,
    );
    let mut hello = sample_hello(Role::Sender);
    hello.versions = VersionRange { min: 3, max: 2 };
    invalid(
        Frame::Hello(hello),
        "versions",
        Malformation::InvertedRange { min: 3, max: 2 },
    );
    // A reject message over its limit is over the kind's body cap too.
    let reject = Frame::HelloReject(HelloReject {
        reason: RejectReason::LayoutMismatch,
        message: "x".repeat(MAX_REJECT_MESSAGE + 1),
    });
    assert_eq!(
        reject.to_vec(),
        Err(EncodeError::BodyTooLong {
            kind: FrameKind::HelloReject,
            len: 3 + MAX_REJECT_MESSAGE + 1,
            max: FrameKind::HelloReject.max_body_len(),
        })
    );
    let mut hello = sample_hello(Role::Sender);
    hello.groups = vec![Default::default(); 1 << 16];
    invalid(
        Frame::Hello(hello),
        "groups",
        Malformation::TooLong {
            len: 1 << 16,
            max: u16::MAX as usize,
        },
    );
    invalid(
        Frame::HelloAccept(HelloAccept {
            version: 0,
            instance: kvpipe_core::InstanceId(1),
            data_path_answer: None,
        }),
        "version",
        Malformation::ZeroVersion,
    );
}

#[test]
fn data_write_payload_is_not_part_of_the_frame() {
    let (_, frame) = golden_frames()
        .into_iter()
        .find(|(n, _)| n == "data_write")
        .unwrap();
    let mut bytes = encode(&frame);
    let frame_len = bytes.len();
    bytes.extend_from_slice(&[0xee; 100]);
    assert_eq!(Frame::parse(&bytes), Ok((frame, frame_len)));
}

fn check_never_panics(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok((frame, used)) = Frame::parse(bytes) {
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        let mut again = vec![0; frame.encoded_len()];
        let n = frame.emit_versioned(version, &mut again).unwrap();
        prop_assert_eq!(n, used);
        prop_assert_eq!(&again[..], &bytes[..used]);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_byte_flips_never_panic(
        frame in arb_frame(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = encode(&frame);
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        check_never_panics(&bytes)?;
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(
        kind in prop::sample::select(FrameKind::ALL.to_vec()),
        body in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = FrameHeader::new(kind, PROTOCOL_VERSION, body.len() as u32)
            .to_bytes()
            .to_vec();
        bytes.extend_from_slice(&body);
        check_never_panics(&bytes)?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        check_never_panics(&bytes)?;
    }
}
