//! Readable one-line renderings of frames (logs, traces, snapshot headers).

use core::fmt;

use super::frame::*;
use crate::blocks::AnchoredRun;
use crate::layout::{BlockLayout, LayerGroupLayout};

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "version {}", self.min)
        } else {
            write!(f, "versions {}..={}", self.min, self.max)
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        })
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::VersionMismatch => "version mismatch",
            RejectReason::CompatibilityMismatch => "compatibility mismatch",
            RejectReason::LayoutMismatch => "layout mismatch",
            RejectReason::TopologyMismatch => "topology mismatch",
            RejectReason::RoleMismatch => "role mismatch",
        })
    }
}

impl fmt::Display for TransferStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferStatus::Success => "success",
            TransferStatus::WriteFailed => "write failed",
            TransferStatus::InDoubt => "in doubt",
            TransferStatus::Cancelled => "cancelled",
            TransferStatus::TimedOut => "timed out",
            TransferStatus::GrantViolation => "grant violation",
            TransferStatus::PeerLost => "peer lost",
            TransferStatus::ProtocolError => "protocol error",
            TransferStatus::EngineError => "engine error",
        })
    }
}

impl fmt::Display for CancelReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CancelReason::Engine => "engine",
            CancelReason::Timeout => "timeout",
            CancelReason::Failure => "failure",
            CancelReason::Shutdown => "shutdown",
        })
    }
}

/// `32L 2x8h x128d 2B tpb32 full [region#1 L0+32 slot 2097152 B]`.
struct GroupDisplay<'a>(&'a LayerGroupLayout);

impl fmt::Display for GroupDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.0;
        write!(
            f,
            "{}L {}x{}h x{}d {}B tpb{} ",
            g.layers, g.kv_factor, g.kv_heads, g.head_dim, g.elem_bytes, g.tokens_per_block
        )?;
        match g.window {
            None => f.write_str("full")?,
            Some(w) => write!(f, "window {w}")?,
        }
        match g.block_layout {
            BlockLayout::LayerKvHeadTokenDim => {}
        }
        f.write_str(" [")?;
        for (i, p) in g.pools.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "{} L{}+{} slot {} B",
                p.region, p.layer_begin, p.layers, p.slot_bytes
            )?;
        }
        f.write_str("]")
    }
}

/// `@7: blk#100+4096 blk#9+1`.
struct RunDisplay<'a>(&'a AnchoredRun);

impl fmt::Display for RunDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}:", self.0.first_ordinal)?;
        if self.0.runs.is_empty() {
            return f.write_str(" none");
        }
        for r in &self.0.runs {
            write!(f, " {}+{}", r.first, r.len)?;
        }
        Ok(())
    }
}

impl fmt::Display for Hello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.topology;
        write!(
            f,
            "Hello {} {} {} caps 0x{:x} compat 0x{:016x} tp {}/{} pp {}/{} layers {}..{} groups [",
            self.role,
            self.versions,
            self.instance,
            self.capabilities.0,
            self.compat_hash,
            t.tp_rank,
            t.tp_size,
            t.pp_rank,
            t.pp_size,
            t.layer_begin,
            t.layer_end
        )?;
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}", GroupDisplay(g))?;
        }
        f.write_str("]")
    }
}

impl fmt::Display for HelloAccept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HelloAccept version {} {}", self.version, self.instance)
    }
}

impl fmt::Display for HelloReject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HelloReject ({}): {:?}", self.reason, self.message)
    }
}

impl fmt::Display for RecvRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RecvRegistration {} {} prompt {} tokens {} aux {} B groups [",
            self.request, self.slice, self.prompt_len, self.grant, self.aux_capacity
        )?;
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}", RunDisplay(g))?;
        }
        f.write_str("]")
    }
}

impl fmt::Display for KvResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KvResult {} {} -> {} {} {} B{}",
            self.request,
            self.sender_slice,
            self.receiver_slice,
            self.status,
            self.bytes_written,
            if self.is_last { " (last)" } else { "" }
        )
    }
}

impl fmt::Display for AuxResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.data;
        write!(
            f,
            "AuxResult {} {} prompt {} cached {} first {:?} draft {:?}",
            self.request,
            self.status,
            d.prompt_tokens,
            d.cached_tokens,
            d.first_tokens,
            d.draft_tokens
        )
    }
}

impl fmt::Display for Cancel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cancel {} ({})", self.request, self.reason)
    }
}

impl fmt::Display for Heartbeat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Heartbeat seq {}", self.seq)
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

impl fmt::Display for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frame::Hello(x) => x.fmt(f),
            Frame::HelloAccept(x) => x.fmt(f),
            Frame::HelloReject(x) => x.fmt(f),
            Frame::RecvRegistration(x) => x.fmt(f),
            Frame::KvResult(x) => x.fmt(f),
            Frame::AuxResult(x) => x.fmt(f),
            Frame::Cancel(x) => x.fmt(f),
            Frame::Heartbeat(x) => x.fmt(f),
            Frame::DataWrite(x) => x.fmt(f),
        }
    }
}
