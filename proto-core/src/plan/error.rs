//! [`PlanError`], what planning refuses, and [`Side`], the side of a transfer an error names.

use thiserror::Error;

/// Which side of a transfer a layout or block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill server's cache (source of the writes).
    Sender,
    /// The decode server's cache (destination of the writes).
    Receiver,
}

impl core::fmt::Display for Side {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Side::Sender => "sender",
            Side::Receiver => "receiver",
        })
    }
}

/// Two layer-group layouts that cannot be paired, or a block whose bytes cannot be addressed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A whole-model geometry field differs between the two sides.
    #[error(
        "layer groups cannot be paired: {field} is {sender} on the sender and {receiver} on the \
         receiver; both sides must run the same model with the same block size"
    )]
    LayoutMismatch {
        /// The differing field of [`LayerGroupLayout`](crate::layout::LayerGroupLayout).
        field: &'static str,
        /// Its value on the sender.
        sender: u64,
        /// Its value on the receiver.
        receiver: u64,
    },
    /// The receiver keeps a smaller window than the sender.
    #[error(
        "layer groups cannot be paired: the sender's window is {sender:?} tokens and the \
         receiver's {receiver:?} (None: full attention); a receiver keeps at least the sender's \
         window"
    )]
    WindowMismatch {
        /// Sender's window (`None`: full attention).
        sender: Option<u32>,
        /// Receiver's window (`None`: full attention).
        receiver: Option<u32>,
    },
    /// A side's layers or heads lie outside the model's.
    #[error(
        "the {side} holds layers {first_layer}..+{layers} of {model_layers} and KV heads \
         {first_head}..+{kv_heads} of {model_kv_heads}: a rank's part must lie inside the model"
    )]
    ShardPastModel {
        /// Which side's layout is wrong.
        side: Side,
        /// First model layer it holds.
        first_layer: u16,
        /// Layers it holds.
        layers: u16,
        /// The group's layers in the model.
        model_layers: u16,
        /// First model KV head it holds.
        first_head: u16,
        /// KV heads it holds.
        kv_heads: u16,
        /// The model's KV heads.
        model_kv_heads: u16,
    },
    /// The bytes of one block overflow `u64`.
    #[error(
        "the bytes of one block overflow a 64-bit size: the layer group's geometry is invalid"
    )]
    BlockBytesOverflow,
    /// A pool does not start where the previous one ended, or holds no layer.
    #[error(
        "{side} pool {pool} holds layers {layer_begin}..+{layers}, but pools must hold \
         consecutive non-empty layer ranges: this one must start at layer {expected_begin}"
    )]
    PoolsDoNotTile {
        /// Which side's layout is wrong.
        side: Side,
        /// Index of the pool in the group.
        pool: usize,
        /// First layer the pool claims.
        layer_begin: u16,
        /// Layers the pool claims.
        layers: u16,
        /// Where it should start.
        expected_begin: u32,
    },
    /// The pools together hold more or fewer layers than the group.
    #[error("{side} pools hold {covered} layers, but the layer group has {layers}")]
    PoolsCoverWrongLayers {
        /// Which side's layout is wrong.
        side: Side,
        /// Layers the pools hold.
        covered: u32,
        /// Layers of the group.
        layers: u16,
    },
    /// A pool's slot is smaller than the layers it holds.
    #[error("{side} pool {pool} has {slot_bytes}-byte slots but its layers need {needed} bytes")]
    SlotTooSmall {
        /// Which side's layout is wrong.
        side: Side,
        /// Index of the pool in the group.
        pool: usize,
        /// Bytes per slot.
        slot_bytes: u64,
        /// Bytes its layers need per block.
        needed: u64,
    },
    /// A size of a layer group is out of the range it can take (a zero size, a `kv_factor`
    /// other than 1 or 2, a window of no token).
    #[error("{side} layer group's {field} is {value}; it must be {accepted}")]
    FieldOutOfRange {
        /// Which side's layout is wrong.
        side: Side,
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it accepts.
        accepted: &'static str,
    },
    /// A block's byte offset overflows `u64`.
    #[error(
        "{side} block {block} at {slot_bytes} bytes per slot lies past the 64-bit address range"
    )]
    OffsetOverflow {
        /// Which side's block.
        side: Side,
        /// The block id.
        block: u64,
        /// Bytes per slot of its pool.
        slot_bytes: u64,
    },
}
