//! Version negotiation and the compatibility check.

use kvpipe_core::wire::handshake::{common_version, layout_differences};
use kvpipe_core::wire::samples::{sample_groups, sample_hello};
use kvpipe_core::wire::*;
use kvpipe_core::{GroupIndex, InstanceId, LayerGroupLayout, RegionId};
use proptest::prelude::*;

fn pair() -> (Hello, Hello) {
    (sample_hello(Role::Sender), sample_hello(Role::Receiver))
}

fn range(min: u16, max: u16) -> VersionRange {
    VersionRange { min, max }
}

#[test]
fn identical_layouts_are_accepted_with_the_local_instance() {
    let (s, r) = pair();
    assert_eq!(
        negotiate(&s, &r),
        Ok(HelloAccept {
            version: PROTOCOL_VERSION,
            instance: s.instance,
            data_path_answer: None,
        })
    );
    assert_eq!(
        negotiate(&r, &s),
        Ok(HelloAccept {
            version: PROTOCOL_VERSION,
            instance: r.instance,
            data_path_answer: None,
        })
    );
}

#[test]
fn overlapping_ranges_pick_the_highest_common_version() {
    let (mut s, mut r) = pair();
    s.versions = range(1, 3);
    r.versions = range(2, 5);
    assert_eq!(negotiate(&s, &r).unwrap().version, 3);
    assert_eq!(negotiate(&r, &s).unwrap().version, 3);
    s.versions = range(4, 9);
    assert_eq!(negotiate(&s, &r).unwrap().version, 5);
    s.versions = range(5, 5);
    assert_eq!(negotiate(&s, &r).unwrap().version, 5);
}

#[test]
fn disjoint_ranges_are_rejected_naming_both() {
    let (mut s, mut r) = pair();
    s.versions = range(1, 2);
    r.versions = range(3, 4);
    let reject = negotiate(&s, &r).unwrap_err();
    assert_eq!(reject.reason, RejectReason::VersionMismatch);
    assert!(
        reject.message.contains("local speaks versions 1..=2"),
        "{}",
        reject.message
    );
    assert!(
        reject.message.contains("remote speaks versions 3..=4"),
        "{}",
        reject.message
    );
    let back = negotiate(&r, &s).unwrap_err();
    assert_eq!(back.reason, RejectReason::VersionMismatch);
    assert!(
        back.message.contains("local speaks versions 3..=4"),
        "{}",
        back.message
    );
    // The version check comes first: a role or layout problem on another version is still
    // reported as the version mismatch.
    r.role = Role::Sender;
    r.groups.clear();
    assert_eq!(
        negotiate(&s, &r).unwrap_err().reason,
        RejectReason::VersionMismatch
    );
}

/// A peer on a future version: its Hello decodes (frozen layout) and the reject goes back.
#[test]
fn a_future_peer_is_rejected_at_the_handshake() {
    let (s, mut future) = pair();
    future.versions = range(PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 3);
    let mut buf = vec![0; Frame::Hello(future.clone()).encoded_len()];
    Frame::Hello(future.clone())
        .emit_versioned(PROTOCOL_VERSION + 3, &mut buf)
        .unwrap();
    let (Frame::Hello(received), _) = Frame::parse(&buf).unwrap() else {
        panic!("not a hello")
    };
    assert_eq!(received, future);
    let reject = negotiate(&s, &received).unwrap_err();
    assert_eq!(reject.reason, RejectReason::VersionMismatch);
    assert!(reject
        .message
        .contains(&format!("{}", VersionRange::SUPPORTED)));
    assert!(reject.message.contains(&format!("{}", future.versions)));
    // The reject itself is a frozen frame the future peer can read.
    let bytes = Frame::HelloReject(reject.clone()).to_vec().unwrap();
    assert_eq!(Frame::parse(&bytes).unwrap().0, Frame::HelloReject(reject));
}

#[test]
fn same_roles_are_rejected() {
    let (s, _) = pair();
    let mut other = sample_hello(Role::Sender);
    other.instance = InstanceId(99);
    let reject = negotiate(&s, &other).unwrap_err();
    assert_eq!(reject.reason, RejectReason::RoleMismatch);
    assert!(reject.message.contains("sender"), "{}", reject.message);
}

