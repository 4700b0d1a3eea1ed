//! Closing a node from one thread while another waits on it with no deadline: the waiter
//! returns `Closed` instead of waiting forever, and the in-process pair keeps working for the
//! other handle, which loses the closed one as a peer.

use std::time::Duration;

use kvpipe::{mem_pair, EmbedError, NodeConfig, RawRegion};
use kvpipe_core::Event;

#[test]
fn close_ends_a_wait_without_deadline() {
    let layout = |region| {
        vec![kvpipe_core::LayerGroupLayout {
            layers: 1,
            kv_factor: 2,
            kv_heads: 1,
            head_dim: 4,
            elem_bytes: 2,
            tokens_per_block: 4,
            window: None,
            block_layout: Default::default(),
            pools: [kvpipe_core::PoolLayout {
                region: kvpipe_core::RegionId(region),
                layer_begin: 0,
                layers: 1,
                slot_bytes: 64,
            }]
            .into_iter()
            .collect(),
            shard: Default::default(),
        }]
    };
    let mut src = vec![1u8; 64 * 4];
    let mut dst = vec![0u8; 64 * 4];
    let region = |id, bytes: &mut Vec<u8>| RawRegion {
        id: kvpipe_core::RegionId(id),
        ptr: bytes.as_mut_ptr(),
        len: bytes.len(),
        device: None,
    };
    let (s_regions, r_regions) = ([region(1, &mut src)], [region(2, &mut dst)]);
    // SAFETY: `src` and `dst` outlive both nodes (dropped at the end of the test).
    let (tx, rx) = unsafe {
        mem_pair(
            &NodeConfig::new(layout(1)),
            &s_regions,
            &NodeConfig::new(layout(2)),
            &r_regions,
        )
    }
    .unwrap();
    let ready = |e: Option<Event>| matches!(e, Some(Event::PeerReady { .. }));
    assert!(ready(rx.next_event(Duration::MAX).unwrap()));
    assert!(ready(tx.next_event(Duration::from_secs(10)).unwrap()));
    std::thread::scope(|s| {
        let waiter = s.spawn(|| rx.next_event(Duration::MAX));
        std::thread::sleep(Duration::from_millis(50));
        rx.close(Duration::from_secs(1)).unwrap();
        assert!(matches!(waiter.join().unwrap(), Err(EmbedError::Closed)));
    });
    assert!(matches!(
        rx.cancel(kvpipe_core::RequestId(1)),
        Err(EmbedError::Closed)
    ));
    // The prefill handle still reaches the pair, and sees the decode side gone.
    assert!(!tx.is_peer_ready(kvpipe::MEM_RECEIVER_PEER).unwrap());
}
