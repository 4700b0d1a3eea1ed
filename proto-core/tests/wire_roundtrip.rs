//! Property tests: every valid frame encodes to `encoded_len` bytes and decodes back to
//! itself, at every version a frame may carry.

mod wire_support;

use bytes::BytesMut;
use kvpipe_core::wire::*;
use kvpipe_core::{AnchoredRun, BlockId, GrantId, IdRun, ReceiverSliceId, RequestId};
use proptest::prelude::*;
use wire_support::{arb_frame, arb_hello};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn emit_then_parse_is_identity(frame in arb_frame()) {
        let len = frame.encoded_len();
        let mut buf = vec![0xa5u8; len + 7];
        let written = frame.emit(&mut buf).unwrap();
        prop_assert_eq!(written, len);
        let (parsed, used) = Frame::parse(&buf).unwrap();
        prop_assert_eq!(used, len);
        prop_assert_eq!(&parsed, &frame);
        prop_assert_eq!(parsed.to_vec().unwrap(), &buf[..len]);
        // The header announces exactly the body.
        let header = FrameHeader::view(&buf).unwrap();
        prop_assert_eq!(header.frame_len(), len);
        prop_assert_eq!(Frame::peek_header(&buf).unwrap(), (frame.kind(), PROTOCOL_VERSION, len));
    }

    #[test]
    fn a_buffer_one_byte_short_reports_the_size_needed(frame in arb_frame()) {
        let len = frame.encoded_len();
        let mut buf = vec![0u8; len - 1];
        prop_assert_eq!(
            frame.emit(&mut buf),
            Err(EncodeError::BufferTooSmall { needed: len, have: len - 1 })
        );
    }

    #[test]
    fn encode_to_appends_and_frames_concatenate(a in arb_frame(), b in arb_frame()) {
        let mut out = BytesMut::from(&b"prefix"[..]);
        let n = a.encode_to(PROTOCOL_VERSION, &mut out).unwrap();
        let m = b.encode_to(PROTOCOL_VERSION, &mut out).unwrap();
        prop_assert_eq!(out.len(), 6 + n + m);
        let (first, used) = Frame::parse(&out[6..]).unwrap();
        prop_assert_eq!(used, n);
        prop_assert_eq!(first, a);
        let (second, used) = Frame::parse_negotiated(&out[6 + n..], PROTOCOL_VERSION).unwrap();
        prop_assert_eq!(used, m);
        prop_assert_eq!(second, b);
    }

    /// Handshake frames are frozen: they decode at any version and re-encode identically.
    #[test]
    fn handshake_frames_decode_at_every_version(frame in arb_frame(), version in 1u16..) {
        let len = frame.encoded_len();
        let mut buf = vec![0u8; len];
        if frame.kind().is_handshake() {
            frame.emit_versioned(version, &mut buf).unwrap();
            let (parsed, _) = Frame::parse(&buf).unwrap();
            prop_assert_eq!(&parsed, &frame);
            let mut again = vec![0u8; len];
            parsed.emit_versioned(version, &mut again).unwrap();
            prop_assert_eq!(again, buf);
        } else if !VersionRange::SUPPORTED.contains(version) {
            prop_assert_eq!(
                frame.emit_versioned(version, &mut buf),
                Err(EncodeError::UnsupportedVersion {
                    kind: frame.kind(),
                    version,
                    supported: VersionRange::SUPPORTED,
                })
            );
        }
    }

    /// Display never panics and starts with the kind's name.
    #[test]
    fn display_names_the_kind(frame in arb_frame()) {
        let text = frame.to_string();
        prop_assert!(text.starts_with(frame.kind().name()), "{}", text);
    }

    /// Frames built without the canonical rules (empty or unmergeable runs, zero windows,
    /// inverted ranges) are either refused by the encoder with a typed error or round-trip:
    /// the encoder never emits bytes the decoder refuses.
    #[test]
    fn the_encoder_only_emits_what_the_decoder_accepts(
        frame in prop_oneof![
            (arb_hello(), any::<u16>(), any::<u16>(), prop::option::of(0u32..3)).prop_map(
                |(mut h, min, max, window)| {
                    h.versions = VersionRange { min, max };
                    if let Some(g) = h.groups.first_mut() {
                        g.window = window;
                    }
                    Frame::Hello(h)
                }
            ),
            (any::<u32>(), prop::collection::vec((0u32..8, 0u32..3), 0..6)).prop_map(
                |(first_ordinal, runs)| {
                    Frame::RecvRegistration(RecvRegistration {
                        request: RequestId(1),
                        slice: ReceiverSliceId(2),
                        prompt_len: 3,
                        grant: GrantId(4),
                        aux_capacity: 5,
                        groups: vec![AnchoredRun {
                            first_ordinal,
                            runs: runs
                                .into_iter()
                                .map(|(first, len)| IdRun { first: BlockId(first), len })
                                .collect(),
                        }],
                    })
                }
            ),
            any::<u16>().prop_map(|version| Frame::HelloAccept(HelloAccept {
                version,
                instance: kvpipe_core::InstanceId(1),
                data_path_answer: None,
            })),
        ]
    ) {
        match frame.to_vec() {
            Ok(bytes) => {
                prop_assert_eq!(Frame::parse(&bytes), Ok((frame, bytes.len())));
            }
            Err(e) => prop_assert!(matches!(e, EncodeError::Invalid { .. }), "{:?}", e),
        }
    }
}
