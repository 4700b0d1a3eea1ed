//! The out-of-band connection setup: what two nodes tell each other over a TCP socket before
//! their RC queue pairs can talk, and the exchange itself.
//!
//! Each side sends one [`ConnectInfo`] (its queue pair number, first packet sequence number,
//! GID, path MTU, control-channel geometry and the descriptors of the memory it exposes to
//! remote writes), reads the peer's, moves its queue pair to ready-to-send, then both sides
//! exchange one [`READY`] byte so that neither sends before the other's receive queue is
//! posted and ready. The socket then stays open as the link's liveness signal: a peer process
//! that dies closes it, and a side that tears its link down shuts it (see `link`).
//!
//! The encoding is little-endian, length-prefixed and versioned ([`BOOTSTRAP_MAGIC`],
//! [`BOOTSTRAP_VERSION`]); decoding checks every field and length and never panics.
//!
//! ```text
//! u32 len (of what follows)
//! "KVPV" u16 version u16 0
//! u16 lid u8 mtu u8 0 u32 qpn u32 psn [16] gid
//! u32 recv_depth u32 recv_buf_len u64 credit_addr u32 credit_rkey
//! u32 regions, then per region: u32 id u32 rkey u64 addr u64 len
//! ```

use std::io::{self, Read, Write};

use kvpipe_core::RegionId;
use thiserror::Error;

/// First bytes of a [`ConnectInfo`].
pub const BOOTSTRAP_MAGIC: [u8; 4] = *b"KVPV";
/// Version of the bootstrap encoding.
pub const BOOTSTRAP_VERSION: u16 = 1;
/// The byte each side sends once its queue pair is ready to receive and send.
pub const READY: u8 = 0xA5;
/// Most region descriptors one side may announce.
pub const MAX_REGIONS: usize = 4096;

const FIXED_LEN: usize = 4 + 2 + 2 + 2 + 1 + 1 + 4 + 4 + 16 + 4 + 4 + 8 + 4 + 4;
const REGION_LEN: usize = 4 + 4 + 8 + 8;

/// One memory region a node exposes to its peer's RDMA WRITEs: the region id the core plans
/// with, and where the bytes are on the node (virtual address, length, remote key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionDescriptor {
    /// The core's id of the region (a KV pool).
    pub region: RegionId,
    /// Remote key of the region's memory registration.
    pub rkey: u32,
    /// Address of the region's first byte on the exposing node.
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
}

/// What one side of a link tells the other before the queue pairs connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectInfo {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// Active path MTU of the port, as the verbs enum (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number the side sends with (24 bits).
    pub psn: u32,
    /// The port's GID the side sends from.
    pub gid: [u8; 16],
    /// Receive buffers the side keeps posted for control messages (the peer's initial credit).
    pub recv_depth: u32,
    /// Size of each of those buffers: the largest control message fragment it accepts.
    pub recv_buf_len: u32,
    /// Address of the side's credit word (the peer RDMA-writes its count of reposted
    /// receive buffers there).
    pub credit_addr: u64,
    /// Remote key of the credit word.
    pub credit_rkey: u32,
    /// The memory regions the side exposes to the peer's RDMA WRITEs.
    pub regions: Vec<RegionDescriptor>,
}

