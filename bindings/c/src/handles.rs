//! The handles and every entry point on them.

use std::ffi::{c_char, c_void};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvpipe::{mem_pair, DecodeNode, EmbedError, Node, PrefillNode, Role};
use kvpipe_core::session::SendRequest;
use kvpipe_core::{LayerRange, PeerId, RequestId, SenderSliceId, Submitted};

use crate::event::{kvpipe_event, EventStorage};
use crate::source::{kvpipe_block_source_fn, CallbackSource};
use crate::status::{guard, kvpipe_status, kvpipe_status::*, Failure};
use crate::types::{
    aux_data, chunk_spec, kvpipe_aux, kvpipe_chunk, kvpipe_node_config, kvpipe_registration,
    read_config, reference, registration, slice, string,
};

/// A prefill-side node (a core sender over TCP or in process). Opaque.
pub struct kvpipe_sender {
    node: PrefillNode,
    storage: Mutex<EventStorage>,
}

/// A decode-side node (a core receiver over TCP or in process). Opaque.
pub struct kvpipe_receiver {
    node: DecodeNode,
    storage: Mutex<EventStorage>,
}

/// What an endpoint has done so far (the core's counters).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvpipe_counters {
    /// Bytes the transport reported written (prefill) or the writers reported (decode).
    pub bytes_written: u64,
    /// (Decode) payload bytes of admitted writes that landed.
    pub bytes_landed: u64,
    /// Requests completed.
    pub completions: u64,
    /// Requests failed, timed out or cancelled.
    pub failures: u64,
    /// Requests quiesced.
    pub quiesced: u64,
    /// Requests retired.
    pub retirements: u64,
    /// (Decode) data writes refused by admission.
    pub writes_refused: u64,
    /// Protocol errors seen from peers.
    pub protocol_errors: u64,
    /// Blocks the requests named (registered, or given by the block source), counted when
    /// they were taken.
    pub blocks_pinned: u64,
    /// Of `blocks_pinned`, those whose request quiesced: the engine may reuse them.
    /// `blocks_pinned - blocks_released` blocks are pinned now.
    pub blocks_released: u64,
    /// Requests held: opened (prefill) or registered (decode) and not retired yet.
    pub sessions: u64,
}

/// `KVPIPE_NO_SLICE` in `*slice_out` when a chunk completes no block.
const NO_SLICE: u32 = SenderSliceId::NONE.0;

unsafe fn handle<'a, T>(ptr: *const T) -> Result<&'a T, Failure> {
    // SAFETY: null or a live handle made by this library (the caller's promise).
    unsafe { reference(ptr, "the handle") }
}

/// Writes `value` to `out` when `out` is not null.
///
/// # Safety
/// `out` is null or writable.
unsafe fn put<T>(out: *mut T, value: T) {
    // SAFETY: null or writable (the caller's promise).
    if let Some(out) = unsafe { out.as_mut() } {
        *out = value;
    }
}

fn poll<E: Role>(
    node: &Node<E>,
    storage: &Mutex<EventStorage>,
    timeout_ms: u64,
    out: *mut kvpipe_event,
) -> Result<kvpipe_status, Failure> {
    if out.is_null() {
        return Err(Failure::invalid("out is null"));
    }
    match node.next_event(Duration::from_millis(timeout_ms))? {
        None => Ok(KVPIPE_NO_EVENT),
        Some(event) => {
            let value = storage
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .fill(&event);
            // SAFETY: `out` is not null and the caller gave it for writing.
            unsafe { out.write(value) };
            Ok(KVPIPE_OK)
        }
    }
}

fn counters<E: Role>(node: &Node<E>, out: *mut kvpipe_counters) -> Result<kvpipe_status, Failure> {
    if out.is_null() {
        return Err(Failure::invalid("out is null"));
    }
    let c = node.counters()?;
    let sessions = node.session_count()? as u64;
    let value = kvpipe_counters {
        bytes_written: c.bytes_written,
        bytes_landed: c.bytes_landed,
        completions: c.completions,
        failures: c.failures.total(),
        quiesced: c.quiesced,
        retirements: c.retirements,
        writes_refused: c.writes_refused,
        protocol_errors: c.protocol_errors,
        blocks_pinned: c.blocks_pinned,
        blocks_released: c.blocks_released,
        sessions,
    };
    // SAFETY: not null, writable (the caller's promise).
    unsafe { out.write(value) };
    Ok(KVPIPE_OK)
}

