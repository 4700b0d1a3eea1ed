//! The checks behind kvpipe's fuzz targets. Each target in `fuzz_targets/` is a thin wrapper
//! around a function here, so the same checks run as ordinary tests over the committed seed
//! corpus (`fuzz/seeds/`) on stable Rust.

use kvpipe_core::wire::{DecodeError, Frame, FrameHeader, HEADER_LEN, PROTOCOL_VERSION};

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