/// Each whole-model geometry field, changed on the remote side, is named with both values.
#[test]
fn each_layout_difference_is_named() {
    type Edit = fn(&mut LayerGroupLayout);
    let cases: [(&str, Edit, &str, &str); 6] = [
        ("tokens per block", |g| g.tokens_per_block = 64, "32", "64"),
        ("element bytes", |g| g.elem_bytes = 1, "2", "1"),
        ("model layers", |g| g.shard.model_layers = 56, "28", "56"),
        (
            "model KV heads",
            |g| g.shard.model_kv_heads = 32,
            "16",
            "32",
        ),
        ("head dim", |g| g.head_dim = 64, "128", "64"),
        ("kv factor", |g| g.kv_factor = 1, "2", "1"),
    ];
    for (field, edit, local, remote) in cases {
        let (s, mut r) = pair();
        edit(&mut r.groups[0]);
        r.compat_hash = compat_hash(&r.groups);
        assert_ne!(r.compat_hash, s.compat_hash, "{field} must change the hash");
        let reject = negotiate(&s, &r).unwrap_err();
        assert_eq!(
            reject.reason,
            RejectReason::CompatibilityMismatch,
            "{field}"
        );
        let expected = format!("group#0 {field}: local {local}, remote {remote}");
        assert!(
            reject.message.contains(&expected),
            "{field}: {:?} lacks {expected:?}",
            reject.message
        );
        assert!(reject.message.contains(&format!("{:016x}", r.compat_hash)));
        let diffs = layout_differences(&s.groups, &r.groups);
        assert_eq!(diffs.len(), 1, "{field}: {diffs:?}");
        assert_eq!(diffs[0].group, Some(GroupIndex(0)));
        assert_eq!(diffs[0].field, field);
    }
}

#[test]
fn a_different_number_of_groups_is_named() {
    let (s, mut r) = pair();
    r.groups.pop();
    r.compat_hash = compat_hash(&r.groups);
    let reject = negotiate(&s, &r).unwrap_err();
    assert_eq!(reject.reason, RejectReason::CompatibilityMismatch);
    assert!(
        reject
            .message
            .contains("number of layer groups: local 2, remote 1"),
        "{}",
        reject.message
    );
}

#[test]
fn several_differences_are_all_named() {
    let (s, mut r) = pair();
    r.groups[0].tokens_per_block = 16;
    r.groups[1].window = Some(2048);
    r.compat_hash = compat_hash(&r.groups);
    let message = negotiate(&s, &r).unwrap_err().message;
    assert!(
        message.contains("group#0 tokens per block: local 32, remote 16"),
        "{message}"
    );
    assert!(
        message.contains(
            "group#1 window (a receiver keeps at least the sender's): local sender 4096 \
             tokens, remote receiver 2048 tokens"
        ),
        "{message}"
    );
}

/// A receiver may keep a larger window than the sender (or full attention), never a smaller
/// one; both ends reach the same verdict.
#[test]
fn a_receiver_window_may_be_larger_never_smaller() {
    for (sender, receiver, ok) in [
        (Some(4096), Some(4096), true),
        (Some(4096), Some(8192), true),
        (Some(4096), None, true),
        (Some(4096), Some(4095), false),
        (None, Some(1 << 20), false),
    ] {
        let (mut s, mut r) = pair();
        s.groups[1].window = sender;
        r.groups[1].window = receiver;
        // The window is not part of the hash: only the direction rule decides.
        assert_eq!(compat_hash(&s.groups), compat_hash(&r.groups));
        for (local, remote) in [(&s, &r), (&r, &s)] {
            let verdict = negotiate(local, remote);
            assert_eq!(
                verdict.is_ok(),
                ok,
                "{sender:?} -> {receiver:?}: {verdict:?}"
            );
            if let Err(reject) = verdict {
                assert_eq!(reject.reason, RejectReason::CompatibilityMismatch);
                assert!(
                    reject.message.contains("group#1 window"),
                    "{}",
                    reject.message
                );
            }
        }
    }
}

/// Tensor and pipeline parallelism may differ between the sides: only the whole model's
/// geometry is compared, not which layers and heads each rank holds.
#[test]
fn ranks_holding_other_parts_of_the_model_are_compatible() {
    let (s, mut r) = pair();
    for g in &mut r.groups {
        // Pipeline rank 1 of 2, tensor rank 3 of 4: half the layers, 4 of the 16 heads.
        g.layers /= 2;
        g.shard.first_layer = g.layers;
        g.kv_heads = 4;
        g.shard.first_head = 12;
        let per_pool = g.layers / g.pools.len() as u16;
        for (i, p) in g.pools.iter_mut().enumerate() {
            p.layer_begin = i as u16 * per_pool;
            p.layers = per_pool;
        }
    }
    r.topology.tp_size = 4;
    r.topology.tp_rank = 3;
    r.compat_hash = compat_hash(&r.groups);
    assert_eq!(r.compat_hash, s.compat_hash);
    assert!(layout_differences(&s.groups, &r.groups).is_empty());
    assert!(negotiate(&s, &r).is_ok());
    assert!(negotiate(&r, &s).is_ok());
}

#[test]
fn equal_geometry_with_different_hashes_is_still_rejected() {
    let (s, mut r) = pair();
    r.compat_hash ^= 1;
    let reject = negotiate(&s, &r).unwrap_err();
    assert_eq!(reject.reason, RejectReason::CompatibilityMismatch);
    assert!(
        reject.message.contains("geometry fields agree"),
        "{}",
        reject.message
    );
}

