//! Newtypes for every identifier, so one kind of id can never be passed where another is
//! expected (a sender slice id is not a receiver slice id).

use core::fmt;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        id_newtype!(@type $(#[$doc])* $name($inner));

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
    (@type $(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
        pub struct $name(pub $inner);

        impl From<$inner> for $name {
            fn from(v: $inner) -> Self {
                $name(v)
            }
        }
    };
}

id_newtype!(
    /// One LLM request, as named by the serving engine; unique on both sides of a transfer.
    RequestId(u64),
    "req#"
);
id_newtype!(
    @type
    /// The sender's id for one slice of a request (one prefill chunk's transfer).
    SenderSliceId(u32)
);

impl fmt::Display for SenderSliceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.get() {
            Some(s) => write!(f, "sslice#{}", s.0),
            None => f.write_str("sslice#none"),
        }
    }
}
id_newtype!(
    /// The receiver's id for one registration of a request (one decode rank's view of it).
    ReceiverSliceId(u32),
    "rslice#"
);
id_newtype!(
    /// A connected peer endpoint, as numbered by the local transport.
    PeerId(u32),
    "peer#"
);
id_newtype!(
    /// A process-lifetime instance of an endpoint; changes when a peer restarts.
    InstanceId(u64),
    "inst#"
);
id_newtype!(
    /// A slot in a KV pool: the bytes of block `b` in a pool are at `base + b * slot_bytes`.
    BlockId(u32),
    "blk#"
);
id_newtype!(
    /// A registered memory region (a KV pool or an aux buffer) on one side.
    RegionId(u32),
    "region#"
);
id_newtype!(
    /// The receiver's grant for one registration: data writes must carry it to be applied.
    GrantId(u64),
    "grant#"
);
id_newtype!(
    /// Index of a layer group in the model's layout (`0..groups.len()`).
    GroupIndex(u16),
    "group#"
);

impl SenderSliceId {
    /// "No slice": a failure before the sender created any slice of the request (on the wire
    /// as `u32::MAX`; reported as `None` in events).
    pub const NONE: SenderSliceId = SenderSliceId(u32::MAX);

    /// The id, or `None` for [`SenderSliceId::NONE`].
    pub fn get(self) -> Option<SenderSliceId> {
        (self != SenderSliceId::NONE).then_some(self)
    }
}
