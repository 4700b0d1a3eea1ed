"""Pools from DLPack tensors and ``__cuda_array_interface__`` arrays: host DLPack pools carry a
transfer in place, GPU pools reach the node layer (which refuses them by name where no driver
serves them or the wheel lacks the `cuda` feature), the TCP data path is chosen by name,
and every malformed object raises a Python exception."""

import gc
import time
import weakref

import numpy as np
import pytest

import kvpipe
from fake_arrays import (CPU, CUDA, CUDA_HOST, CUDA_MANAGED, IS_COPIED, READ_ONLY, ROCM,
                         CudaArray, DLPackTensor, released)

SLOT = 2 * 1 * 4 * 8 * 2 * 2  # kv factor × heads × tokens per block × dim × bytes × layers
SLOTS = 16
GPU_ADDRESS = 0x7F00_0000_0000  # never dereferenced: GPU pools are refused before use


def layout(region):
    return [
        kvpipe.LayerGroup(
            layers=2, kv_heads=1, head_dim=8, elem_bytes=2, tokens_per_block=4,
            pools=[kvpipe.Pool(region=region, layers=2, slot_bytes=SLOT)],
        )
    ]


def until(node, kind, timeout=5.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        e = node.next_event(0.05)
        if e is not None:
            seen.append(e)
            if e.kind == kind:
                return e
    raise AssertionError(f"no {kind} event in {timeout} s; saw {seen}")


def host_dlpack(array, **kw):
    """A DLPack view of a numpy array's memory, as 16-bit items (so a length counted in items
    instead of bytes would miss half the pool)."""
    assert array.nbytes % 2 == 0
    return DLPackTensor(array.ctypes.data, (array.shape[0], array.nbytes // array.shape[0] // 2),
                        bits=16, keep=array, **kw)


@pytest.mark.parametrize("legacy", [False, True], ids=["dlpack-1.x", "dlpack-legacy"])
@pytest.mark.parametrize("host", [CPU, CUDA_HOST])
def test_host_dlpack_pools_carry_a_transfer_in_place(legacy, host):
    src = np.arange(SLOTS * SLOT, dtype=np.uint32).astype(np.uint8).reshape(SLOTS, SLOT)
    dst = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    tx, rx = kvpipe.mem_pair(
        layout(1), {1: host_dlpack(src, legacy=legacy, device=(host, 0))},
        layout(9), {9: host_dlpack(dst, legacy=legacy, device=(host, 0))},
    )
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    # The last slot on both sides: a pool length short of elements × item size fails here.
    rx.register(5, 8, [(0, [SLOTS - 2, SLOTS - 1])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(5, [kvpipe.MEM_RECEIVER_PEER])
    tx.submit_chunk(5, 0, 8, 8, [[3, SLOTS - 1]])
    tx.submit_aux(5, [1])
    done = until(rx, "completed")
    assert done.bytes_written == 2 * SLOT
    until(rx, "quiesced")
    until(tx, "quiesced")
    assert (dst[SLOTS - 2] == src[3]).all() and (dst[SLOTS - 1] == src[SLOTS - 1]).all()
    assert not dst[: SLOTS - 2].any()
    tx.close()
    rx.close()


def test_a_dlpack_byte_offset_and_explicit_contiguous_strides_are_honoured():
    backing = np.zeros(64 + SLOTS * SLOT, dtype=np.uint8)
    dst = backing[64:].reshape(SLOTS, SLOT)
    src = np.full((SLOTS, SLOT), 7, dtype=np.uint8)
    pool = DLPackTensor(backing.ctypes.data, (SLOTS, SLOT), byte_offset=64, strides=(SLOT, 1),
                        keep=backing)
    tx, rx = kvpipe.mem_pair(layout(1), {1: src}, layout(9), {9: pool})
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    rx.register(6, 4, [(0, [0])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(6, [kvpipe.MEM_RECEIVER_PEER])
    tx.submit_chunk(6, 0, 4, 4, [[2]])
    tx.submit_aux(6, [1])
    until(rx, "quiesced")
    assert (dst[0] == 7).all() and not backing[:64].any() and not dst[1:].any()
    tx.close()
    rx.close()


def test_a_dlpack_pool_and_its_capsule_live_exactly_as_long_as_the_node():
    dst = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    pool = host_dlpack(dst)
    alive, tag = weakref.ref(pool), pool.tag
    rx = kvpipe.Receiver.tcp(layout(9), {9: pool})
    del pool
    gc.collect()
    assert alive() is not None, "the node holds its pool object"
    assert tag not in released, "the node holds the capsule, so the producer keeps the tensor"
    rx.close()
    del rx
    gc.collect()
    assert alive() is None, "a dropped node lets its pool go"
    assert released[tag] == 1, "and releases the capsule exactly once"


@pytest.mark.parametrize("node", ["sender", "receiver"])
@pytest.mark.parametrize(
    "pool",
    [
        lambda: CudaArray(GPU_ADDRESS, (SLOTS, SLOT // 2), "<f2", device=(CUDA, 1)),
        lambda: CudaArray(GPU_ADDRESS, (SLOTS, SLOT), version=2, device=(CUDA, 1),
                          strides=(SLOT, 1)),
        lambda: DLPackTensor(GPU_ADDRESS, (SLOTS, SLOT // 2), bits=16, device=(CUDA, 1)),
        lambda: DLPackTensor(GPU_ADDRESS, (SLOTS, SLOT), legacy=True, device=(CUDA_MANAGED, 1)),
    ],
    ids=["cai-v3", "cai-v2-strides", "dlpack", "dlpack-legacy-managed"],
)
def test_gpu_pools_reach_the_node_which_refuses_them_by_name(node, pool):
    make = kvpipe.Sender.tcp if node == "sender" else kvpipe.Receiver.tcp
    # A wheel without the `cuda` feature refuses every GPU pool; one with it, a GPU that no
    # driver here serves (none on a test machine, or fewer than two GPUs).
    with pytest.raises(kvpipe.TransportError,
                       match="region#7 is memory on GPU 1, (which this build's transports "
                             "cannot read or write yet|but the CUDA driver cannot serve it)"):
        make(layout(7), {7: pool()})
    with pytest.raises(kvpipe.TransportError, match="region#7 is memory on GPU 1"):
        kvpipe.mem_pair(layout(1), {1: np.zeros((SLOTS, SLOT), np.uint8)}, layout(7),
                        {7: pool()})


def test_a_read_only_pool_is_refused_on_the_decode_side_only():
    cai = CudaArray(GPU_ADDRESS, (SLOTS, SLOT), readonly=True)
    with pytest.raises(BufferError, match="pool 7 is read-only"):
        kvpipe.Receiver.tcp(layout(7), {7: cai})
    with pytest.raises(kvpipe.TransportError, match="GPU 0"):  # read-only is fine to read from
        kvpipe.Sender.tcp(layout(7), {7: cai})
    dst = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    with pytest.raises(BufferError, match="pool 7 is read-only"):
        kvpipe.Receiver.tcp(layout(7), {7: host_dlpack(dst, flags=READ_ONLY)})
    kvpipe.Sender.tcp(layout(7), {7: host_dlpack(dst, flags=READ_ONLY)}).close()


class NoDevice:
    def __dlpack__(self, **kw):
        raise AssertionError("not reached")


class Raises:
    def __dlpack_device__(self):
        return (CPU, 0)

    def __dlpack__(self, **kw):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")


class NotCapsule:
    def __dlpack_device__(self):
        return (CPU, 0)

    def __dlpack__(self, **kw):
        return 3


G = GPU_ADDRESS
MALFORMED = [
    # __cuda_array_interface__
    (lambda: CudaArray(G, (4,), interface=[1, 2]), TypeError, "must be a dict, got a list"),
    (lambda: CudaArray(G, (4,), shape=...), ValueError, 'has no "shape" entry'),
    (lambda: CudaArray(G, (4,), typestr=...), ValueError, 'has no "typestr" entry'),
    (lambda: CudaArray(G, (4,), data=...), ValueError, 'has no "data" entry'),
    (lambda: CudaArray(G, (4,), version=...), ValueError, 'has no "version" entry'),
    (lambda: CudaArray(G, (4,), version=1), ValueError, "is version 1; kvpipe reads versions 2 and 3"),
    (lambda: CudaArray(G, (4,), version="3"), ValueError, '"version" is not an integer'),
    (lambda: CudaArray(G, (4, -2)), ValueError, "has a negative extent"),
    (lambda: CudaArray(G, (4,), shape=4), ValueError, '"shape" is not a tuple of integers'),
    (lambda: CudaArray(G, (4,), "<O8"), ValueError, "is not a plain type"),
    (lambda: CudaArray(G, (4,), "f2"), ValueError, "is not a plain type"),
    (lambda: CudaArray(G, (4,), "<f0"), ValueError, "is not a plain type"),
    (lambda: CudaArray(G, (4,), 2), ValueError, '"typestr" is not a string'),
    (lambda: CudaArray(G, (4,), data=G), ValueError, '"data" is not \\(pointer, read_only\\)'),
    (lambda: CudaArray(G, (4,), data=(-1, False)), ValueError, '"data" is not'),
    (lambda: CudaArray(G, (4,), mask=(1, 2)), ValueError, "has a mask"),
    (lambda: CudaArray(G, (4, 8), strides=(16, 2)), BufferError, "not C-contiguous"),
    (lambda: CudaArray(G, (4, 8), strides=(1, 4)), BufferError, "not C-contiguous"),
    (lambda: CudaArray(G, (4, 8), strides=(8,)), ValueError, "has 1 strides for 2 dimensions"),
    (lambda: CudaArray(G, (4, 8), strides="no"), ValueError, "neither None nor a tuple"),
    (lambda: CudaArray(G, (2**40, 2**40)), ValueError, "larger than memory"),
    (lambda: CudaArray(G, (4,), device=None), TypeError,
     "has __cuda_array_interface__, which does not say which GPU holds it"),
    (lambda: CudaArray(G, (4,), device=(CPU, 0)), ValueError, "its __dlpack_device__ says host"),
    (lambda: CudaArray(G, (4,), device="cuda:0"), TypeError,
     "must return \\(device_type, device_id\\)"),
    (lambda: CudaArray(G, (4,), device=(ROCM, 0)), ValueError, "DLPack device type 10"),
    (lambda: CudaArray(G, (4,), device=(CUDA, -1)), ValueError, "not a device ordinal"),
    # DLPack
    (NoDevice, TypeError, "has __dlpack__ but no __dlpack_device__"),
    (Raises, RuntimeError, "require gradient"),
    (NotCapsule, TypeError, "must return a DLPack capsule, got a int"),
    (lambda: DLPackTensor(G, (4,), name=b"used_dltensor"), ValueError,
     'a capsule with "used_dltensor", not an unconsumed'),
    (lambda: DLPackTensor(G, (4,), major=2), ValueError, "DLPack 2.0 tensor"),
    (lambda: DLPackTensor(G, (4,), flags=IS_COPIED), ValueError, "exported a copy"),
    (lambda: DLPackTensor(G, (4,), device=(CUDA, 0), tensor_device=(CUDA, 1)), ValueError,
     "in GPU 1, but __dlpack_device__\\(\\) says GPU 0"),
    (lambda: DLPackTensor(G, (4,), ndim=-1), ValueError, "with -1 dimensions"),
    (lambda: DLPackTensor(G, (4,), ndim=1000), ValueError, "with 1000 dimensions"),
    (lambda: DLPackTensor(G, (4,), null_shape=True), ValueError, "of 1 dimensions without a shape"),
    (lambda: DLPackTensor(G, (4, -1)), ValueError, "with a negative extent"),
    (lambda: DLPackTensor(G, (4,), bits=4), ValueError, "items of 4 bits"),
    (lambda: DLPackTensor(G, (4,), bits=0), ValueError, "items of 0 bits"),
    (lambda: DLPackTensor(G, (4, 8), strides=(1, 4)), BufferError, "not C-contiguous"),
    (lambda: DLPackTensor(G, (4, 8), strides=(16, 1)), BufferError, "not C-contiguous"),
    (lambda: DLPackTensor(G, (4,), device=(ROCM, 0)), ValueError, "DLPack device type 10"),
    (lambda: DLPackTensor(G, (4,), device=(7,)), TypeError, "must return \\(device_type"),
    (lambda: DLPackTensor(G, (4,), byte_offset=2**64 - 1), ValueError, "past the end of memory"),
    # Neither
    (lambda: "not a pool", TypeError, "pool 3 \\(a str\\) is neither a buffer"),
    (object, TypeError, "is neither a buffer"),
]


@pytest.mark.parametrize("make, error, message", MALFORMED)
def test_malformed_pools_raise_a_clear_exception(make, error, message):
    with pytest.raises(error, match=message):
        kvpipe.Receiver.tcp(layout(3), {3: make()})


def test_unit_dimensions_and_empty_pools_are_contiguous_whatever_their_strides():
    # A unit dimension's stride does not matter: these reach the GPU refusal, not BufferError.
    for pool in [CudaArray(G, (4, 1, 8), strides=(8, 999, 1)),
                 DLPackTensor(G, (4, 1, 8), strides=(8, 999, 1), device=(CUDA, 0))]:
        with pytest.raises(kvpipe.TransportError, match="GPU 0"):
            kvpipe.Receiver.tcp(layout(3), {3: pool})


def test_a_pool_key_must_be_a_region_id():
    with pytest.raises(TypeError, match="a pool's key is its region id"):
        kvpipe.Receiver.tcp(layout(3), {"3": np.zeros(4, np.uint8)})


class NumpyDLPack:
    """A numpy array seen only through DLPack (numpy's own capsules: a real producer), as a
    torch CPU tensor is; ``legacy`` drops ``max_version``, as a pre-1.0 producer would."""

    def __init__(self, array, legacy=False):
        self.array, self.legacy = array, legacy

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kw):
        if self.legacy and "max_version" in kw:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.array.__dlpack__(**kw)


@pytest.mark.parametrize("legacy", [False, True], ids=["dlpack-1.x", "dlpack-legacy"])
def test_numpy_dlpack_capsules_carry_a_transfer_into_a_slice(legacy):
    src = np.arange(SLOTS * SLOT // 2, dtype=np.uint16).reshape(SLOTS, SLOT // 2)
    full = np.zeros((SLOTS + 4, SLOT // 4), dtype=np.float32)
    dst = full[4:]  # starts 4 rows into its buffer
    tx, rx = kvpipe.mem_pair(layout(1), {1: NumpyDLPack(src, legacy)},
                             layout(9), {9: NumpyDLPack(dst, legacy)})
    until(tx, "peer_ready")
    until(rx, "peer_ready")
    rx.register(5, 8, [(0, [SLOTS - 2, SLOTS - 1])], [kvpipe.MEM_SENDER_PEER])
    tx.open_request(5, [kvpipe.MEM_RECEIVER_PEER])
    tx.submit_chunk(5, 0, 8, 8, [[3, SLOTS - 1]])
    tx.submit_aux(5, [1])
    until(rx, "quiesced")
    until(tx, "quiesced")
    landed, sent = full.view(np.uint8), src.view(np.uint8)
    assert (landed[4 + SLOTS - 2] == sent[3]).all() and (landed[4 + SLOTS - 1] == sent[SLOTS - 1]).all()
    assert not landed[: 4 + SLOTS - 2].any()
    tx.close()
    rx.close()


def test_numpy_dlpack_read_only_and_strided_arrays_are_refused():
    readonly = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    readonly.setflags(write=False)
    with pytest.raises(BufferError, match="pool 3 is read-only"):
        kvpipe.Receiver.tcp(layout(3), {3: NumpyDLPack(readonly)})
    kvpipe.Sender.tcp(layout(3), {3: NumpyDLPack(readonly)}).close()
    strided = np.zeros((SLOTS, 2 * SLOT), dtype=np.uint8)[:, ::2]
    with pytest.raises(BufferError, match="pool 3 is not C-contiguous"):
        kvpipe.Sender.tcp(layout(3), {3: NumpyDLPack(strided)})
    fortran = np.zeros((SLOT, SLOTS), dtype=np.uint8, order="F")
    with pytest.raises(BufferError, match="pool 3 is not C-contiguous"):
        kvpipe.Sender.tcp(layout(3), {3: NumpyDLPack(fortran)})


def test_data_path_names_a_tcp_data_path_and_peer_copies_need_device_pools():
    pool = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    with pytest.raises(ValueError, match='data_path must be "socket", "auto" or "peer_copy"'):
        kvpipe.Receiver.tcp(layout(1), {1: pool}, data_path="ipc")
    # Peer copies are pulled by the decode side into its own pools, which must be device
    # memory: a decode node that insists says why at listen; one that may fall back ("auto")
    # listens, and a socket node is the default.
    rx = kvpipe.Receiver.tcp(layout(1), {1: pool}, data_path="peer_copy")
    with pytest.raises(kvpipe.TransportError, match="cannot take them: .*host memory"):
        rx.listen("127.0.0.1:0")
    rx.close()
    for path in ("auto", "socket"):
        with kvpipe.Receiver.tcp(layout(1), {1: pool}, data_path=path) as rx:
            assert rx.listen("127.0.0.1:0") > 0
    # A prefill node whose pools are host memory cannot export them to be pulled: with
    # "peer_copy" its connect fails with the reason instead of falling back to the socket.
    src = np.zeros((SLOTS, SLOT), dtype=np.uint8)
    rx = kvpipe.Receiver.tcp(layout(2), {2: pool}, data_path="auto")
    tx = kvpipe.Sender.tcp(layout(1), {1: src}, data_path="peer_copy")
    port = rx.listen("127.0.0.1:0")
    with pytest.raises(kvpipe.TransportError,
                       match="peer copies refused: the sender cannot export: .*host memory"):
        tx.connect(f"127.0.0.1:{port}")
    tx.close()
    try:
        rx.close()
    except kvpipe.TransportError as e:
        # Now and then (about one run in six here) the decode node counts the refused
        # connection as a peer that did not close in order; nothing else may go wrong.
        assert "did not close in order" in str(e)