unsafe fn listen<E: Role>(
    node: &Node<E>,
    addr: *const c_char,
    port_out: *mut u16,
) -> Result<kvpipe_status, Failure> {
    // SAFETY: forwarded from the caller.
    let addr = unsafe { string(addr, "addr") }?;
    let bound = node.listen(addr)?;
    // SAFETY: forwarded from the caller.
    unsafe { put(port_out, bound.port()) };
    Ok(KVPIPE_OK)
}

unsafe fn connect<E: Role>(
    node: &Node<E>,
    addr: *const c_char,
    peer_out: *mut u32,
) -> Result<kvpipe_status, Failure> {
    // SAFETY: forwarded from the caller.
    let addr = unsafe { string(addr, "addr") }?;
    let peer = node.connect(addr)?;
    // SAFETY: forwarded from the caller.
    unsafe { put(peer_out, peer.0) };
    Ok(KVPIPE_OK)
}

fn ok(r: Result<(), EmbedError>) -> Result<kvpipe_status, Failure> {
    r?;
    Ok(KVPIPE_OK)
}

// ----- making and freeing nodes -----

/// Makes a prefill node over TCP reading source bytes from `config`'s regions, into `*out`.
/// Connect it to decode nodes with [`kvpipe_sender_connect`] (or let them connect after
/// [`kvpipe_sender_listen`]).
///
/// # Safety
/// `config` follows [`kvpipe_node_config`]'s field docs and its regions stay valid until the
/// node is freed; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_tcp_sender_new(
    config: *const kvpipe_node_config,
    out: *mut *mut kvpipe_sender,
) -> kvpipe_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("out is null"));
        }
        // SAFETY: forwarded from the caller.
        let c = unsafe { read_config(config) }?;
        // SAFETY: the caller keeps the regions valid until the node is freed.
        let node = unsafe { PrefillNode::tcp(&c.node, &c.regions) }?;
        let handle = Box::new(kvpipe_sender {
            node,
            storage: Mutex::default(),
        });
        // SAFETY: `out` is not null and writable.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(KVPIPE_OK)
    })
}

/// Makes a decode node over TCP landing admitted writes in `config`'s regions, into `*out`.
///
/// # Safety
/// As [`kvpipe_tcp_sender_new`].
#[no_mangle]
pub unsafe extern "C" fn kvpipe_tcp_receiver_new(
    config: *const kvpipe_node_config,
    out: *mut *mut kvpipe_receiver,
) -> kvpipe_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("out is null"));
        }
        // SAFETY: forwarded from the caller.
        let c = unsafe { read_config(config) }?;
        // SAFETY: the caller keeps the regions valid until the node is freed.
        let node = unsafe { DecodeNode::tcp(&c.node, &c.regions) }?;
        let handle = Box::new(kvpipe_receiver {
            node,
            storage: Mutex::default(),
        });
        // SAFETY: `out` is not null and writable.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(KVPIPE_OK)
    })
}

/// Makes a prefill and a decode node connected in this process (memory copies on the
/// transport's copy threads), into `*sender_out` and `*receiver_out`. The handshake completes
/// as the nodes are polled; the prefill node names the decode node peer 2, the decode node
/// names the prefill node peer 1. Free both.
///
/// # Safety
/// As [`kvpipe_tcp_sender_new`], for both configurations; the regions stay valid until both
/// nodes are freed.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_mem_pair_new(
    sender_config: *const kvpipe_node_config,
    receiver_config: *const kvpipe_node_config,
    sender_out: *mut *mut kvpipe_sender,
    receiver_out: *mut *mut kvpipe_receiver,
) -> kvpipe_status {
    guard(|| {
        if sender_out.is_null() || receiver_out.is_null() {
            return Err(Failure::invalid("sender_out or receiver_out is null"));
        }
        // SAFETY: forwarded from the caller.
        let s = unsafe { read_config(sender_config) }?;
        // SAFETY: forwarded from the caller.
        let r = unsafe { read_config(receiver_config) }?;
        // SAFETY: the caller keeps the regions valid until both nodes are freed.
        let (tx, rx) = unsafe { mem_pair(&s.node, &s.regions, &r.node, &r.regions) }?;
        let tx = Box::new(kvpipe_sender {
            node: tx,
            storage: Mutex::default(),
        });
        let rx = Box::new(kvpipe_receiver {
            node: rx,
            storage: Mutex::default(),
        });
        // SAFETY: both are not null and writable.
        unsafe {
            sender_out.write(Box::into_raw(tx));
            receiver_out.write(Box::into_raw(rx));
        }
        Ok(KVPIPE_OK)
    })
}

