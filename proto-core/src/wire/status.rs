//! [`TransferStatus`]: the outcome byte that [`KvResult`] and [`AuxResult`] carry.
//!
//! [`KvResult`]: super::KvResult
//! [`AuxResult`]: super::AuxResult

use core::fmt;

use super::body::wire_codes;

/// Outcome of a slice or of a whole transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum TransferStatus {
    /// Every write of the slice completed.
    Success = 0,
    /// A write failed; the destination holds unknown bytes.
    WriteFailed = 1,
    /// The outcome is unknown (a deadline passed with writes outstanding).
    InDoubt = 2,
    /// Cancelled by the engine on either side.
    Cancelled = 3,
    /// A deadline passed.
    TimedOut = 4,
    /// A write fell outside the receiver's grant and was refused.
    GrantViolation = 5,
    /// The peer disconnected or stopped answering.
    PeerLost = 6,
    /// The peer broke a protocol rule.
    ProtocolError = 7,
    /// The sender's engine described the request's KV in a way that breaks the block-source
    /// contract (a run longer or shorter than asked, ending elsewhere, a changed prefix): the KV
    /// cannot be trusted.
    EngineError = 8,
}

wire_codes!(TransferStatus {
    Success,
    WriteFailed,
    InDoubt,
    Cancelled,
    TimedOut,
    GrantViolation,
    PeerLost,
    ProtocolError,
    EngineError,
});

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

#[cfg(test)]
mod tests {
    use super::TransferStatus;

    #[test]
    fn codes_are_the_discriminants_and_unknown_codes_are_none() {
        for (i, &status) in TransferStatus::ALL.iter().enumerate() {
            assert_eq!(status.code(), i as u8);
            assert_eq!(TransferStatus::from_code(status.code()), Some(status));
        }
        assert_eq!(TransferStatus::from_code(9), None);
        assert_eq!(TransferStatus::from_code(0xff), None);
    }
}
