//! Version negotiation and the compatibility check, as pure functions over two [`Hello`]s.
//!
//! Both endpoints send a `Hello` first. Each side then calls [`negotiate`] with its own and the
//! peer's `Hello` and sends the resulting [`HelloAccept`] or [`HelloReject`]. Since the handshake
//! frames are frozen across versions, a peer on another version is always answered with a
//! reject that names both version ranges, never left waiting.

use core::fmt;

use super::frames::{Hello, HelloAccept, HelloReject, RejectReason, Role, MAX_REJECT_MESSAGE};
use super::version::VersionRange;
use crate::ids::GroupIndex;
use crate::layout::LayerGroupLayout;
use crate::shard::check_shard;

/// The highest version both ranges contain, if any.
pub fn common_version(a: VersionRange, b: VersionRange) -> Option<u16> {
    let low = a.min.max(b.min);
    let high = a.max.min(b.max);
    (low <= high).then_some(high)
}

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The compatibility hash of a model layout: FNV-1a 64 over a canonical little-endian encoding
/// of the **whole model's** geometry, so two endpoints agree on it exactly when
/// [`layout_differences`] finds nothing — whatever part of the model each rank holds.
///
/// Covered, in this order: the number of groups (u16), then per group the model's layers
/// ([`LayerGroupLayout::model_layers`], u16), `kv_factor` (u8), the model's KV heads
/// ([`LayerGroupLayout::model_kv_heads`], u16), `head_dim` (u16), `elem_bytes` (u8),
/// `tokens_per_block` (u32) and `block_layout` (u8).
/// Not covered: which layers and heads this rank holds (the [`GroupShard`] ranges: tensor and
/// pipeline parallelism may differ between the sides), the window (a receiver may keep a
/// larger one; [`negotiate`] checks it), and the pools (region ids, how layers are split over
/// pools, slot padding), which are local memory details each side plans around.
///
/// [`GroupShard`]: crate::layout::GroupShard
pub fn compat_hash(groups: &[LayerGroupLayout]) -> u64 {
    let mut hash = FNV_OFFSET_BASIS;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(FNV_PRIME);
        }
    };
    // A group count over u16::MAX cannot be encoded in a Hello; saturate rather than wrap.
    feed(
        &u16::try_from(groups.len())
            .unwrap_or(u16::MAX)
            .to_le_bytes(),
    );
    for g in groups {
        feed(&g.model_layers().to_le_bytes());
        feed(&[g.kv_factor]);
        feed(&g.model_kv_heads().to_le_bytes());
        feed(&g.head_dim.to_le_bytes());
        feed(&[g.elem_bytes]);
        feed(&g.tokens_per_block.to_le_bytes());
        feed(&[g.block_layout as u8]);
    }
    hash
}

/// One model-geometry field that differs between two layouts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutDifference {
    /// The group it is in; `None` for the number of groups.
    pub group: Option<GroupIndex>,
    /// What differs, in words (`"tokens per block"`, `"KV heads"`, …).
    pub field: &'static str,
    /// The local value.
    pub local: String,
    /// The remote value.
    pub remote: String,
}

impl fmt::Display for LayoutDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(group) = self.group {
            write!(f, "{group} ")?;
        }
        write!(
            f,
            "{}: local {}, remote {}",
            self.field, self.local, self.remote
        )
    }
}

fn window_text(window: Option<u32>) -> String {
    match window {
        None => "full attention".to_owned(),
        Some(w) => format!("{w} tokens"),
    }
}

/// Every model-geometry field (the ones [`compat_hash`] covers, whole-model values) that differs
/// between `local` and `remote`, group by group; groups beyond the shorter list are reported
/// only as a different number of groups.
pub fn layout_differences(
    local: &[LayerGroupLayout],
    remote: &[LayerGroupLayout],
) -> Vec<LayoutDifference> {
    let mut out = Vec::new();
    if local.len() != remote.len() {
        out.push(LayoutDifference {
            group: None,
            field: "number of layer groups",
            local: local.len().to_string(),
            remote: remote.len().to_string(),
        });
    }
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        let group = Some(GroupIndex(u16::try_from(i).unwrap_or(u16::MAX)));
        let mut diff = |field: &'static str, a: String, b: String| {
            if a != b {
                out.push(LayoutDifference {
                    group,
                    field,
                    local: a,
                    remote: b,
                });
            }
        };
        diff(
            "model layers",
            l.model_layers().to_string(),
            r.model_layers().to_string(),
        );
        diff(
            "kv factor",
            l.kv_factor.to_string(),
            r.kv_factor.to_string(),
        );
        diff(
            "model KV heads",
            l.model_kv_heads().to_string(),
            r.model_kv_heads().to_string(),
        );
        diff("head dim", l.head_dim.to_string(), r.head_dim.to_string());
        diff(
            "element bytes",
            l.elem_bytes.to_string(),
            r.elem_bytes.to_string(),
        );
        diff(
            "tokens per block",
            l.tokens_per_block.to_string(),
            r.tokens_per_block.to_string(),
        );
        diff(
            "block layout",
            format!("{:?}", l.block_layout),
            format!("{:?}", r.block_layout),
        );
    }
    out
}