/// Closes the node: over TCP every peer in order (what was queued reaches it first), waiting
/// at most `within_ms`. The handle stays allocated (free it); later calls return
/// `KVPIPE_ERR_CLOSED`.
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_close(
    sender: *const kvpipe_sender,
    within_ms: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| {
        ok(unsafe { handle(sender) }?
            .node
            .close(Duration::from_millis(within_ms)))
    })
}

/// See [`kvpipe_sender_close`].
///
/// # Safety
/// `receiver` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_close(
    receiver: *const kvpipe_receiver,
    within_ms: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| {
        ok(unsafe { handle(receiver) }?
            .node
            .close(Duration::from_millis(within_ms)))
    })
}

/// Frees a node (closing it first if needed, bounded by the TCP close grace). Null is ignored.
///
/// No other call may be using the handle, a thread blocked in `kvpipe_sender_poll_event`
/// included: close the handle first (which wakes such a poll with `KVPIPE_ERR_CLOSED`), join
/// the threads that use it, then free it.
///
/// # Safety
/// `sender` is null or a live handle no other call is using; it is invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_free(sender: *mut kvpipe_sender) {
    if !sender.is_null() {
        // SAFETY: made by Box::into_raw in this library; the caller gives it up.
        guard(|| {
            drop(unsafe { Box::from_raw(sender) });
            Ok(KVPIPE_OK)
        });
    }
}

/// See [`kvpipe_sender_free`].
///
/// # Safety
/// `receiver` is null or a live handle no other call is using; it is invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_free(receiver: *mut kvpipe_receiver) {
    if !receiver.is_null() {
        // SAFETY: made by Box::into_raw in this library; the caller gives it up.
        guard(|| {
            drop(unsafe { Box::from_raw(receiver) });
            Ok(KVPIPE_OK)
        });
    }
}

// ----- connections and events (both roles) -----

/// Accepts peers on `addr` (`"127.0.0.1:0"` picks a free port), writing the bound port to
/// `*port_out` (may be null). TCP only.
///
/// # Safety
/// `sender` is a live handle, `addr` a NUL-terminated string, `port_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_listen(
    sender: *const kvpipe_sender,
    addr: *const c_char,
    port_out: *mut u16,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { listen(&handle(sender)?.node, addr, port_out) })
}

/// See [`kvpipe_sender_listen`].
///
/// # Safety
/// As [`kvpipe_sender_listen`].
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_listen(
    receiver: *const kvpipe_receiver,
    addr: *const c_char,
    port_out: *mut u16,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { listen(&handle(receiver)?.node, addr, port_out) })
}

/// Connects to a node listening at `addr` (`"host:port"`), writing the id this node gives the
/// peer to `*peer_out` (may be null). The handshake goes on in the background:
/// `KVPIPE_EVENT_PEER_READY` or `KVPIPE_EVENT_PEER_REJECTED` follows. TCP only.
///
/// # Safety
/// `sender` is a live handle, `addr` a NUL-terminated string, `peer_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_connect(
    sender: *const kvpipe_sender,
    addr: *const c_char,
    peer_out: *mut u32,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { connect(&handle(sender)?.node, addr, peer_out) })
}

/// See [`kvpipe_sender_connect`].
///
/// # Safety
/// As [`kvpipe_sender_connect`].
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_connect(
    receiver: *const kvpipe_receiver,
    addr: *const c_char,
    peer_out: *mut u32,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { connect(&handle(receiver)?.node, addr, peer_out) })
}

/// Waits up to `timeout_ms` for the node's next event: `KVPIPE_OK` with `*out` filled, or
/// `KVPIPE_NO_EVENT`. `out`'s pointers stay valid until the next poll on this handle.
///
/// # Safety
/// `sender` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_poll_event(
    sender: *const kvpipe_sender,
    timeout_ms: u64,
    out: *mut kvpipe_event,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        poll(&h.node, &h.storage, timeout_ms, out)
    })
}

/// See [`kvpipe_sender_poll_event`].
///
/// # Safety
/// `receiver` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_poll_event(
    receiver: *const kvpipe_receiver,
    timeout_ms: u64,
    out: *mut kvpipe_event,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(receiver) }?;
        poll(&h.node, &h.storage, timeout_ms, out)
    })
}

/// Writes the core's counters to `*out`.
///
/// # Safety
/// `sender` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_counters(
    sender: *const kvpipe_sender,
    out: *mut kvpipe_counters,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| counters(&unsafe { handle(sender) }?.node, out))
}

