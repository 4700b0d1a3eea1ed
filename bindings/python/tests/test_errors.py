"""Bad input raises a Python exception; refusals by the core carry the core's message."""

import numpy as np
import pytest

import kvpipe

SLOT = 2 * 1 * 4 * 8 * 2 * 2  # kv factor × heads × tokens per block × dim × bytes × layers


def layout(region):
    return [
        kvpipe.LayerGroup(
            layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4,
            pools=[kvpipe.Pool(region=region, layers=2, slot_bytes=SLOT)],
        )
    ]


def until(node, kind, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        e = node.next_event(0.05)
        if e is not None:
            seen.append(e)
            if e.kind == kind:
                return e, seen
    raise AssertionError(f"no {kind} event in {timeout} s; saw {seen}")


@pytest.fixture
def pair():
    src = np.arange(16 * SLOT, dtype=np.uint32).astype(np.uint8).reshape(16, SLOT)
    dst = np.zeros((16, SLOT), dtype=np.uint8)
    tx, rx = kvpipe.mem_pair(layout(1), {1: src}, layout(9), {9: dst})
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    yield tx, rx, src, dst
    tx.close()
    rx.close()


def test_a_small_transfer_in_process(pair):
    tx, rx, src, dst = pair
    assert tx.transport == "mem" and rx.transport == "mem"
    rx.register(5, 10, [(0, [10, 11, 12])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(5, [kvpipe.MEM_RECEIVER_PEER])
    # The registration pins its three blocks until the request quiesces.
    assert rx.session_count() == 1 and tx.session_count() == 1
    assert rx.counters()["blocks_pinned"] == 3 and rx.counters()["blocks_released"] == 0
    table = [2, 3, 4]
    assert tx.submit_chunk(5, 0, 6, 10, [table]) is not None
    # A callable block source: the run of resident blocks ending at `end`.
    assert tx.submit_chunk(5, 6, 10, 10, lambda r, g, b, e: (b, table[b:e])) is not None
    tx.submit_aux(5, [7, 8], prompt_tokens=10, draft_tokens=[9])
    done, _ = until(rx, "completed")
    assert done.bytes_written == 3 * SLOT
    assert done.first_tokens == [7, 8] and done.draft_tokens == [9]
    until(rx, "quiesced")
    until(tx, "quiesced")
    assert (dst[10:13] == src[2:5]).all()
    assert not dst[:10].any() and not dst[13:].any()
    assert rx.counters()["blocks_released"] == 3
    tx.retire(5)
    rx.retire(5)
    assert rx.session_count() == 0 and tx.session_count() == 0
    assert tx.counters()["bytes_written"] == 3 * SLOT
    assert rx.counters()["bytes_landed"] == 3 * SLOT


def test_core_refusals_raise_usage_error_with_the_core_message(pair):
    tx, rx, _, _ = pair
    with pytest.raises(kvpipe.UsageError, match="req#99 is not known to this endpoint"):
        tx.submit_chunk(99, 0, 4, 10, [[0, 1, 2]])
    with pytest.raises(kvpipe.UsageError, match="2 layer groups given, the layout has 1"):
        rx.register(5, 10, [(0, [1, 2, 3]), (0, [4, 5, 6])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(6, [kvpipe.MEM_RECEIVER_PEER])
    with pytest.raises(kvpipe.UsageError, match="already open"):
        tx.open_request(6, [kvpipe.MEM_RECEIVER_PEER])
    with pytest.raises(kvpipe.UsageError, match="past the 2 blocks allocated"):
        tx.submit_chunk(6, 0, 10, 10, [[0, 1]])
    assert tx.submit_chunk(6, 0, 4, 10, [[0, 1, 2]]) is not None
    with pytest.raises(kvpipe.UsageError, match="starts at token 6, expected 4"):
        tx.submit_chunk(6, 6, 10, 10, [[0, 1, 2]])
    with pytest.raises(kvpipe.UsageError, match="is not quiesced yet"):
        tx.retire(6)
    assert issubclass(kvpipe.UsageError, kvpipe.KvpipeError)


def test_a_chunk_after_the_decode_sides_cancel_raises_session_ended(pair):
    tx, rx, _, _ = pair
    rx.register(3, 12, [(0, [10, 11, 12])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(3, [kvpipe.MEM_RECEIVER_PEER])
    assert tx.submit_chunk(3, 0, 4, 12, [[0]]) is not None
    rx.cancel(3)
    until(tx, "cancelled")
    # A distinct class, so an engine can tell an aborted request's race from a refusal.
    with pytest.raises(kvpipe.SessionEndedError, match="req#3 already ended") as caught:
        tx.submit_chunk(3, 4, 12, 12, [[0, 1, 2]])
    assert isinstance(caught.value, kvpipe.UsageError)
    with pytest.raises(kvpipe.SessionEndedError):
        tx.submit_aux(3, [1], prompt_tokens=12)
    # Other refusals stay plain usage errors.
    with pytest.raises(kvpipe.UsageError) as other:
        tx.submit_chunk(77, 0, 4, 12, [[0]])
    assert not isinstance(other.value, kvpipe.SessionEndedError)


def test_input_the_other_side_would_refuse_is_refused_at_the_call(pair):
    tx, rx, _, _ = pair
    # One destination slot for two ordinals.
    with pytest.raises(kvpipe.UsageError, match="req#2 names blk#10 twice in layer group 0"):
        rx.register(2, 8, [(0, [10, 10])], [kvpipe.MEM_SENDER_PEER])
    # Aux data larger than the registered aux slot: refused, and data that fits completes.
    rx.register(1, 16, [(0, [10, 11, 12, 13])], [kvpipe.MEM_SENDER_PEER], aux_capacity=20)
    tx.open_request(1, [kvpipe.MEM_RECEIVER_PEER])
    until(tx, "registered")
    tx.submit_chunk(1, 0, 16, 16, [[0, 1, 2, 3]])
    with pytest.raises(kvpipe.UsageError, match="takes 416 bytes.*holds 20"):
        tx.submit_aux(1, list(range(100)))
    tx.submit_aux(1, [7])
    until(tx, "completed")
    until(rx, "completed")


def test_blocks_past_a_pool_are_caught_before_any_write(pair):
    tx, rx, _, dst = pair
    # Both pools hold 16 slots: slot 16 is past them.
    with pytest.raises(kvpipe.UsageError, match="req#3 names blk#16 in layer group 0, past its pools.*holds 16 slots"):
        rx.register(3, 12, [(0, [14, 15, 16])], [kvpipe.MEM_SENDER_PEER])
    rx.register(3, 12, [(0, [13, 14, 15])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(3, [kvpipe.MEM_RECEIVER_PEER])
    with pytest.raises(kvpipe.EngineFaultError, match="named blk#16 .*holds 16 slots.*failed on both sides"):
        tx.submit_chunk(3, 0, 12, 12, [[14, 15, 16]])
    failed, _ = until(rx, "failed")
    assert failed.request == 3 and failed.status == "engine_error"
    until(rx, "quiesced")
    assert tx.counters()["write_batches"] == 0 and not dst.any()


def test_a_block_another_live_request_holds_is_refused(pair):
    tx, rx, src, dst = pair
    rx.register(1, 8, [(0, [5, 6])], [kvpipe.MEM_SENDER_PEER])
    # The engine hands block 6 to a second request while the first still holds it.
    with pytest.raises(kvpipe.UsageError, match="req#2 names blk#6 in layer group 0, which req#1 still holds"):
        rx.register(2, 8, [(0, [6, 7])], [kvpipe.MEM_SENDER_PEER])
    rx.register(2, 8, [(0, [7, 8])], [kvpipe.MEM_SENDER_PEER])
    for request, blocks in ((1, [1, 2]), (2, [3, 4])):
        tx.open_request(request, [kvpipe.MEM_RECEIVER_PEER])
        tx.submit_chunk(request, 0, 8, 8, [blocks])
        tx.submit_aux(request, [request])
    for _ in range(2):
        until(rx, "completed")
    assert (dst[5:9] == src[1:5]).all()
    # Once the first quiesced its blocks may go to a new request, before it is retired.
    until(rx, "quiesced")
    rx.register(3, 8, [(0, [5, 6])], [kvpipe.MEM_SENDER_PEER])


def test_every_bad_integer_names_its_argument(pair):
    tx, rx, _, _ = pair
    S, R = kvpipe.MEM_SENDER_PEER, kvpipe.MEM_RECEIVER_PEER
    U32 = "4294967295"
    cases = [
        (lambda: rx.register(5, -1, [(0, [1, 2])], [S]), ValueError, f"prompt_len must be an integer from 0 to {U32}, got -1"),
        (lambda: rx.register(5, 8, [(0, [1, -2])], [S]), ValueError, rf"blocks\[0\]'s ids\[1\] must be an integer from 0 to {U32}, got -2"),
        (lambda: rx.register(5, 8, [(-1, [1, 2])], [S]), ValueError, r"blocks\[0\]'s first_ordinal must be"),
        (lambda: rx.register(5, 8, [(0, [1, 2])], [S], aux_capacity=-1), ValueError, "aux_capacity must be"),
        (lambda: tx.submit_prefix(6, 2**32, 4, [[1]]), ValueError, f"prompt_len must be an integer from 0 to {U32}, got 4294967296"),
        (lambda: tx.submit_prefix(6, 12, -4, [[1]]), ValueError, "prepopulated_len must be"),
        (lambda: tx.submit_aux(6, [7, -1]), ValueError, r"first_tokens\[1\] must be an integer"),
        (lambda: tx.submit_aux(6, [7], draft_tokens=[2**32]), ValueError, r"draft_tokens\[0\] must be"),
        (lambda: tx.submit_aux(6, [7], prompt_tokens=-1), ValueError, "prompt_tokens must be"),
        (lambda: tx.submit_aux(6, 7), TypeError, r"first_tokens must be a sequence of integers, got 7 \(type int\)"),
        (lambda: tx.submit_chunk(6, 0, 8, 8, lambda r, g, b, e: (b, [-5] * (e - b))), ValueError, r"a block source's answer's ids\[0\] must be"),
        (lambda: kvpipe.Pool(region=-1, layers=2, slot_bytes=SLOT), ValueError, f"region must be an integer from 0 to {U32}, got -1"),
        (lambda: kvpipe.Pool(region=1, layers=70000, slot_bytes=SLOT), ValueError, "layers must be an integer from 0 to 65535, got 70000"),
        (lambda: kvpipe.LayerGroup(layers=2, kv_heads=1, head_dim=8, elem_bytes=256, tokens_per_block=4, pools=[]), ValueError, "elem_bytes must be an integer from 0 to 255"),
        (lambda: kvpipe.LayerGroup(layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4, pools=[], window=-3), ValueError, "window must be"),
    ]
    tx.open_request(6, [R])
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    # Refused before the core saw them: the request takes its chunk and aux, and a
    # registration with good values is taken.
    rx.register(5, 8, [(0, [1, 2])], [S])
    rx.register(6, 8, [(0, [3, 4])], [S])
    assert tx.submit_chunk(6, 0, 8, 8, [[1, 2]]) is not None
    tx.submit_aux(6, [7])
    assert kvpipe.LayerGroup(layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4, pools=[], window=None).window is None
    until(rx, "completed")


def test_next_event_waits_for_ever_on_an_infinite_timeout(pair):
    tx, rx, _, _ = pair
    rx.register(4, 8, [(0, [1, 2])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(4, [kvpipe.MEM_RECEIVER_PEER])
    # The registration reaches the prefill side: the wait ends with it.
    assert tx.next_event(float("inf")).kind == "registered"
    for bad in (-1.0, float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="a timeout is a non-negative number of seconds"):
            tx.next_event(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=0), "head_dim is 0; it must be at least 1"),
        (dict(elem_bytes=0), "elem_bytes is 0"),
        (dict(tokens_per_block=0), "tokens_per_block is 0"),
        (dict(kv_factor=0), r"kv_factor is 0; it must be 1 \(K only\) or 2"),
        (dict(kv_factor=3), "kv_factor is 3"),
        (dict(window=0), "window is 0; it must be at least 1 token"),
        (dict(pools=[]), "pools hold 0 layers, but the layer group has 2"),
        (dict(pools=[kvpipe.Pool(region=1, layers=2, slot_bytes=SLOT - 1)]), f"has {SLOT - 1}-byte slots but its layers need {SLOT} bytes"),
        (dict(pools=[kvpipe.Pool(region=1, layers=1, slot_bytes=SLOT),
                     kvpipe.Pool(region=1, layers=1, slot_bytes=SLOT)]), "pool 1"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_when_the_node_is_made(change, message):
    # Each would otherwise move nothing (and complete) or fail only at the handshake.
    group = dict(layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4,
                 pools=[kvpipe.Pool(region=1, layers=2, slot_bytes=SLOT)])
    bad = [kvpipe.LayerGroup(**{**group, **change})]
    src = np.zeros((4, SLOT), dtype=np.uint8)
    dst = np.zeros((4, SLOT), dtype=np.uint8)
    with pytest.raises(kvpipe.ConfigError, match=rf"layer group 0: sender .*{message}"):
        kvpipe.Sender.tcp(bad, {1: src})
    with pytest.raises(kvpipe.ConfigError, match=rf"layer group 0: sender .*{message}"):
        kvpipe.mem_pair(bad, {1: src}, layout(9), {9: dst})
    bad_decode = [kvpipe.LayerGroup(**{**group, **change, "pools": [
        kvpipe.Pool(region=9, layers=p.layers, slot_bytes=p.slot_bytes, layer_begin=p.layer_begin)
        for p in (change.get("pools", group["pools"]))]})]
    with pytest.raises(kvpipe.ConfigError, match=rf"layer group 0: receiver .*{message}"):
        kvpipe.Receiver.tcp(bad_decode, {9: dst})


def test_deadlines_that_cannot_work_are_refused():
    src = np.zeros((4, SLOT), dtype=np.uint8)
    with pytest.raises(kvpipe.ConfigError, match="heartbeat_interval is zero"):
        kvpipe.Sender.tcp(layout(1), {1: src}, deadlines={"heartbeat_interval": 0.0})
    with pytest.raises(ValueError, match=r"from 0 to 18446744073 \(about 584 years\), got 1e300"):
        kvpipe.Sender.tcp(layout(1), {1: src}, deadlines={"handshake": 1e300})


def test_a_block_source_breaking_its_contract_fails_the_request_on_both_sides(pair):
    tx, rx, _, _ = pair
    rx.register(7, 8, [(0, [1, 2])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(7, [kvpipe.MEM_RECEIVER_PEER])
    # Not a usage error (the call was fine, and it changed the state): its own exception.
    with pytest.raises(kvpipe.EngineFaultError, match="longer than asked.*failed on both sides"):
        tx.submit_chunk(7, 0, 8, 8, lambda r, g, b, e: (b, list(range(e - b + 1))))
    assert not issubclass(kvpipe.EngineFaultError, kvpipe.UsageError)
    failed, _ = until(rx, "failed")
    assert failed.status == "engine_error" and failed.request == 7
    until(rx, "quiesced")


def test_a_block_source_exception_propagates(pair):
    tx, _, _, _ = pair
    tx.open_request(8, [kvpipe.MEM_RECEIVER_PEER])

    def broken(request, group, begin, end):
        raise RuntimeError("the engine's cache is gone")

    with pytest.raises(RuntimeError, match="cache is gone"):
        tx.submit_chunk(8, 0, 4, 8, broken)
    with pytest.raises(TypeError, match="returns \\(first_ordinal, ids\\)"):
        tx.submit_chunk(8, 0, 4, 8, lambda r, g, b, e: 3)
    # Nothing changed: the chunk can still be submitted.
    assert tx.submit_chunk(8, 0, 4, 8, [[0, 1]]) is not None


@pytest.mark.parametrize("argument", ["start", "end", "prompt_len", "prepopulated_len"])
@pytest.mark.parametrize(
    "value, error, got",
    [
        (-1, ValueError, "-1"),
        (2**32, ValueError, "4294967296"),
        (4.0, TypeError, r"4.0 \(type float\)"),
    ],
)
def test_a_bad_token_count_names_the_argument(pair, argument, value, error, got):
    tx, _, _, _ = pair
    tx.open_request(9, [kvpipe.MEM_RECEIVER_PEER])
    chunk = dict(request=9, start=0, end=4, prompt_len=10, blocks=[[0, 1, 2]])
    message = rf"^{argument} must be an integer from 0 to 4294967295, got {got}"
    with pytest.raises(error, match=message):
        tx.submit_chunk(**{**chunk, argument: value})
    # Refused before the core saw it: the chunk can still be submitted.
    assert tx.submit_chunk(**chunk) is not None

U64 = "18446744073709551615"


def test_a_bad_id_names_the_argument(pair):
    tx, rx, _, _ = pair
    calls = [
        ("request", U64, lambda v: tx.open_request(v, [kvpipe.MEM_RECEIVER_PEER])),
        ("request", U64, lambda v: tx.submit_chunk(v, 0, 4, 10, [[0, 1, 2]])),
        ("request", U64, lambda v: tx.submit_aux(v, [1])),
        ("request", U64, lambda v: tx.cancel(v)),
        ("request", U64, lambda v: tx.retire(v)),
        ("request", U64, lambda v: rx.register(v, 10, [(0, [0, 1, 2])], [kvpipe.MEM_SENDER_PEER])),
        ("request", U64, lambda v: rx.cancel(v)),
        ("request", U64, lambda v: rx.retire(v)),
        ("peer", "4294967295", lambda v: tx.is_peer_ready(v)),
        ("peer", "4294967295", lambda v: rx.is_peer_ready(v)),
        ("receivers\\[1\\]", "4294967295", lambda v: tx.open_request(7, [kvpipe.MEM_RECEIVER_PEER, v])),
        ("writers\\[0\\]", "4294967295", lambda v: rx.register(7, 10, [(0, [0, 1, 2])], [v])),
    ]
    for name, largest, call in calls:
        bad = [(-1, ValueError, "-1"), (2**64, ValueError, str(2**64)),
               ("3", TypeError, r"'3' \(type str\)")]
        for value, error, got in bad:
            message = rf"^{name} must be an integer from 0 to {largest}, got {got}"
            with pytest.raises(error, match=message):
                call(value)
    with pytest.raises(TypeError, match=r"^receivers must be a sequence of peer ids, got 3"):
        tx.open_request(7, 3)
    with pytest.raises(TypeError, match=r"^writers must be a sequence of peer ids, got '01'"):
        rx.register(7, 10, [(0, [0, 1, 2])], "01")
    with pytest.raises(ValueError, match=rf"^instance must be an integer from 0 to {U64}, got -5"):
        kvpipe.Sender.tcp(layout(1), {1: np.zeros((4, SLOT), dtype=np.uint8)}, instance=-5)
    # The refused calls opened and registered nothing: request 7 still can be.
    tx.open_request(7, [kvpipe.MEM_RECEIVER_PEER])
    rx.register(7, 10, [(0, [0, 1, 2])], [kvpipe.MEM_SENDER_PEER])


def test_registration_anchors_are_explicit(pair):
    _, rx, _, _ = pair
    with pytest.raises(TypeError, match="first_ordinal, ids"):
        rx.register(5, 10, [[10, 11, 12]], [kvpipe.MEM_SENDER_PEER])


def test_bad_pools_and_settings_raise():
    src = np.zeros((4, SLOT), dtype=np.uint8)
    readonly = np.zeros((4, SLOT), dtype=np.uint8)
    readonly.setflags(write=False)
    with pytest.raises(BufferError, match="pool 9 is read-only"):
        kvpipe.Receiver.tcp(layout(9), {9: readonly})
    strided = np.zeros((4, 2 * SLOT), dtype=np.uint8)[:, ::2]
    with pytest.raises(BufferError, match="not C-contiguous"):
        kvpipe.Sender.tcp(layout(1), {1: strided})
    with pytest.raises(TypeError):
        kvpipe.Sender.tcp(layout(1), {1: "not a buffer"})
    with pytest.raises(ValueError, match='unknown deadline "handshak"'):
        kvpipe.Sender.tcp(layout(1), {1: src}, deadlines={"handshak": 1.0})
    with pytest.raises(ValueError, match="a pool in region#1, but no memory was given for region#1"):
        kvpipe.Sender.tcp(layout(1), {2: src})
    connections_range = "^connections must be between 1 and 255, got "
    for connections in (0, -1, 256, 2**64):
        with pytest.raises(ValueError, match=f"{connections_range}{connections}"):
            kvpipe.Sender.tcp(layout(1), {1: src}, connections=connections)
        with pytest.raises(ValueError, match=f"{connections_range}{connections}"):
            kvpipe.Receiver.tcp(layout(9), {9: np.zeros_like(src)}, connections=connections)
    with pytest.raises(TypeError, match=connections_range + r"'2' \(type str\)"):
        kvpipe.Sender.tcp(layout(1), {1: src}, connections="2")
    # A read-only pool is fine on the prefill side, which only reads.
    tx = kvpipe.Sender.tcp(layout(1), {1: readonly})
    with pytest.raises(kvpipe.TransportError, match="not available on the mem"):
        kvpipe.mem_pair(layout(1), {1: src}, layout(9), {9: np.zeros_like(src)})[0].listen(
            "127.0.0.1:0"
        )
    with pytest.raises(kvpipe.TransportError):
        tx.connect("127.0.0.1:1")  # nothing listens on port 1
    tx.close()
    with pytest.raises(kvpipe.ClosedError):
        tx.open_request(1, [0])


def test_decode_regions_that_share_memory_are_refused():
    # One layer per pool, the two pools in two regions over overlapping rows of one buffer: a
    # write admitted into one region's block would land in the other's.
    half = SLOT // 2
    split = [
        kvpipe.LayerGroup(
            layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4,
            pools=[kvpipe.Pool(region=1, layers=1, slot_bytes=half),
                   kvpipe.Pool(region=2, layers=1, slot_bytes=half, layer_begin=1)],
        )
    ]
    buf = np.zeros((8, half), dtype=np.uint8)
    with pytest.raises(ValueError, match="region#1 and region#2 share memory"):
        kvpipe.Receiver.tcp(split, {1: buf[0:4], 2: buf[3:7]})
    # Disjoint rows are fine; the prefill side, which only reads, may overlap.
    kvpipe.Receiver.tcp(split, {1: buf[0:4], 2: buf[4:8]}).close()
    kvpipe.Sender.tcp(split, {1: buf[0:4], 2: buf[3:7]}).close()


def test_mismatched_layouts_are_rejected_at_the_handshake():
    src = np.zeros((4, SLOT), dtype=np.uint8)
    dst = np.zeros((4, SLOT), dtype=np.uint8)
    other = [
        kvpipe.LayerGroup(
            layers=2, kv_heads=2, head_dim=4, elem_bytes=2, tokens_per_block=4,
            pools=[kvpipe.Pool(region=1, layers=2, slot_bytes=SLOT)],
        )
    ]
    tx, rx = kvpipe.mem_pair(other, {1: src}, layout(9), {9: dst})
    rejected, _ = until(tx, "peer_rejected")
    assert rejected.reason in ("compatibility_mismatch", "layout_mismatch"), rejected
    assert rejected.message


def test_pools_stay_alive_while_the_node_exists():
    import gc
    import weakref

    class Pool(np.ndarray):
        pass

    src = np.zeros((4, SLOT), dtype=np.uint8).view(Pool)
    alive = weakref.ref(src)
    tx = kvpipe.Sender.tcp(layout(1), {1: src})
    del src
    gc.collect()
    assert alive() is not None, "the node holds its pool"
    tx.close()
    del tx
    gc.collect()
    assert alive() is None, "a dropped node lets its pool go"


@pytest.mark.parametrize("closing", ["decode", "prefill"])
def test_the_other_node_hears_a_close_as_peer_lost(closing):
    """With no request open, closing one node of a pair is still heard by the other: one
    ``peer_lost`` event (the peer closed it: ``reason`` is ``None``), and the peer is not ready."""
    import time

    src = np.zeros((16, SLOT), dtype=np.uint8)
    dst = np.zeros((16, SLOT), dtype=np.uint8)
    tx, rx = kvpipe.mem_pair(layout(1), {1: src}, layout(9), {9: dst})
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    closed, other, peer = (rx, tx, kvpipe.MEM_RECEIVER_PEER) if closing == "decode" else (
        tx, rx, kvpipe.MEM_SENDER_PEER)
    closed.close()
    lost, _ = until(other, "peer_lost", timeout=3.0)
    assert (lost.peer, lost.reason, lost.status) == (peer, None, "peer_lost")
    assert not other.is_peer_ready(peer)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        e = other.next_event(0.05)
        assert e is None or e.kind != "peer_lost", f"a second peer_lost: {e}"
    other.close()


PREFIX_BESIDE_A_READER = """
import threading, numpy as np, kvpipe
g = lambda r: [kvpipe.LayerGroup(layers=2, kv_heads=1, head_dim=8, elem_bytes=2,
                                 tokens_per_block=4,
                                 pools=[kvpipe.Pool(region=r, layers=2, slot_bytes=256)])]
tx, rx = kvpipe.mem_pair(g(1), {1: np.ones((64, 256), np.uint8)},
                         g(9), {9: np.zeros((64, 256), np.uint8)})
threading.Thread(target=lambda: [tx.counters() for _ in iter(int, 1)], daemon=True).start()
# A block source that calls into the node (and the other node) while it is asked.
def source(r, group, begin, end):
    tx.counters(); tx.next_event(0); rx.next_event(0); tx.is_peer_ready(kvpipe.MEM_RECEIVER_PEER)
    return (begin, list(range(10, 10 + end - begin)))
for r in range(1, 1001):
    tx.open_request(r, [kvpipe.MEM_RECEIVER_PEER])
    tx.submit_prefix(r, 12, 8, [[10, 11, 12]] if r % 2 else source)
    tx.cancel(r)
print("done")
"""


def test_a_prefix_beside_another_thread_and_a_reentrant_source_does_not_deadlock():
    # The block source of an early prefix is asked with the node unlocked, as a chunk's is, and
    # the getters wait for the node's lock with the GIL released: a thread reading the counters
    # meanwhile, or a source calling into the node, cannot freeze the interpreter.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PREFIX_BESIDE_A_READER], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
