"""``after=``: a chunk handed over while the GPU still computes it. Needs torch with a CUDA
device and a wheel built with the `cuda` feature (skipped elsewhere); ``scripts/gpu-check`` runs
this file as a script on the GPU machine.

The source row is written on torch's stream behind a long ``torch.cuda._sleep``, and the chunk
is submitted at once with ``after=`` that stream: the in-process transport's copy must wait on
the GPU for the write, so the new row lands, and the call must not wait for the GPU."""

import sys
import time

import kvpipe

try:
    import torch
except ImportError:  # the CPU machines: the test skips
    torch = None

SLOT = 2 * 1 * 4 * 8 * 2 * 2  # kv factor × heads × tokens per block × dim × bytes × layers
SLOTS = 16


def layout(region):
    return [
        kvpipe.LayerGroup(
            layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4,
            pools=[kvpipe.Pool(region=region, layers=2, slot_bytes=SLOT)],
        )
    ]


def until(node, kind, timeout=10.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        e = node.next_event(0.05)
        if e is not None:
            seen.append(e)
            if e.kind == kind:
                return e
    raise AssertionError(f"no {kind} event in {timeout} s; saw {seen}")


def move(tx, rx, request, src_slot, dst_slot, **submit):
    """One block from ``src_slot`` to ``dst_slot``, to completion and quiescence."""
    rx.register(request, 4, [(0, [dst_slot])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(request, [kvpipe.MEM_RECEIVER_PEER])
    started = time.monotonic()
    tx.submit_chunk(request, 0, 4, 4, [[src_slot]], **submit)
    returned = time.monotonic() - started
    return returned


def finish(tx, rx, request):
    tx.submit_aux(request, [1])
    until(rx, "completed")
    until(rx, "quiesced")
    until(tx, "quiesced")
    tx.retire(request)
    rx.retire(request)


def check_after_stream():
    dev = torch.device("cuda", 0)
    src = torch.arange(SLOTS * SLOT, device=dev).to(torch.uint8).reshape(SLOTS, SLOT)
    dst = torch.zeros((SLOTS, SLOT), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    tx, rx = kvpipe.mem_pair(layout(1), {1: src}, layout(9), {9: dst})
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    # A first request makes the transport's copy engine (loading its kernel may wait for the
    # GPU, which must not happen while the sleep below runs).
    move(tx, rx, 4, 2, 2)
    finish(tx, rx, 4)
    stream = torch.cuda.current_stream()
    new = torch.full((SLOT,), 0xA5, dtype=torch.uint8, device=dev)
    torch.cuda._sleep(int(4e8))  # hundreds of milliseconds of GPU time on the stream
    src[3].copy_(new)  # queued behind the sleep
    returned = move(tx, rx, 5, 3, 7, after=stream)
    behind = torch.cuda.Event()
    behind.record(stream)
    if behind.query():
        raise AssertionError("the sleep ended before the submission returned: inconclusive")
    finish(tx, rx, 5)
    torch.cuda.synchronize()
    assert torch.equal(dst[7], new), "the copy read the row before the write queued on the stream"
    assert torch.equal(dst[2], src[2]), "the first request's block"
    assert not dst[[i for i in range(SLOTS) if i not in (2, 7)]].any(), "another slot was written"
    tx.close()
    rx.close()
    return returned


def test_after_stream_orders_the_copy_behind_the_stream():
    import pytest

    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with a CUDA device")
    check_after_stream()


def test_after_takes_only_a_cuda_stream():
    import pytest

    tx, rx = kvpipe.mem_pair(layout(1), {1: bytearray(SLOTS * SLOT)},
                             layout(9), {9: bytearray(SLOTS * SLOT)})
    until(tx, "peer_ready")
    rx.register(5, 4, [(0, [1])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(5, [kvpipe.MEM_RECEIVER_PEER])
    for wrong in [object(), 7, type("S", (), {"cuda_stream": "x", "device_index": 0})()]:
        with pytest.raises(TypeError, match="after must be a CUDA stream"):
            tx.submit_chunk(5, 0, 4, 4, [[0]], after=wrong)
    # A stream-like object on a machine or build that cannot serve it: refused, nothing sent.
    fake = type("S", (), {"cuda_stream": 0, "device_index": 99})()
    with pytest.raises(kvpipe.TransportError):
        tx.submit_chunk(5, 0, 4, 4, [[0]], after=fake)
    # The request is as it was: the same chunk goes through without after=.
    assert tx.submit_chunk(5, 0, 4, 4, [[0]]) is not None
    finish(tx, rx, 5)
    tx.close()
    rx.close()


if __name__ == "__main__":
    if torch is None or not torch.cuda.is_available():
        print("skipped: needs torch with a CUDA device")
        sys.exit(0)
    took = check_after_stream()
    print(f"ok: the copy waited for the stream; submit_chunk(after=) returned in {took * 1e3:.2f} ms")
