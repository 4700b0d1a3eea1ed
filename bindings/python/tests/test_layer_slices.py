"""Layer-wise streaming from Python: each prefill chunk submitted in layer ranges
(``submit_chunk(..., layers=(begin, end))``) as an engine's ``save_kv_layer`` hook would, over
the in-process pair and over TCP, every destination byte checked against the source."""

import time

import numpy as np
import pytest

import kvpipe

TPB = 4
DIM = 8
# One layer of one block: K and V × 1 head × 4 tokens × 8 dims × 2 bytes.
LAYER_BYTES = 2 * 1 * TPB * DIM * 2
PROMPT = 42
CHUNK = 12
BLOCKS = -(-PROMPT // TPB)
SLOTS = 16
# Group 0: 3 layers in two pools (1 + 2 layers); group 1: 2 layers in one pool. The engine
# computes them interleaved: g1, g0, g0, g1, g0.
ORDER = [1, 0, 0, 1, 0]


def layout(first_region):
    pool = lambda i, layers, begin: kvpipe.Pool(  # noqa: E731
        region=first_region + i, layers=layers, slot_bytes=layers * LAYER_BYTES, layer_begin=begin
    )
    group = lambda layers, pools: kvpipe.LayerGroup(  # noqa: E731
        layers=layers, kv_heads=1, head_dim=DIM, elem_bytes=2, tokens_per_block=TPB, pools=pools
    )
    return [group(3, [pool(0, 1, 0), pool(1, 2, 1)]), group(2, [pool(2, 2, 0)])]


POOL_LAYERS = [1, 2, 2]


def pools(first_region, fill):
    out = {}
    for i, layers in enumerate(POOL_LAYERS):
        shape = (SLOTS, layers * LAYER_BYTES)
        if fill:
            rng = np.random.default_rng(first_region + i)
            out[first_region + i] = rng.integers(1, 256, size=shape, dtype=np.uint8)
        else:
            out[first_region + i] = np.zeros(shape, dtype=np.uint8)
    return out


def src_slot(group, o):
    return (3 * o + 5 * group + 1) % SLOTS


def dst_slot(group, o):
    return (SLOTS - 1 - o - 2 * group) % SLOTS


def until(node, kind, timeout=10.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        e = node.next_event(0.05)
        if e is not None:
            seen.append(e)
            if e.kind in ("failed", "timed_out"):
                raise AssertionError(f"{e.kind}: {e.message}")
            if e.kind == kind:
                return e
    raise AssertionError(f"no {kind} event in {timeout} s; saw {seen}")


def transfer_in_layer_slices(tx, rx, to_receiver, to_sender, src, dst, per_slice):
    request = 11
    rx.register(
        request, PROMPT, [(0, [dst_slot(g, o) for o in range(BLOCKS)]) for g in range(2)],
        [to_sender],
    )
    tx.open_request(request, [to_receiver])
    tables = [[src_slot(g, o) for o in range(BLOCKS)] for g in range(2)]
    asked = []

    def blocks(req, group, begin, end):
        asked.append((group, begin, end))
        return begin, tables[group][begin:end]

    layers = tx.layer_count()
    assert layers == len(ORDER)
    slices = 0
    for start in range(0, PROMPT, CHUNK):
        end = min(start + CHUNK, PROMPT)
        # A chunk's ranges start at layer 0: the second range first is refused, nothing changes.
        with pytest.raises(kvpipe.UsageError, match="layer 0"):
            tx.submit_chunk(request, start, end, PROMPT, blocks, layers=(per_slice, layers))
        calls = len(asked)
        for begin in range(0, layers, per_slice):
            s = tx.submit_chunk(
                request, start, end, PROMPT, blocks, layers=(begin, min(begin + per_slice, layers))
            )
            assert s is not None, (start, begin)
            slices += 1
            # Only the chunk's first range asks for its blocks (one query per group).
            assert len(asked) == calls + 2
    ranges = -(-layers // per_slice)
    assert slices == 4 * ranges
    tx.submit_aux(request, [5], prompt_tokens=PROMPT)
    done = until(rx, "completed")
    expected = BLOCKS * 5 * LAYER_BYTES
    assert done.bytes_written == expected
    until(rx, "quiesced")
    until(tx, "completed")
    until(tx, "quiesced")
    assert tx.counters()["slices"] == slices
    tx.retire(request)
    rx.retire(request)
    # Every byte: each destination slot of a block equals its source slot; others are zero.
    for i, group in enumerate([0, 0, 1]):
        s, d = src[1 + i], dst[101 + i]
        written = {dst_slot(group, o): src_slot(group, o) for o in range(BLOCKS)}
        for slot in range(SLOTS):
            want = s[written[slot]] if slot in written else np.zeros_like(d[slot])
            assert np.array_equal(d[slot], want), (i, slot)


@pytest.mark.parametrize("per_slice", [1, 2])
def test_layer_slices_in_process(per_slice):
    src, dst = pools(1, True), pools(101, False)
    tx, rx = kvpipe.mem_pair(layout(1), src, layout(101), dst, layer_order=ORDER)
    try:
        until(tx, "peer_ready")
        until(rx, "peer_ready")
        transfer_in_layer_slices(
            tx, rx, kvpipe.MEM_RECEIVER_PEER, kvpipe.MEM_SENDER_PEER, src, dst, per_slice
        )
    finally:
        tx.close()
        rx.close()


def test_layer_slices_over_tcp():
    src, dst = pools(1, True), pools(101, False)
    rx = kvpipe.Receiver.tcp(layout(101), dst)
    tx = kvpipe.Sender.tcp(layout(1), src, layer_order=ORDER)
    try:
        port = rx.listen("127.0.0.1:0")
        to_receiver = tx.connect(f"127.0.0.1:{port}")
        to_sender = until(rx, "peer_ready").peer
        until(tx, "peer_ready")
        transfer_in_layer_slices(tx, rx, to_receiver, to_sender, src, dst, 2)
    finally:
        tx.close()
        rx.close()


def test_a_layer_order_that_misses_layers_is_refused():
    src = pools(1, True)
    with pytest.raises(kvpipe.ConfigError, match="layer order lists group#0 2 times"):
        kvpipe.Sender.tcp(layout(1), src, layer_order=[0, 0, 1])


# What a message starts with: the argument, then what it accepts.
TUPLE = r"layers must be None \(the whole chunk\) or a \(begin, end\) tuple of layer positions"
BEGIN = r"the begin of layers=\(begin, end\) must be an integer from 0 to 4294967295"
END = r"the end of layers=\(begin, end\) must be an integer from 0 to 4294967295"


@pytest.mark.parametrize(
    "layers, error, message",
    [
        ((-1, 2), ValueError, BEGIN + ", got -1$"),
        ((0, 2**32), ValueError, END + ", got 4294967296$"),
        ((0, 2**70), ValueError, END + ", got 1180591620717411303424$"),
        ((0,), ValueError, TUPLE + r", got a tuple of length 1: \(0,\)$"),
        ((0, 1, 2), ValueError, TUPLE + r", got a tuple of length 3: \(0, 1, 2\)$"),
        ([0, 2], TypeError, TUPLE + r", got \[0, 2\] \(type list\)$"),
        (2, TypeError, TUPLE + r", got 2 \(type int\)$"),
        ("0:2", TypeError, TUPLE + r", got '0:2' \(type str\)$"),
        ((0.0, 2.0), TypeError, BEGIN + r", got 0.0 \(type float\)$"),
        ((0, None), TypeError, END + r", got None \(type NoneType\)$"),
    ],
)
def test_a_bad_layer_range_names_the_argument_and_changes_nothing(layers, error, message):
    src, dst = pools(1, True), pools(101, False)
    tx, rx = kvpipe.mem_pair(layout(1), src, layout(101), dst, layer_order=ORDER)
    try:
        tx.open_request(3, [kvpipe.MEM_RECEIVER_PEER])
        table = lambda req, group, begin, end: (begin, list(range(begin, end)))  # noqa: E731
        with pytest.raises(error, match=message):
            tx.submit_chunk(3, 0, CHUNK, PROMPT, table, layers=layers)
        # Refused before the core saw it: the chunk's first range is still layer 0's.
        assert tx.submit_chunk(3, 0, CHUNK, PROMPT, table, layers=(0, 1)) is not None
        # numpy integers convert as Python's do.
        numpy_range = (np.int64(1), np.uint8(2))
        assert tx.submit_chunk(3, 0, CHUNK, PROMPT, table, layers=numpy_range) is not None
    finally:
        tx.close()
        rx.close()


ORDER_TYPE = r"layer_order must be None \(the layer groups one after the other\) or a sequence"
ORDER_ITEM = r"layer_order\[{}\] must be an integer from 0 to 65535, got {}"


@pytest.mark.parametrize(
    "order, error, message",
    [
        # An explicit empty order is not the default one.
        ([], ValueError, r"layer_order is empty: it must list the layer group of each of the "
                         r"rank's layers, or be None .*; got \[\]$"),
        ((), ValueError, r"layer_order is empty: .*; got \(\)$"),
        (np.array([], dtype=np.int64), ValueError, r"layer_order is empty: "),
        ([1, -1, 0, 1, 0], ValueError, ORDER_ITEM.format(1, -1) + "$"),
        ([1, 0, 0, 1, 70000], ValueError, ORDER_ITEM.format(4, 70000) + "$"),
        ([1, 0, 0.0, 1, 0], TypeError, ORDER_ITEM.format(2, r"0.0 \(type float\)") + "$"),
        ([1, 0, None, 1, 0], TypeError, ORDER_ITEM.format(2, r"None \(type NoneType\)") + "$"),
        ("10010", TypeError, ORDER_TYPE + r".*, got '10010' \(type str\)$"),
        (b"\x01\x00", TypeError, ORDER_TYPE + r".* \(type bytes\)$"),
        (1, TypeError, ORDER_TYPE + r".*, got 1 \(type int\)$"),
    ],
)
def test_a_bad_layer_order_names_the_argument(order, error, message):
    src, dst = pools(1, True), pools(101, False)
    with pytest.raises(error, match=message):
        kvpipe.Sender.tcp(layout(1), src, layer_order=order)
    with pytest.raises(error, match=message):
        kvpipe.mem_pair(layout(1), src, layout(101), dst, layer_order=order)


@pytest.mark.parametrize("order", [None, ORDER, tuple(ORDER), np.array(ORDER, dtype=np.uint16)])
def test_a_layer_order_is_none_or_any_sequence_of_group_indices(order):
    tx = kvpipe.Sender.tcp(layout(1), pools(1, True), layer_order=order)
    try:
        assert tx.layer_count() == len(ORDER)
    finally:
        tx.close()