/// See [`kvpipe_sender_counters`].
///
/// # Safety
/// `receiver` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_counters(
    receiver: *const kvpipe_receiver,
    out: *mut kvpipe_counters,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| counters(&unsafe { handle(receiver) }?.node, out))
}

// ----- prefill side -----

/// Opens `request` before its first chunk, naming the decode peers it is written to (each
/// registers it). Registrations that arrived before are adopted now.
///
/// # Safety
/// `sender` is a live handle; `receivers` points to `receiver_count` ids.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_open(
    sender: *const kvpipe_sender,
    request: u64,
    receivers: *const u32,
    receiver_count: usize,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        // SAFETY: forwarded from the caller.
        let peers = unsafe { slice(receivers, receiver_count, "receivers") }?;
        let req = SendRequest::new(RequestId(request), peers.iter().copied().map(PeerId));
        ok(h.node.open_request(req))
    })
}

fn submit_with_callback(
    source: kvpipe_block_source_fn,
    user: *mut c_void,
    slice_out: *mut u32,
    submit: impl FnOnce(&mut CallbackSource) -> Result<Submitted, EmbedError>,
) -> Result<kvpipe_status, Failure> {
    let callback = source.ok_or_else(|| Failure::invalid("the block source callback is null"))?;
    let mut source = CallbackSource::new(callback, user);
    let result = submit(&mut source);
    if let Some(status) = source.unknown_status {
        return Err(Failure::invalid(format!(
            "the block source callback returned {status}, which is no kvpipe_block_source_status"
        )));
    }
    let outcome = result?;
    // SAFETY: null or writable (the caller's promise).
    unsafe { put(slice_out, outcome.slice().map_or(NO_SLICE, |s| s.0)) };
    match outcome {
        Submitted::EngineFault(fault) => Err(Failure {
            status: KVPIPE_ERR_ENGINE_FAULT,
            message: fault.to_string(),
        }),
        Submitted::Slice(_) | Submitted::Nothing => Ok(KVPIPE_OK),
    }
}

/// Submits a prefill chunk of `request` just computed. The core asks `source` (called with
/// `user` on this thread, before this returns) for the chunk's blocks of each layer group, then
/// the transport writes them to every decode peer that registered. Writes the slice id to
/// `*slice_out` (may be null), or `KVPIPE_NO_SLICE` when the chunk completes no block.
///
/// The chunk's blocks are read by the transport after this returns: leave them unchanged until
/// the request's `KVPIPE_EVENT_QUIESCED`.
///
/// # Safety
/// `sender` is a live handle, `chunk` readable, `source` a valid callback for `user`,
/// `slice_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_submit_chunk(
    sender: *const kvpipe_sender,
    request: u64,
    chunk: *const kvpipe_chunk,
    source: kvpipe_block_source_fn,
    user: *mut c_void,
    slice_out: *mut u32,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        // SAFETY: forwarded from the caller.
        let spec = chunk_spec(unsafe { reference(chunk, "chunk") }?);
        submit_with_callback(source, user, slice_out, |src| {
            h.node.submit_chunk(RequestId(request), spec, src)
        })
    })
}

/// Submits layers `[layer_begin, layer_end)` of a prefill chunk of `request`, as soon as the
/// engine has computed them, so the last chunk's transfer overlaps its own compute (vLLM's
/// `save_kv_layer`, TensorRT-LLM's `KVSlice.layer_range`). Layers count the rank's layers in the
/// order the engine computes them (`kvpipe_node_config.layer_order`; by default the layer
/// groups one after the other), up to `kvpipe_sender_layer_count`. A chunk's ranges come in
/// order, the first from layer 0, each starting where the previous one ended, the last ending
/// at the layer count, all with the same `chunk`; the next chunk only after that. Only the
/// first range calls `source` (for the chunk's blocks); later ranges write their layers of
/// those blocks. Writes the range's slice id to `*slice_out` (may be null), or
/// `KVPIPE_NO_SLICE` when it writes nothing. A range out of order, empty or past the layer
/// count is `KVPIPE_ERR_USAGE`, with nothing changed.
///
/// The chunk's blocks are read by the transport after this returns: leave them unchanged until
/// the request's `KVPIPE_EVENT_QUIESCED`.
///
/// # Safety
/// As [`kvpipe_sender_submit_chunk`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpipe_sender_submit_chunk_layers(
    sender: *const kvpipe_sender,
    request: u64,
    chunk: *const kvpipe_chunk,
    layer_begin: u32,
    layer_end: u32,
    source: kvpipe_block_source_fn,
    user: *mut c_void,
    slice_out: *mut u32,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        // SAFETY: forwarded from the caller.
        let spec = chunk_spec(unsafe { reference(chunk, "chunk") }?);
        let layers = LayerRange::new(layer_begin, layer_end);
        submit_with_callback(source, user, slice_out, |src| {
            h.node
                .submit_chunk_layers(RequestId(request), spec, layers, src)
        })
    })
}

