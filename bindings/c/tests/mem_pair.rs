//! The C ABI over the in-process transport, called from Rust: a two-chunk transfer with the
//! block source as an `extern "C"` callback, every destination byte checked, and refused calls
//! returning their status and the core's message.

use std::ffi::{c_void, CStr};
use std::ptr;

use kvpipe_c::*;

const TPB: u32 = 4;
/// kv factor 2 × one head × 4 tokens × 8 dims × 2 bytes × 2 layers.
const SLOT: usize = 2 * 4 * 8 * 2 * 2;
const SLOTS: usize = 16;

fn message() -> String {
    // SAFETY: the thread's NUL-terminated message.
    unsafe { CStr::from_ptr(kvpipe_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

unsafe extern "C" fn source(
    _user: *mut c_void,
    _request: u64,
    _group: u16,
    begin: u32,
    end: u32,
    out: *mut kvpipe_block_run,
) -> i32 {
    // SAFETY: kvpipe hands a valid run with `end - begin` entries.
    let out = unsafe { &mut *out };
    out.first_ordinal = begin;
    out.len = (end - begin) as usize;
    for o in begin..end {
        // SAFETY: `o - begin < capacity`.
        unsafe { *out.ids.add((o - begin) as usize) = 2 + o };
    }
    kvpipe_block_source_status::KVPIPE_BLOCK_SOURCE_OK as i32
}

/// The engine's own block table: ordinal `o` lives in slot `2 + o`.
static TABLE: [u32; SLOTS] = {
    let mut t = [0; SLOTS];
    let mut o = 0;
    while o < SLOTS {
        t[o] = 2 + o as u32;
        o += 1;
    }
    t
};

/// The same answers as `source`, given by pointing `ids` at the engine's own table instead of
/// filling the buffer kvpipe handed over.
unsafe extern "C" fn repointed(
    _user: *mut c_void,
    _request: u64,
    _group: u16,
    begin: u32,
    end: u32,
    out: *mut kvpipe_block_run,
) -> i32 {
    // SAFETY: kvpipe hands a valid run.
    let out = unsafe { &mut *out };
    out.first_ordinal = begin;
    out.len = (end - begin) as usize;
    out.ids = TABLE[begin as usize..].as_ptr().cast_mut();
    kvpipe_block_source_status::KVPIPE_BLOCK_SOURCE_OK as i32
}

/// A block source whose run stops one block short of the asked end.
unsafe extern "C" fn ends_early(
    user: *mut c_void,
    request: u64,
    group: u16,
    begin: u32,
    end: u32,
    out: *mut kvpipe_block_run,
) -> i32 {
    // SAFETY: as `source`.
    let status = unsafe { source(user, request, group, begin, end, out) };
    // SAFETY: the run `source` just filled.
    let out = unsafe { &mut *out };
    out.len = out.len.saturating_sub(1);
    status
}

fn config(group: &kvpipe_layer_group, region: &kvpipe_region) -> kvpipe_node_config {
    kvpipe_node_config {
        groups: group,
        group_count: 1,
        regions: region,
        region_count: 1,
        deadlines: ptr::null(),
        topology: ptr::null(),
        instance: 0,
        grant_seed: 0,
        tcp_connections: 0,
        layer_order: ptr::null(),
        layer_order_count: 0,
    }
}

fn poll(f: &dyn Fn(*mut kvpipe_event) -> kvpipe_status, kind: kvpipe_event_kind) -> kvpipe_event {
    for _ in 0..500 {
        let mut ev = std::mem::MaybeUninit::<kvpipe_event>::uninit();
        match f(ev.as_mut_ptr()) {
            kvpipe_status::KVPIPE_NO_EVENT => continue,
            kvpipe_status::KVPIPE_OK => {
                // SAFETY: a poll returning KVPIPE_OK wrote the event.
                let ev = unsafe { ev.assume_init() };
                if ev.kind == kind {
                    return ev;
                }
            }
            s => panic!("{s:?}: {}", message()),
        }
    }
    panic!("no {kind:?} in 5 s");
}

#[test]
fn in_process_transfer_through_the_abi() {
    let mut src: Vec<u8> = (0..SLOT * SLOTS).map(|i| (i * 7 % 253) as u8 + 1).collect();
    let mut dst = vec![0u8; SLOT * SLOTS];
    let pool = |region| kvpipe_pool {
        region,
        layer_begin: 0,
        layers: 2,
        slot_bytes: SLOT as u64,
    };
    let (spool, rpool) = (pool(1), pool(9));
    let group = |pools: &kvpipe_pool| kvpipe_layer_group {
        layers: 2,
        kv_factor: 2,
        kv_heads: 1,
        head_dim: 8,
        elem_bytes: 2,
        tokens_per_block: TPB,
        window: 0,
        pools,
        pool_count: 1,
        model_layers: 0,
        first_layer: 0,
        model_kv_heads: 0,
        first_head: 0,
    };
    let (sgroup, rgroup) = (group(&spool), group(&rpool));
    let sregion = kvpipe_region {
        id: 1,
        ptr: src.as_mut_ptr().cast(),
        len: src.len(),
    };
    let rregion = kvpipe_region {
        id: 9,
        ptr: dst.as_mut_ptr().cast(),
        len: dst.len(),
    };
    let (scfg, rcfg) = (config(&sgroup, &sregion), config(&rgroup, &rregion));
    let (mut tx, mut rx) = (ptr::null_mut(), ptr::null_mut());
    // A layer order that lists one of the group's two layers is refused, naming the count.
    let short = [0u16];
    let bad = kvpipe_node_config {
        layer_order: short.as_ptr(),
        layer_order_count: 1,
        ..config(&sgroup, &sregion)
    };
    // SAFETY: valid configs; no node is made.
    let refused = unsafe { kvpipe_mem_pair_new(&bad, &rcfg, &mut tx, &mut rx) };
    assert_eq!(refused, kvpipe_status::KVPIPE_ERR_CONFIG, "{}", message());
    assert!(
        message().contains("layer order lists group#0 1 times"),
        "{}",
        message()
    );
    assert!(tx.is_null() && rx.is_null());
    // A zero heartbeat interval (a node that would spin) is refused, naming the field.
    let mut zero = std::mem::MaybeUninit::<kvpipe_deadlines>::uninit();
    // SAFETY: a valid out pointer.
    unsafe { kvpipe_deadlines_default(zero.as_mut_ptr()) };
    // SAFETY: kvpipe_deadlines_default filled it.
    let mut zero = unsafe { zero.assume_init() };
    zero.heartbeat_interval_ms = 0;
    let bad = kvpipe_node_config {
        deadlines: &zero,
        ..config(&sgroup, &sregion)
    };
    // SAFETY: valid configs; no node is made.
    let refused = unsafe { kvpipe_mem_pair_new(&bad, &rcfg, &mut tx, &mut rx) };
    assert_eq!(refused, kvpipe_status::KVPIPE_ERR_CONFIG, "{}", message());
    assert!(
        message().contains("heartbeat_interval is zero"),
        "{}",
        message()
    );
    assert!(tx.is_null() && rx.is_null());
    // SAFETY: valid configs; `src` and `dst` outlive both nodes (freed below).
    unsafe {
        assert_eq!(
            kvpipe_mem_pair_new(&scfg, &rcfg, &mut tx, &mut rx),
            kvpipe_status::KVPIPE_OK,
            "{}",
            message()
        );
        let port = ptr::null_mut();
        assert_eq!(
            kvpipe_receiver_listen(rx, c"127.0.0.1:0".as_ptr(), port),
            kvpipe_status::KVPIPE_ERR_UNSUPPORTED
        );
        assert!(message().contains("not available on the mem transport"));
        assert_eq!(
            kvpipe_sender_poll_event(ptr::null(), 0, ptr::null_mut()),
            kvpipe_status::KVPIPE_ERR_INVALID_ARGUMENT
        );

        let (tx, rx) = (tx as *const kvpipe_sender, rx as *const kvpipe_receiver);
        // A timeout too long for the clock waits until the event comes.
        let ready_peer_of_sender = poll(
            &|ev| kvpipe_sender_poll_event(tx, u64::MAX, ev),
            kvpipe_event_kind::KVPIPE_EVENT_PEER_READY,
        )
        .peer;
        let ready = poll(
            &|ev| kvpipe_receiver_poll_event(rx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_PEER_READY,
        );
        // 10 tokens: 3 blocks, landing in slots 10, 11, 12.
        let ids = [10u32, 11, 12];
        let list = kvpipe_block_list {
            first_ordinal: 0,
            ids: ids.as_ptr(),
            count: 3,
        };
        let too_many = [list, list];
        let mut reg = kvpipe_registration {
            request: 5,
            prompt_len: 10,
            groups: too_many.as_ptr(),
            group_count: 2,
            writers: &ready.peer,
            writer_count: 1,
            aux_capacity: 256,
        };
        assert_eq!(
            kvpipe_receiver_register(rx, &reg, ptr::null_mut()),
            kvpipe_status::KVPIPE_ERR_USAGE
        );
        assert!(
            message().contains("2 layer groups given, the layout has 1"),
            "{}",
            message()
        );
        // One slot named for two ordinals: refused at the call, naming the block.
        let repeated_ids = [10u32, 11, 10];
        let repeated = [kvpipe_block_list {
            ids: repeated_ids.as_ptr(),
            ..list
        }];
        reg.groups = repeated.as_ptr();
        reg.group_count = 1;
        assert_eq!(
            kvpipe_receiver_register(rx, &reg, ptr::null_mut()),
            kvpipe_status::KVPIPE_ERR_USAGE
        );
        assert!(
            message().contains("names blk#10 twice in layer group 0"),
            "{}",
            message()
        );
        reg.groups = too_many.as_ptr();
        assert_eq!(
            kvpipe_receiver_register(rx, &reg, ptr::null_mut()),
            kvpipe_status::KVPIPE_OK
        );
        let peer = 2u32;
        assert_eq!(
            kvpipe_sender_open(tx, 5, &peer, 1),
            kvpipe_status::KVPIPE_OK
        );
        for (start, end, is_last) in [(0, 6, false), (6, 10, true)] {
            let chunk = kvpipe_chunk {
                start,
                end,
                prompt_len: 10,
                prepopulated_len: 0,
                is_last,
                prefix_sent_early: false,
            };
            let mut slice = 0;
            // The last chunk's blocks come from the engine's own table (checked below).
            let callback = if is_last { repointed } else { source };
            let s = kvpipe_sender_submit_chunk(
                tx,
                5,
                &chunk,
                Some(callback),
                ptr::null_mut(),
                &mut slice,
            );
            assert_eq!(s, kvpipe_status::KVPIPE_OK, "{}", message());
            assert_ne!(slice, KVPIPE_NO_SLICE);
        }
        let aux = kvpipe_aux {
            prompt_tokens: 10,
            cached_tokens: 0,
            first_tokens: &7,
            first_token_count: 1,
            draft_tokens: ptr::null(),
            draft_token_count: 0,
        };
        assert_eq!(
            kvpipe_sender_submit_aux(tx, 5, &aux),
            kvpipe_status::KVPIPE_OK
        );
        let done = poll(
            &|ev| kvpipe_receiver_poll_event(rx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_COMPLETED,
        );
        assert_eq!(done.bytes_written, 3 * SLOT as u64);
        assert_eq!(*done.first_tokens, 7);
        poll(
            &|ev| kvpipe_receiver_poll_event(rx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_QUIESCED,
        );
        poll(
            &|ev| kvpipe_sender_poll_event(tx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_QUIESCED,
        );
        // The registration's three blocks were pinned and, quiesced, released; the request is
        // still held until it is retired.
        let mut c = kvpipe_counters::default();
        assert_eq!(
            kvpipe_receiver_counters(rx, &mut c),
            kvpipe_status::KVPIPE_OK
        );
        assert_eq!((c.blocks_pinned, c.blocks_released, c.sessions), (3, 3, 1));

        // A block source that breaks its contract (a run ending early): the request
        // fails on both sides, and the call says so with its own status, not a usage error's.
        assert_eq!(
            kvpipe_sender_open(tx, 6, &peer, 1),
            kvpipe_status::KVPIPE_OK
        );
        let chunk = kvpipe_chunk {
            start: 0,
            end: 6,
            prompt_len: 10,
            prepopulated_len: 0,
            is_last: false,
            prefix_sent_early: false,
        };
        let mut slice = 0;
        let s = kvpipe_sender_submit_chunk(
            tx,
            6,
            &chunk,
            Some(ends_early),
            ptr::null_mut(),
            &mut slice,
        );
        assert_eq!(s, kvpipe_status::KVPIPE_ERR_ENGINE_FAULT, "{}", message());
        assert!(
            message().contains("does not end at the asked end"),
            "{}",
            message()
        );
        assert_eq!(slice, KVPIPE_NO_SLICE);
        let failed = poll(
            &|ev| kvpipe_sender_poll_event(tx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_FAILED,
        );
        assert_eq!(failed.request, 6);
        assert_eq!(
            failed.status,
            kvpipe_transfer_status::KVPIPE_TRANSFER_ENGINE_ERROR
        );
        // Closing the decode node is heard on the prefill node, no request open: PEER_LOST,
        // closed by the peer (no deadline of this side's).
        assert_eq!(kvpipe_receiver_close(rx, 5000), kvpipe_status::KVPIPE_OK);
        let lost = poll(
            &|ev| kvpipe_sender_poll_event(tx, 10, ev),
            kvpipe_event_kind::KVPIPE_EVENT_PEER_LOST,
        );
        assert_eq!(lost.peer, ready_peer_of_sender);
        assert_eq!(
            lost.status,
            kvpipe_transfer_status::KVPIPE_TRANSFER_PEER_LOST
        );
        assert_eq!(lost.waiting_for, kvpipe_wait::KVPIPE_WAIT_NONE);
        kvpipe_sender_free(tx as *mut _);
        kvpipe_receiver_free(rx as *mut _);
    }
    for slot in 0..SLOTS {
        let got = &dst[slot * SLOT..(slot + 1) * SLOT];
        match slot {
            10..=12 => {
                let from = slot - 10 + 2;
                assert_eq!(got, &src[from * SLOT..(from + 1) * SLOT], "slot {slot}");
            }
            _ => assert!(got.iter().all(|&b| b == 0), "slot {slot} untouched"),
        }
    }
}
