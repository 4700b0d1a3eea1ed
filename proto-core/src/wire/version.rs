//! Protocol versions: the ones this build speaks, and ranges of them.

use core::fmt;

/// The newest wire protocol version this build speaks. Version 2 added
/// [`RecvComplete`](super::RecvComplete): a writer completes only once its receiver did.
pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest wire protocol version this build speaks. A version-1 writer would report
/// requests completed that its receiver never completed, so version 1 is not spoken.
pub const MIN_PROTOCOL_VERSION: u16 = 2;

/// An inclusive range of protocol versions an endpoint speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct VersionRange {
    /// Oldest version spoken.
    pub min: u16,
    /// Newest version spoken.
    pub max: u16,
}

impl VersionRange {
    /// The versions this build speaks.
    pub const SUPPORTED: VersionRange = VersionRange {
        min: MIN_PROTOCOL_VERSION,
        max: PROTOCOL_VERSION,
    };

    /// Whether `version` is in the range.
    pub fn contains(self, version: u16) -> bool {
        self.min <= version && version <= self.max
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "version {}", self.min)
        } else {
            write!(f, "versions {}..={}", self.min, self.max)
        }
    }
}
