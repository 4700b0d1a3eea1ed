//! Opening an RDMA device: the device context, one protection domain for everything the node
//! registers and connects, the port and the GID the node sends from.

use std::sync::Arc;

use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use thiserror::Error;

/// Which device, port and GID to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device name (e.g. `rxe0`, `mlx5_0`); `None` picks the first device whose port is active.
    pub name: Option<String>,
    /// Port number (from 1).
    pub port: u8,
    /// GID index; `None` prefers an IPv4-mapped GID (RoCE v2 over IPv4), else the first
    /// non-zero one.
    pub gid_index: Option<u32>,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        DeviceSpec {
            name: None,
            port: 1,
            gid_index: None,
        }
    }
}

impl DeviceSpec {
    /// The named device, port 1, GID chosen automatically.
    pub fn named(name: impl Into<String>) -> Self {
        DeviceSpec {
            name: Some(name.into()),
            ..DeviceSpec::default()
        }
    }
}

/// A device that cannot be opened or used.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// libibverbs could not list devices (not installed, or no kernel support).
    #[error("cannot list RDMA devices: {0}")]
    List(String),
    /// No device matches.
    #[error("{0}")]
    NotFound(String),
    /// A verbs call failed while opening the device.
    #[error("{device}: {what} failed: {message}")]
    Verbs {
        /// The device.
        device: String,
        /// The call.
        what: &'static str,
        /// The error.
        message: String,
    },
}

/// An opened RDMA device: context, protection domain, port and GID. Cheap to clone (shared).
#[derive(Clone)]
pub struct VerbsDevice {
    pub(crate) ctx: Arc<DeviceContext>,
    pub(crate) pd: Arc<ProtectionDomain>,
    name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
    pub(crate) gid: Gid,
    pub(crate) lid: u16,
    /// Active MTU as the verbs enum (1 = 256 … 5 = 4096).
    pub(crate) mtu: u8,
    /// Scatter/gather entries per work request the device allows.
    pub(crate) max_sge: u32,
    /// Work requests per queue the device allows.
    pub(crate) max_qp_wr: u32,
    /// Completion queue entries the device allows.
    pub(crate) max_cqe: u32,
    /// Longest message the port carries (8 MiB on rxe): the cap of one RDMA WRITE.
    pub(crate) max_msg: u64,
    /// Memory windows the device supports (0: none).
    max_mw: u32,
}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &self.gid.to_string())
            .field("mtu", &self.mtu)
            .finish()
    }
}

/// The names of the RDMA devices libibverbs lists (empty when there are none).
pub fn device_names() -> Result<Vec<String>, DeviceError> {
    let list = DeviceList::new().map_err(|e| DeviceError::List(e.to_string()))?;
    Ok(list.iter().map(|d| d.name()).collect())
}

impl VerbsDevice {
    /// Opens the device `spec` names (or the first one with an active port).
    pub fn open(spec: &DeviceSpec) -> Result<VerbsDevice, DeviceError> {
        let list = DeviceList::new().map_err(|e| DeviceError::List(e.to_string()))?;
        let mut tried = Vec::new();
        for dev in list.iter() {
            let name = dev.name();
            if spec.name.as_ref().is_some_and(|n| *n != name) {
                continue;
            }
            let verbs = |what: &'static str, message: String| DeviceError::Verbs {
                device: name.clone(),
                what,
                message,
            };
            let ctx = dev
                .open()
                .map_err(|e| verbs("ibv_open_device", e.to_string()))?;
            let port = ctx
                .query_port(spec.port)
                .map_err(|e| verbs("ibv_query_port", e.to_string()))?;
            if port.port_state() != PortState::Active {
                if spec.name.is_some() {
                    return Err(DeviceError::NotFound(format!(
                        "{name} port {} is not active ({:?})",
                        spec.port,
                        port.port_state()
                    )));
                }
                tried.push(format!("{name} (port {} not active)", spec.port));
                continue;
            }
            let attr = ctx
                .query_device()
                .map_err(|e| verbs("ibv_query_device", e.to_string()))?;
            let (gid_index, gid) = match spec.gid_index {
                Some(i) => (
                    i,
                    ctx.query_gid(spec.port, i)
                        .map_err(|e| verbs("ibv_query_gid", e.to_string()))?,
                ),
                None => pick_gid(&ctx, spec.port, port.gid_tbl_len())
                    .ok_or_else(|| verbs("choosing a GID", "the port has no GID".into()))?,
            };
            let pd = ctx
                .alloc_pd()
                .map_err(|e| verbs("ibv_alloc_pd", e.to_string()))?;
            let positive = |v: i32| u32::try_from(v).unwrap_or(0);
            return Ok(VerbsDevice {
                pd,
                name,
                port: spec.port,
                gid_index,
                gid,
                lid: port.lid(),
                mtu: port.active_mtu() as u8,
                max_sge: positive(attr.max_sge()),
                max_qp_wr: positive(attr.max_qp_wr()),
                max_cqe: positive(attr.max_cqe()),
                max_msg: u64::from(port.attr.max_msg_sz),
                max_mw: positive(attr.max_mw()),
                ctx,
            });
        }
        Err(DeviceError::NotFound(
            match (&spec.name, tried.is_empty()) {
                (Some(n), _) => format!("no RDMA device named {n} (devices: {:?})", names(&list)),
                (None, true) => "no RDMA device found".to_string(),
                (None, false) => {
                    format!("no RDMA device with an active port: {}", tried.join(", "))
                }
            },
        ))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The port used.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The GID index used and the GID, as text.
    pub fn gid(&self) -> (u32, String) {
        (self.gid_index, self.gid.to_string())
    }

    /// The port's active MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        128 << self.mtu
    }

    /// Memory windows the device supports (0: none). The transport does not use them; see the
    /// crate documentation on what the memory registration's key protects.
    pub fn max_memory_windows(&self) -> u32 {
        self.max_mw
    }
}

fn names(list: &DeviceList) -> Vec<String> {
    list.iter().map(|d| d.name()).collect()
}

/// An IPv4-mapped GID if the port has one (RoCE v2 over IPv4), else the first non-zero GID.
fn pick_gid(ctx: &DeviceContext, port: u8, len: i32) -> Option<(u32, Gid)> {
    let mut first = None;
    for i in 0..u32::try_from(len).unwrap_or(0) {
        let Ok(gid) = ctx.query_gid(port, i) else {
            continue;
        };
        if gid.is_zero() {
            continue;
        }
        let raw = std::net::Ipv6Addr::from(gid).octets();
        if raw[..10].iter().all(|b| *b == 0) && raw[10..12] == [0xff, 0xff] {
            return Some((i, gid));
        }
        first.get_or_insert((i, gid));
    }
    first
}