#[test]
fn differing_geometry_under_equal_hashes_is_still_rejected() {
    let (s, mut r) = pair();
    r.groups[1].head_dim = 256; // hash left stale
    let reject = negotiate(&s, &r).unwrap_err();
    assert_eq!(reject.reason, RejectReason::CompatibilityMismatch);
    assert!(reject
        .message
        .contains("group#1 head dim: local 128, remote 256"));
}

/// Pools are local memory details: region ids, layer split and slot padding are not compared.
#[test]
fn pool_details_do_not_affect_compatibility() {
    let (s, mut r) = pair();
    r.groups[0].pools[0].region = RegionId(77);
    r.groups[0].pools[1].slot_bytes += 512;
    r.groups[0].pools.swap(0, 1);
    r.groups[1].pools.clear();
    assert_eq!(compat_hash(&r.groups), compat_hash(&sample_groups()));
    assert!(negotiate(&s, &r).is_ok());
}

#[test]
fn every_geometry_field_feeds_the_hash() {
    let base = sample_groups();
    let h = compat_hash(&base);
    let edits: [fn(&mut LayerGroupLayout); 6] = [
        |g| g.shard.model_layers += 1,
        |g| g.kv_factor = 1,
        |g| g.shard.model_kv_heads += 1,
        |g| g.head_dim += 1,
        |g| g.elem_bytes = 1,
        |g| g.tokens_per_block += 1,
    ];
    for (i, edit) in edits.iter().enumerate() {
        let mut groups = base.clone();
        edit(&mut groups[1]);
        assert_ne!(compat_hash(&groups), h, "edit {i}");
    }
    // What a rank holds and its window are not model geometry: they leave the hash alone.
    let same: [fn(&mut LayerGroupLayout); 5] = [
        |g| g.layers -= 1,
        |g| g.shard.first_layer += 1,
        |g| g.kv_heads = 2,
        |g| g.shard.first_head = 0,
        |g| g.window = None,
    ];
    for (i, edit) in same.iter().enumerate() {
        let mut groups = base.clone();
        edit(&mut groups[1]);
        assert_eq!(compat_hash(&groups), h, "edit {i}");
    }
    // A whole-model shard left at its default hashes as the explicit one.
    let mut groups = base.clone();
    for g in &mut groups {
        g.kv_heads = g.shard.model_kv_heads;
        g.shard = Default::default();
    }
    assert_eq!(compat_hash(&groups), h);
    // Order matters: swapping the groups changes the hash.
    let mut swapped = base.clone();
    swapped.swap(0, 1);
    assert_ne!(compat_hash(&swapped), h);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn negotiation_picks_the_highest_common_version(
        a in (1u16..40, 0u16..10), b in (1u16..40, 0u16..10),
    ) {
        let (mut s, mut r) = pair();
        s.versions = range(a.0, a.0 + a.1);
        r.versions = range(b.0, b.0 + b.1);
        let expected = (1..=60u16).rev().find(|v| s.versions.contains(*v) && r.versions.contains(*v));
        prop_assert_eq!(common_version(s.versions, r.versions), expected);
        match (negotiate(&s, &r), expected) {
            (Ok(accept), Some(v)) => prop_assert_eq!(accept.version, v),
            (Err(reject), None) => prop_assert_eq!(reject.reason, RejectReason::VersionMismatch),
            (got, want) => prop_assert!(false, "{:?} vs {:?}", got, want),
        }
        // Both sides reach the same decision.
        prop_assert_eq!(
            negotiate(&s, &r).map(|a| a.version).map_err(|r| r.reason),
            negotiate(&r, &s).map(|a| a.version).map_err(|r| r.reason)
        );
    }
}

/// Each side's part of the model must match its tensor rank: another rank's heads, heads that
/// cannot be split over the ranks, or layers past the model are refused at the handshake,
/// naming the side and the group, with the same verdict on both ends.
#[test]
fn a_shard_that_does_not_match_its_rank_is_a_topology_mismatch() {
    type Edit = fn(&mut Hello);
    let cases: [(Edit, &str); 3] = [
        (|h| h.topology.tp_rank = 0, "holds KV heads 0..+8"),
        (|h| h.topology.tp_size = 3, "cannot be split over 3"),
        (
            |h| h.groups[1].shard.first_layer = 1,
            "layers 1..+4 of a group of 4",
        ),
    ];
    for (edit, text) in cases {
        let (s, mut r) = pair();
        edit(&mut r);
        for (local, remote, side) in [(&s, &r, "remote"), (&r, &s, "local")] {
            let reject = negotiate(local, remote).unwrap_err();
            assert_eq!(
                reject.reason,
                RejectReason::TopologyMismatch,
                "{}",
                reject.message
            );
            assert!(reject.message.contains(text), "{}", reject.message);
            assert!(
                reject.message.contains(&format!("{side} group#")),
                "{}",
                reject.message
            );
        }
    }
}
