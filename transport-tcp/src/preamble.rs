//! The 16-byte preamble every TCP connection starts with, before any frame: it tells the
//! accepting node which peer's bundle the connection belongs to (the token), and whether it is
//! the control connection (index 0) or an extra data connection. The accepting node reads
//! preambles concurrently, so a bundle's connections may arrive in any order. It is transport framing, not a protocol frame; the
//! handshake (`Hello`) follows on the control connection.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"KVPT"` |
//! | 4 | 1 | preamble version (1) |
//! | 5 | 1 | connection index (0: control) |
//! | 6 | 1 | connections in the bundle |
//! | 7 | 1 | flags: reserved, 0 (bit 0 once asked for a peer-copy exchange before the `Hello`; peer copies are now negotiated inside the handshake, and a preamble with it set is refused) |
//! | 8 | 8 | bundle token (u64 LE), the same on every connection of one peer |

/// Length of the preamble.
pub const PREAMBLE_LEN: usize = 16;
/// The preamble's magic.
pub const PREAMBLE_MAGIC: [u8; 4] = *b"KVPT";
const PREAMBLE_VERSION: u8 = 1;

/// A decoded preamble.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    /// Index of this connection in its bundle (0: control).
    pub index: u8,
    /// Connections in the bundle.
    pub count: u8,
    /// The bundle's token.
    pub token: u64,
    /// Flags: reserved, always 0.
    pub flags: u8,
}

/// A preamble that cannot be accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PreambleError {
    /// Not a kvpipe TCP connection.
    #[error("bad preamble magic {0:02x?}: not a kvpipe TCP connection")]
    BadMagic([u8; 4]),
    /// Another preamble version.
    #[error("preamble version {0}, this build speaks 1")]
    Version(u8),
    /// Index out of the bundle, empty bundle or a flag set.
    #[error("invalid preamble fields (index {index}, count {count}, flags {reserved:#04x})")]
    Invalid {
        /// Index found.
        index: u8,
        /// Count found.
        count: u8,
        /// Flags byte found.
        reserved: u8,
    },
}

impl Preamble {
    /// The encoded preamble.
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut out = [0; PREAMBLE_LEN];
        out[..4].copy_from_slice(&PREAMBLE_MAGIC);
        out[4] = PREAMBLE_VERSION;
        out[5] = self.index;
        out[6] = self.count;
        out[7] = self.flags;
        out[8..].copy_from_slice(&self.token.to_le_bytes());
        out
    }

    /// Decodes and validates a preamble.
    pub fn decode(buf: &[u8; PREAMBLE_LEN]) -> Result<Preamble, PreambleError> {
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != PREAMBLE_MAGIC {
            return Err(PreambleError::BadMagic(magic));
        }
        if buf[4] != PREAMBLE_VERSION {
            return Err(PreambleError::Version(buf[4]));
        }
        let (index, count, reserved) = (buf[5], buf[6], buf[7]);
        if count == 0 || index >= count || reserved != 0 {
            return Err(PreambleError::Invalid {
                index,
                count,
                reserved,
            });
        }
        let mut token = [0; 8];
        token.copy_from_slice(&buf[8..]);
        Ok(Preamble {
            index,
            count,
            token: u64::from_le_bytes(token),
            flags: reserved,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects() {
        let p = Preamble {
            index: 2,
            count: 4,
            token: 0x0102_0304_0506_0708,
            flags: 0,
        };
        // Every flag is refused, bit 0 too (the peer-copy exchange before the Hello that
        // older builds asked for with it).
        for flag in [1, 2] {
            let mut bad = p.encode();
            bad[7] = flag;
            assert!(matches!(
                Preamble::decode(&bad),
                Err(PreambleError::Invalid { reserved, .. }) if reserved == flag
            ));
        }
        assert_eq!(Preamble::decode(&p.encode()), Ok(p));
        let mut bad = p.encode();
        bad[0] = b'X';
        assert!(matches!(
            Preamble::decode(&bad),
            Err(PreambleError::BadMagic(_))
        ));
        let mut bad = p.encode();
        bad[5] = 4;
        assert!(matches!(
            Preamble::decode(&bad),
            Err(PreambleError::Invalid { .. })
        ));
        let mut bad = p.encode();
        bad[4] = 9;
        assert_eq!(Preamble::decode(&bad), Err(PreambleError::Version(9)));
    }
}
