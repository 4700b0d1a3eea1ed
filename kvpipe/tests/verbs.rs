//! The verbs transport through the engine API (`verbs` feature): without a device a node is
//! refused with an error that says so; with one (the Soft-RoCE guest of `scripts/test-verbs`,
//! device named by `KVPIPE_VERBS_DEVICE`) a request moves between two nodes like on the other
//! transports.
#![cfg(feature = "verbs")]

mod common;

use std::time::Duration;

use common::{configs, connect, transfer, transfer_layers, Sides};
use kvpipe::{DecodeNode, EmbedError, PrefillNode, Transport, VerbsConfig};

#[test]
fn a_verbs_node_without_its_device_is_refused_clearly() {
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Verbs(VerbsConfig::on_device(
        "kvpipe-no-such-device",
    )));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    // SAFETY: no node is made; the regions outlive the calls anyway.
    let refusals = [
        unsafe { PrefillNode::new(&s, &src) }
            .err()
            .expect("no such device"),
        // SAFETY: as above.
        unsafe { DecodeNode::new(&r, &dst) }
            .err()
            .expect("no such device"),
    ];
    for err in refusals {
        let message = err.to_string();
        assert!(matches!(err, EmbedError::Io(_)), "{err:?}");
        assert!(
            message.starts_with("the verbs transport needs an active RDMA device: "),
            "{message}"
        );
        // Where libibverbs lists devices, the message names the one asked for; where it cannot
        // (no rdma-core, no kernel support), it says that.
        assert!(
            message.contains("kvpipe-no-such-device") || message.contains("cannot list"),
            "{message}"
        );
    }
}

#[test]
fn the_first_active_device_or_a_clear_refusal() {
    let mut sides = Sides::new();
    let (s, _) = configs(Transport::Verbs(VerbsConfig::default()));
    let src = sides.src_region();
    // SAFETY: `sides` outlives the node (dropped at once).
    match unsafe { PrefillNode::new(&s, &src) } {
        // A machine with an RDMA device.
        Ok(node) => assert_eq!(node.transport().unwrap(), "verbs"),
        Err(err) => assert!(
            err.to_string()
                .starts_with("the verbs transport needs an active RDMA device: "),
            "{err}"
        ),
    }
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_request_moves_over_verbs_chosen_by_configuration() {
    let device = std::env::var("KVPIPE_VERBS_DEVICE")
        .map_or_else(|_| VerbsConfig::default(), VerbsConfig::on_device);
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Verbs(device));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::new(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::new(&s, &src) }.unwrap();
        assert_eq!(tx.transport().unwrap(), "verbs");
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        transfer(&tx, &rx, to_receiver, to_sender);
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
    sides.check();
}

#[test]
#[ignore = "needs an RDMA device: runs in the Soft-RoCE guest (scripts/test-verbs)"]
fn a_request_moves_layer_by_layer_over_verbs() {
    let device = std::env::var("KVPIPE_VERBS_DEVICE")
        .map_or_else(|_| VerbsConfig::default(), VerbsConfig::on_device);
    let mut sides = Sides::new();
    let (s, r) = configs(Transport::Verbs(device));
    let (src, dst) = (sides.src_region(), sides.dst_region());
    {
        // SAFETY: `sides` outlives both nodes (closed at the end of the block).
        let rx = unsafe { DecodeNode::new(&r, &dst) }.unwrap();
        // SAFETY: as above.
        let tx = unsafe { PrefillNode::new(&s, &src) }.unwrap();
        let (to_receiver, to_sender) = connect(&tx, &rx, "127.0.0.1");
        transfer_layers(&tx, &rx, to_receiver, to_sender);
        tx.close(Duration::from_secs(5)).unwrap();
        rx.close(Duration::from_secs(5)).unwrap();
    }
    sides.check();
}
