//! Which transport a node runs on, chosen by configuration ([`NodeConfig::transport`]).
//!
//! [`NodeConfig::transport`]: crate::NodeConfig::transport

use kvpipe_tcp::TcpConfig;

/// The transport a node moves KV over, with its settings. Whatever it is, the node's commands,
/// events and errors are the same; only [`listen`](crate::Node::listen) and
/// [`connect`](crate::Node::connect) need a transport that crosses processes.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Transport {
    /// In this process (`kvpipe-mem`): both sides are made together by
    /// [`mem_pair`](crate::mem_pair), already connected; a node cannot be made alone on it.
    Mem,
    /// TCP (`kvpipe-tcp`'s blocking driver): control frames and data on sockets, GPU memory
    /// through pinned staging or (two processes on one host) peer copies.
    Tcp(TcpConfig),
    /// RDMA verbs (`kvpipe-ibverbs`, `verbs` feature): RC queue pairs set up over a TCP side
    /// channel, one-sided RDMA WRITEs from and into registered memory (GPU memory through
    /// dma-buf).
    #[cfg(feature = "verbs")]
    Verbs(VerbsConfig),
}

impl Transport {
    /// The transport's name: `"mem"`, `"tcp"` or `"verbs"`.
    pub fn name(&self) -> &'static str {
        match self {
            Transport::Mem => "mem",
            Transport::Tcp(_) => "tcp",
            #[cfg(feature = "verbs")]
            Transport::Verbs(_) => "verbs",
        }
    }
}

/// The RDMA verbs transport's settings (`verbs` feature).
#[cfg(feature = "verbs")]
#[derive(Clone, Debug, Default)]
pub struct VerbsConfig {
    /// Which device, port and GID (default: the first device whose port is active, port 1, an
    /// IPv4-mapped GID where there is one).
    pub device: kvpipe_ibverbs::DeviceSpec,
    /// The fabric's queue sizes, write caps and timeouts.
    pub fabric: kvpipe_ibverbs::FabricConfig,
}

#[cfg(feature = "verbs")]
impl VerbsConfig {
    /// Default settings on the device named `name` (e.g. `rxe0`, `mlx5_0`).
    pub fn on_device(name: impl Into<String>) -> Self {
        VerbsConfig {
            device: kvpipe_ibverbs::DeviceSpec::named(name),
            ..VerbsConfig::default()
        }
    }
}