/// Writes the sender rank's layer count (every layer group's layers) to `*out`: a chunk
/// submitted with `kvpipe_sender_submit_chunk_layers` ends with the range that reaches it.
///
/// # Safety
/// `sender` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_layer_count(
    sender: *const kvpipe_sender,
    out: *mut u32,
) -> kvpipe_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("out is null"));
        }
        // SAFETY: forwarded from the caller.
        let count = unsafe { handle(sender) }?.node.layer_count()?;
        // SAFETY: not null, writable (the caller's promise).
        unsafe { put(out, count) };
        Ok(KVPIPE_OK)
    })
}

/// Sends `request`'s cached prefix (`prepopulated_len` tokens) before its first chunk, so only
/// the computed part waits for prefill; its chunks then set `prefix_sent_early`. Writes the
/// slice id to `*slice_out` (may be null), or `KVPIPE_NO_SLICE` when the prefix fills no block.
///
/// # Safety
/// As [`kvpipe_sender_submit_chunk`].
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_submit_prefix(
    sender: *const kvpipe_sender,
    request: u64,
    prompt_len: u32,
    prepopulated_len: u32,
    source: kvpipe_block_source_fn,
    user: *mut c_void,
    slice_out: *mut u32,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        submit_with_callback(source, user, slice_out, |src| {
            h.node
                .submit_prefix(RequestId(request), prompt_len, prepopulated_len, src)
        })
    })
}

/// Submits `request`'s aux data (first generated tokens, draft tokens, counts); it travels
/// inline after the KV. A transfer completes only with it. Aux data at or after the request's
/// aux deadline times the request out (its event says so) and returns `KVPIPE_ERR_USAGE`
/// (the request already ended).
///
/// # Safety
/// `sender` is a live handle; `aux` and its token pointers are readable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_submit_aux(
    sender: *const kvpipe_sender,
    request: u64,
    aux: *const kvpipe_aux,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(sender) }?;
        // SAFETY: forwarded from the caller.
        let data = unsafe { aux_data(reference(aux, "aux")?) }?;
        ok(h.node.submit_aux(RequestId(request), data))
    })
}

/// Cancels `request` (in any phase; a request not opened yet is cancelled when it is).
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_cancel(
    sender: *const kvpipe_sender,
    request: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| ok(unsafe { handle(sender) }?.node.cancel(RequestId(request))))
}

/// Retires `request` after its `KVPIPE_EVENT_QUIESCED`; its id is never used again.
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_sender_retire(
    sender: *const kvpipe_sender,
    request: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| ok(unsafe { handle(sender) }?.node.retire(RequestId(request))))
}

// ----- decode side -----

/// Registers a request's destination blocks and its writers, before its prefill starts.
/// Writes the registration's id to `*slice_out` (may be null).
///
/// # Safety
/// `receiver` is a live handle; `registration` and its pointers are readable; `slice_out` null
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_register(
    receiver: *const kvpipe_receiver,
    registration: *const kvpipe_registration,
    slice_out: *mut u32,
) -> kvpipe_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(receiver) }?;
        // SAFETY: forwarded from the caller.
        let reg = unsafe { self::registration(reference(registration, "registration")?) }?;
        let slice = h.node.register(reg)?;
        // SAFETY: null or writable (the caller's promise).
        unsafe { put(slice_out, slice.0) };
        Ok(KVPIPE_OK)
    })
}

/// Cancels `request` (in any phase; a request not registered yet is cancelled when it is).
///
/// # Safety
/// `receiver` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_cancel(
    receiver: *const kvpipe_receiver,
    request: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| ok(unsafe { handle(receiver) }?.node.cancel(RequestId(request))))
}

/// Retires `request` after its `KVPIPE_EVENT_QUIESCED`.
///
/// # Safety
/// `receiver` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvpipe_receiver_retire(
    receiver: *const kvpipe_receiver,
    request: u64,
) -> kvpipe_status {
    // SAFETY: forwarded from the caller.
    guard(|| ok(unsafe { handle(receiver) }?.node.retire(RequestId(request))))
}
