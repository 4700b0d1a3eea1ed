//! `DataWrite` (`0x15`, 36 bytes + payload): the header of one data write on a stream
//! transport. Its `len` payload bytes follow the frame and are not part of the body.
//!
//! ```text
//! request u64 | grant u64 | offset u64 | len u64 | region u32
//! ```

use core::fmt;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ids::{GrantId, RegionId, RequestId};
use crate::wire::body::{fixed_len, BodyReader, BodyWriter, FrameBody};
use crate::wire::error::{DecodeError, EncodeError};
use crate::wire::header::{FrameKind, HEADER_LEN};

/// Header of one data write on a stream transport; `len` payload bytes follow the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct DataWrite {
    /// The request the bytes belong to.
    pub request: RequestId,
    /// The grant from the request's registration.
    pub grant: GrantId,
    /// Destination region on the receiver.
    pub region: RegionId,
    /// Destination offset inside the region.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct DataWriteWire {
    request: U64,
    grant: U64,
    offset: U64,
    len: U64,
    region: U32,
}

/// Encoded length of a [`DataWrite`] frame, header and body (the payload follows it).
pub const DATA_WRITE_FRAME_LEN: usize = HEADER_LEN + fixed_len::<DataWriteWire>() as usize;

impl DataWrite {
    /// Decodes the body of a `DataWrite` frame whose header was already read and checked (a
    /// stream reader's: it needs the header first to know the body's length); bytes left after
    /// it are refused, as [`Frame::parse`](crate::wire::Frame::parse) does.
    pub(crate) fn parse_checked_body(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = BodyReader::new(FrameKind::DataWrite, body);
        let write = Self::parse_body(&mut r)?;
        r.finish()?;
        Ok(write)
    }
}

impl FrameBody for DataWrite {
    const KIND: FrameKind = FrameKind::DataWrite;
    const MAX_BODY_LEN: u32 = fixed_len::<DataWriteWire>();

    fn body_len(&self) -> usize {
        Self::MAX_BODY_LEN as usize
    }

    fn parse_body(r: &mut BodyReader<'_>) -> Result<Self, DecodeError> {
        let w = r.fixed::<DataWriteWire>("request")?;
        Ok(DataWrite {
            request: RequestId(w.request.get()),
            grant: GrantId(w.grant.get()),
            region: RegionId(w.region.get()),
            offset: w.offset.get(),
            len: w.len.get(),
        })
    }

    fn emit_body(&self, w: &mut BodyWriter<'_>) -> Result<(), EncodeError> {
        w.put(
            DataWriteWire {
                request: U64::new(self.request.0),
                grant: U64::new(self.grant.0),
                offset: U64::new(self.offset),
                len: U64::new(self.len),
                region: U32::new(self.region.0),
            }
            .as_bytes(),
        )
    }
}

impl fmt::Display for DataWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DataWrite {} {} {} offset {} len {} B",
            self.request, self.grant, self.region, self.offset, self.len
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body::testing::roundtrip;

    #[test]
    fn layout_puts_the_region_last() {
        let write = DataWrite {
            request: RequestId(1),
            grant: GrantId(2),
            region: RegionId(5),
            offset: 3,
            len: 4,
        };
        let body = roundtrip(&write);
        assert_eq!(body.len(), 36);
        assert_eq!(DATA_WRITE_FRAME_LEN, 48);
        for (i, field) in [1u64, 2, 3, 4].into_iter().enumerate() {
            assert_eq!(&body[8 * i..8 * i + 8], &field.to_le_bytes());
        }
        assert_eq!(&body[32..], &5u32.to_le_bytes());
    }
}
