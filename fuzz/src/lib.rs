//! The checks behind kvpipe's fuzz targets. Each target in `fuzz_targets/` is a thin wrapper
//! around a function here, so the same checks run as ordinary tests over the committed seed
//! corpus (`fuzz/seeds/`) on stable Rust.

pub mod session;

use kvpipe_core::wire::{
    DecodeError, EncodeError, Frame, FrameHeader, HEADER_LEN, PROTOCOL_VERSION,
};

/// The `decode` target: decoding arbitrary bytes never panics, and whatever decodes
/// re-encodes to the very bytes it came from (same frame, same length, same bytes).
///
/// Panics (the fuzzer's failure signal) when a property does not hold.
pub fn check_decode(data: &[u8]) {
    match Frame::parse(data) {
        Ok((frame, used)) => {
            assert!(
                (HEADER_LEN..=data.len()).contains(&used),
                "consumed {used} of {}",
                data.len()
            );
            let header = FrameHeader::view(data).expect("a decoded frame has a header");
            let version = header.version.get();
            assert_eq!(
                frame.encoded_len(),
                used,
                "encoded_len disagrees with parse"
            );

            let mut out = vec![0u8; used];
            let written = frame
                .emit_versioned(version, &mut out)
                .unwrap_or_else(|e| panic!("decoded frame {frame} does not re-encode: {e}"));
            assert_eq!(written, used);
            assert_eq!(out, &data[..used], "re-encoding {frame} changed its bytes");

            let (again, used_again) = Frame::parse(&out).expect("re-encoded frame decodes");
            assert_eq!(again, frame);
            assert_eq!(used_again, used);

            // A frame at the build's version parses the same way on a negotiated connection.
            if version == PROTOCOL_VERSION {
                assert_eq!(
                    Frame::parse_negotiated(data, PROTOCOL_VERSION),
                    Ok((frame.clone(), used))
                );
            }
            let _ = frame.to_string();
        }
        Err(error) => {
            if let DecodeError::Truncated { needed, have } = error {
                assert_eq!(have, data.len());
                assert!(needed > have, "truncated but needs {needed} of {have}");
            }
            let _ = error.to_string();
        }
    }
}

/// The `encode` target: for any frame value (valid or not) built from the fuzzer's bytes, the
/// encoder either refuses it with a typed error or emits bytes that decode back to the same
/// frame; it never emits what a peer would refuse, and never panics.
pub fn check_encode(data: &[u8]) {
    let mut input = arbitrary::Unstructured::new(data);
    let Ok(frame) = <Frame as arbitrary::Arbitrary>::arbitrary(&mut input) else {
        return;
    };
    let len = frame.encoded_len();
    // A buffer one byte short is refused with the size needed (or an earlier typed error).
    if len > 0 {
        let mut short = vec![0u8; len - 1];
        match frame.emit(&mut short) {
            Err(EncodeError::BufferTooSmall { needed, have }) => {
                assert_eq!((needed, have), (len, len - 1));
            }
            Err(EncodeError::BodyTooLong { .. }) => {}
            other => panic!("emit into {} of {len} bytes gave {other:?}", len - 1),
        }
    }
    let mut out = vec![0u8; len];
    match frame.emit(&mut out) {
        Ok(written) => {
            assert_eq!(written, len, "emit wrote other than encoded_len");
            assert_eq!(Frame::parse(&out), Ok((frame.clone(), len)), "{frame}");
            let _ = frame.to_string();
        }
        Err(EncodeError::Invalid { .. } | EncodeError::BodyTooLong { .. }) => {}
        Err(other) => panic!("unexpected encode error for {frame:?}: {other}"),
    }
}