/// The groups where the receiver keeps a smaller window than the sender (full attention
/// counts as an unbounded window), `local` playing `local_role` and `remote` the other role. A
/// receiver may keep a larger window than the sender (blocks the sender no longer holds are
/// simply not written), never a smaller one.
pub fn window_differences(
    local: &[LayerGroupLayout],
    remote: &[LayerGroupLayout],
    local_role: Role,
) -> Vec<LayoutDifference> {
    let mut out = Vec::new();
    let remote_role = match local_role {
        Role::Sender => Role::Receiver,
        Role::Receiver => Role::Sender,
    };
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        let (sender, receiver) = match local_role {
            Role::Sender => (l.window, r.window),
            Role::Receiver => (r.window, l.window),
        };
        let smaller = match (sender, receiver) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(a), Some(b)) => b < a,
        };
        if smaller {
            out.push(LayoutDifference {
                group: Some(GroupIndex(u16::try_from(i).unwrap_or(u16::MAX))),
                field: "window (a receiver keeps at least the sender's)",
                local: format!("{local_role} {}", window_text(l.window)),
                remote: format!("{remote_role} {}", window_text(r.window)),
            });
        }
    }
    out
}

fn reject(reason: RejectReason, mut message: String) -> HelloReject {
    if message.len() > MAX_REJECT_MESSAGE {
        let mut end = MAX_REJECT_MESSAGE - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    HelloReject { reason, message }
}

/// Decides the handshake between this endpoint's `local` offer and the peer's `remote` one.
///
/// Checks, in order: a common version (the highest wins; none → `VersionMismatch` naming both
/// ranges), opposite roles (`RoleMismatch`), then the model layout: the compatibility hashes
/// and the whole-model geometry fields must agree, and the receiver's window must be at least
/// the sender's in every group (`CompatibilityMismatch`, naming every field that differs). The
/// two sides may hold different parts of the model (tensor and pipeline parallelism), but each
/// side's part of every group must lie inside the model and hold the heads its tensor rank
/// holds ([`check_shard`]; `TopologyMismatch`, naming the side, the group and both values).
/// On success the accept carries the version and `local`'s instance.
///
/// ```
/// use kvpipe_core::wire::samples::sample_hello;
/// use kvpipe_core::wire::{negotiate, RejectReason, Role, VersionRange};
///
/// let sender = sample_hello(Role::Sender);
/// let mut receiver = sample_hello(Role::Receiver);
/// assert!(negotiate(&sender, &receiver).is_ok());
///
/// receiver.groups[0].tokens_per_block = 64;
/// receiver.compat_hash = kvpipe_core::wire::compat_hash(&receiver.groups);
/// let reject = negotiate(&sender, &receiver).unwrap_err();
/// assert_eq!(reject.reason, RejectReason::CompatibilityMismatch);
/// assert!(reject.message.contains("tokens per block: local 32, remote 64"));
///
/// receiver.versions = VersionRange { min: 7, max: 9 };
/// let reject = negotiate(&sender, &receiver).unwrap_err();
/// assert_eq!(reject.reason, RejectReason::VersionMismatch);
/// ```
pub fn negotiate(local: &Hello, remote: &Hello) -> Result<HelloAccept, HelloReject> {
    let Some(version) = common_version(local.versions, remote.versions) else {
        return Err(reject(
            RejectReason::VersionMismatch,
            format!(
                "no common protocol version: local speaks {} (min {}, max {}), remote speaks {} (min {}, max {})",
                local.versions,
                local.versions.min,
                local.versions.max,
                remote.versions,
                remote.versions.min,
                remote.versions.max
            ),
        ));
    };
    if local.role == remote.role {
        return Err(reject(
            RejectReason::RoleMismatch,
            format!(
                "both endpoints are a {}: a transfer pairs a sender with a receiver",
                local.role
            ),
        ));
    }
    let mut differences = layout_differences(&local.groups, &remote.groups);
    differences.extend(window_differences(
        &local.groups,
        &remote.groups,
        local.role,
    ));
    if local.compat_hash != remote.compat_hash || !differences.is_empty() {
        let mut message = format!(
            "model layouts are incompatible (compat hash local 0x{:016x}, remote 0x{:016x})",
            local.compat_hash, remote.compat_hash
        );
        if differences.is_empty() {
            message.push_str(
                ": the geometry fields agree, so the hashes cover something else (dtype or a different hash rule)",
            );
        } else {
            for (i, d) in differences.iter().enumerate() {
                message.push_str(if i == 0 { ": " } else { "; " });
                message.push_str(&d.to_string());
            }
        }
        return Err(reject(RejectReason::CompatibilityMismatch, message));
    }
    let shards = [("local", local), ("remote", remote)]
        .into_iter()
        .flat_map(|(side, hello)| {
            hello
                .groups
                .iter()
                .enumerate()
                .filter_map(move |(g, layout)| {
                    check_shard(&hello.topology, layout).err().map(|e| {
                        let group = GroupIndex(u16::try_from(g).unwrap_or(u16::MAX));
                        format!("{side} {group}: {e}")
                    })
                })
        })
        .collect::<Vec<_>>();
    if !shards.is_empty() {
        return Err(reject(
            RejectReason::TopologyMismatch,
            format!(
                "a rank's part of the model does not match its parallel topology: {}",
                shards.join("; ")
            ),
        ));
    }
    Ok(HelloAccept {
        version,
        instance: local.instance,
        data_path_answer: None,
    })
}
