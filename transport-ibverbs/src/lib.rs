//! # kvpipe-ibverbs
//!
//! The RDMA verbs transport (work in progress).

pub mod bootstrap;
pub mod device;
pub mod fabric;
pub mod flow;
pub mod idle;
mod link;
pub mod memory;
pub mod writes;

pub use bootstrap::{ConnectInfo, RegionDescriptor};
pub use device::{device_names, DeviceError, DeviceSpec, VerbsDevice};
pub use fabric::{
    Fabric, FabricConfig, FabricEvent, FabricHandler, LinkFailure, LinkId, Posted, WriteFailure,
};
pub use idle::IdlePolicy;
pub use memory::{Dmabuf, Exposure, MemoryTable, RegisterError};