/// A bootstrap message that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BootstrapError {
    /// The peer does not speak this bootstrap (another program or another version).
    #[error("bootstrap from the peer starts with {magic:02x?} version {version}, expected \"KVPV\" version {BOOTSTRAP_VERSION}")]
    Incompatible {
        /// The magic bytes received.
        magic: [u8; 4],
        /// The version received.
        version: u16,
    },
    /// The message is shorter or longer than its fields say.
    #[error("bootstrap message of {got} bytes, its fields need {expected}")]
    Length {
        /// Bytes the fields need.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// A field holds a value no valid peer sends.
    #[error("bootstrap field {field} is invalid: {value}")]
    Field {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

impl ConnectInfo {
    /// Encoded length, without the length prefix.
    pub fn encoded_len(&self) -> usize {
        FIXED_LEN + REGION_LEN * self.regions.len()
    }

    /// Encodes the message with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.encoded_len());
        out.extend_from_slice(&(self.encoded_len() as u32).to_le_bytes());
        out.extend_from_slice(&BOOTSTRAP_MAGIC);
        out.extend_from_slice(&BOOTSTRAP_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.push(self.mtu);
        out.push(0);
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.recv_depth.to_le_bytes());
        out.extend_from_slice(&self.recv_buf_len.to_le_bytes());
        out.extend_from_slice(&self.credit_addr.to_le_bytes());
        out.extend_from_slice(&self.credit_rkey.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.region.0.to_le_bytes());
            out.extend_from_slice(&r.rkey.to_le_bytes());
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
        out
    }

    /// Decodes a message (without its length prefix), checking every field.
    pub fn decode(buf: &[u8]) -> Result<ConnectInfo, BootstrapError> {
        if buf.len() < 8 {
            return Err(BootstrapError::Length {
                expected: FIXED_LEN,
                got: buf.len(),
            });
        }
        let mut r = Reader { buf, at: 0 };
        let magic: [u8; 4] = r.array();
        let version = r.u16();
        if magic != BOOTSTRAP_MAGIC || version != BOOTSTRAP_VERSION {
            return Err(BootstrapError::Incompatible { magic, version });
        }
        if buf.len() < FIXED_LEN {
            return Err(BootstrapError::Length {
                expected: FIXED_LEN,
                got: buf.len(),
            });
        }
        let _ = r.u16();
        let lid = r.u16();
        let mtu = r.array::<1>()[0];
        let _ = r.array::<1>();
        let qpn = r.u32();
        let psn = r.u32();
        let gid: [u8; 16] = r.array();
        let recv_depth = r.u32();
        let recv_buf_len = r.u32();
        let credit_addr = r.u64();
        let credit_rkey = r.u32();
        let count = r.u32() as usize;
        let field = |field, value: u64| Err(BootstrapError::Field { field, value });
        if !(1..=5).contains(&mtu) {
            return field("mtu", mtu.into());
        }
        if qpn > 0xFF_FFFF {
            return field("qpn", qpn.into());
        }
        if psn > 0xFF_FFFF {
            return field("psn", psn.into());
        }
        if !(1..=65536).contains(&recv_depth) {
            return field("recv_depth", recv_depth.into());
        }
        if !(64..=1 << 20).contains(&recv_buf_len) {
            return field("recv_buf_len", recv_buf_len.into());
        }
        if count > MAX_REGIONS {
            return field("regions", count as u64);
        }
        let expected = FIXED_LEN + REGION_LEN * count;
        if buf.len() != expected {
            return Err(BootstrapError::Length {
                expected,
                got: buf.len(),
            });
        }
        let mut regions: Vec<RegionDescriptor> = Vec::with_capacity(count);
        for _ in 0..count {
            let d = RegionDescriptor {
                region: RegionId(r.u32()),
                rkey: r.u32(),
                addr: r.u64(),
                len: r.u64(),
            };
            if d.addr.checked_add(d.len).is_none() {
                return field("region end", d.addr);
            }
            if regions.iter().any(|o| o.region == d.region) {
                return field("duplicate region", d.region.0.into());
            }
            regions.push(d);
        }
        Ok(ConnectInfo {
            lid,
            mtu,
            qpn,
            psn,
            gid,
            recv_depth,
            recv_buf_len,
            credit_addr,
            credit_rkey,
            regions,
        })
    }
}

/// Reads fixed-size fields; the caller has checked the length.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.at..self.at + N]);
        self.at += N;
        out
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// Sends `local` and reads the peer's [`ConnectInfo`] (the socket's timeouts bound the wait).
pub fn exchange(stream: &mut (impl Read + Write), local: &ConnectInfo) -> io::Result<ConnectInfo> {
    stream.write_all(&local.encode())?;
    stream.flush()?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > FIXED_LEN + REGION_LEN * MAX_REGIONS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bootstrap message of {len} bytes is longer than any valid one"),
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    ConnectInfo::decode(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Sends [`READY`] and waits for the peer's.
pub fn ready(stream: &mut (impl Read + Write)) -> io::Result<()> {
    stream.write_all(&[READY])?;
    stream.flush()?;
    let mut b = [0u8; 1];
    stream.read_exact(&mut b)?;
    if b[0] != READY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected the ready byte {READY:#04x}, got {:#04x}", b[0]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnectInfo {
        ConnectInfo {
            lid: 0,
            mtu: 3,
            qpn: 0x11,
            psn: 0xABCDE,
            gid: [7; 16],
            recv_depth: 64,
            recv_buf_len: 4096,
            credit_addr: 0x1000,
            credit_rkey: 9,
            regions: vec![
                RegionDescriptor {
                    region: RegionId(1),
                    rkey: 5,
                    addr: 0x7000_0000,
                    len: 1 << 20,
                },
                RegionDescriptor {
                    region: RegionId(2),
                    rkey: 6,
                    addr: 0x9000_0000,
                    len: 4096,
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let info = sample();
        let bytes = info.encode();
        assert_eq!(bytes.len(), 4 + info.encoded_len());
        assert_eq!(ConnectInfo::decode(&bytes[4..]), Ok(info));
    }

    /// Reads what the peer "sent", records what we write.
    struct Duplex {
        rx: std::io::Cursor<Vec<u8>>,
        tx: Vec<u8>,
    }
    impl Read for Duplex {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.rx.read(buf)
        }
    }
    impl Write for Duplex {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.tx.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn exchange_sends_ours_and_reads_theirs() {
        let ours = sample();
        let mut theirs = sample();
        theirs.qpn = 0x22;
        let mut peer_bytes = theirs.encode();
        peer_bytes.push(READY);
        let mut wire = Duplex {
            rx: std::io::Cursor::new(peer_bytes),
            tx: Vec::new(),
        };
        assert_eq!(exchange(&mut wire, &ours).expect("decodes"), theirs);
        ready(&mut wire).expect("ready byte");
        let mut sent = ours.encode();
        sent.push(READY);
        assert_eq!(wire.tx, sent);
        // A lying length prefix is refused before anything is allocated.
        let mut wire = Duplex {
            rx: std::io::Cursor::new(u32::MAX.to_le_bytes().to_vec()),
            tx: Vec::new(),
        };
        assert_eq!(
            exchange(&mut wire, &ours).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn refuses_other_programs_and_versions() {
        let mut bytes = sample().encode();
        bytes[4] = b'X';
        assert!(matches!(
            ConnectInfo::decode(&bytes[4..]),
            Err(BootstrapError::Incompatible { .. })
        ));
        let mut bytes = sample().encode();
        bytes[8] = 2;
        let err = ConnectInfo::decode(&bytes[4..]).unwrap_err();
        assert!(err.to_string().contains("version 2"), "{err}");
    }

    #[test]
    fn refuses_bad_fields_and_lengths() {
        let base = sample();
        let mut bad = base.clone();
        bad.mtu = 9;
        assert!(matches!(
            ConnectInfo::decode(&bad.encode()[4..]),
            Err(BootstrapError::Field { field: "mtu", .. })
        ));
        let mut bad = base.clone();
        bad.regions[1].region = RegionId(1);
        assert!(matches!(
            ConnectInfo::decode(&bad.encode()[4..]),
            Err(BootstrapError::Field {
                field: "duplicate region",
                ..
            })
        ));
        let mut bad = base.clone();
        bad.regions[0].addr = u64::MAX;
        assert!(ConnectInfo::decode(&bad.encode()[4..]).is_err());
        let bytes = base.encode();
        assert!(matches!(
            ConnectInfo::decode(&bytes[4..bytes.len() - 1]),
            Err(BootstrapError::Length { .. })
        ));
    }

    #[test]
    fn never_panics_on_truncations_or_flipped_bytes() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            let _ = ConnectInfo::decode(&bytes[4..cut.max(4)]);
        }
        for i in 4..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                let _ = ConnectInfo::decode(&b[4..]);
            }
        }
    }
}
