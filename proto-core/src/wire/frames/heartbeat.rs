//! `Heartbeat` (`0x14`, 8 bytes): the liveness probe either side sends when idle.
//!
//! ```text
//! seq u64
//! ```

use core::fmt;

use zerocopy::little_endian::U64;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::FrameKind;

/// Liveness probe; either side sends it when idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Heartbeat {
    /// Sequence number, echoed by nothing; lets captures show gaps.
    pub seq: u64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct HeartbeatWire {
    seq: U64,
}

impl FrameBody for Heartbeat {
    const KIND: FrameKind = FrameKind::Heartbeat;
    const MAX_BODY_LEN: u32 = fixed_len::<HeartbeatWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<HeartbeatWire>("seq")?;
        Ok(Heartbeat { seq: w.seq.get() })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.put(
            HeartbeatWire {
                seq: U64::new(self.seq),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for Heartbeat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Heartbeat seq {}", self.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::roundtrip;

    #[test]
    fn layout_is_the_sequence_number_little_endian() {
        let beat = Heartbeat {
            seq: 0x0102_0304_0506_0708,
        };
        assert_eq!(roundtrip(&beat), [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(beat.to_string(), "Heartbeat seq 72623859790382856");
    }
}
