"""Type stubs of kvpipe's native module (re-exported by the ``kvpipe`` package)."""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, final

from typing_extensions import Buffer, Self

__version__: str
MEM_SENDER_PEER: int
"""How the decode node of a :func:`mem_pair` names the prefill node."""
MEM_RECEIVER_PEER: int
"""How the prefill node of a :func:`mem_pair` names the decode node."""

class KvpipeError(Exception):
    """Base of kvpipe's errors; the message is the core's or the transport's own."""

class UsageError(KvpipeError):
    """The core refused an engine command; nothing changed."""

class SessionEndedError(UsageError):
    """The request already ended (completed, failed, timed out or cancelled, by this side or the
    peer; its event says which); nothing changed. An engine that aborts requests meets it
    routinely: a chunk or the aux data submitted after the request's cancel."""

class EngineFaultError(KvpipeError):
    """The engine's answer to a submitted chunk broke its contract (a block source's run, a
    changed prefix, a prompt length the receiver did not register). The submission was applied:
    the request was failed on both sides, and a ``failed`` event follows."""

class ConfigError(KvpipeError):
    """The configuration cannot run pipelined transfer."""

class TransportError(KvpipeError):
    """A socket operation or the transport failed (listen, connect, an unfinished close), or the
    transport cannot use the memory given (a GPU pool in this build)."""

class ClosedError(KvpipeError):
    """The node was closed."""

@final
class Pool:
    """One pool of a layer group: block slot ``b`` is the bytes
    ``[b * slot_bytes, (b + 1) * slot_bytes)`` of region ``region``."""

    region: int
    layers: int
    slot_bytes: int
    layer_begin: int
    def __init__(self, region: int, layers: int, slot_bytes: int, layer_begin: int = 0) -> None: ...

@final
class LayerGroup:
    """Layers sharing one block table per request; a slot's bytes are laid out
    ``[layer][K|V][head][token][dim]``."""

    layers: int
    kv_heads: int
    head_dim: int
    elem_bytes: int
    tokens_per_block: int
    pools: list[Pool]
    kv_factor: int
    window: int | None
    model_layers: int
    first_layer: int
    model_kv_heads: int
    first_head: int
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        elem_bytes: int,
        tokens_per_block: int,
        pools: Sequence[Pool],
        *,
        kv_factor: int = 2,
        window: int | None = None,
        model_layers: int = 0,
        first_layer: int = 0,
        model_kv_heads: int = 0,
        first_head: int = 0,
    ) -> None: ...
    def layer_block_bytes(self) -> int:
        """``kv_factor * kv_heads * tokens_per_block * head_dim * elem_bytes``."""

EventKind = Literal[
    "peer_ready",
    "peer_rejected",
    "protocol_violation",
    "registered",
    "completed",
    "failed",
    "timed_out",
    "cancelled",
    "quiesced",
    "peer_lost",
]

@final
class Event:
    """Something a node tells its engine; attributes that do not apply are ``None``."""

    kind: EventKind
    request: int | None
    peer: int | None
    peer_role: Literal["prefill", "decode"] | None
    instance: int | None
    status: str | None
    """e.g. ``"success"``, ``"peer_lost"``, ``"engine_error"``, ``"timed_out"``."""
    waiting_for: str | None
    reason: str | None
    """``peer_rejected``: why, e.g. ``"compatibility_mismatch"``; ``peer_lost``: why this side
    closed the connection, e.g. ``"handshake_timeout"``, ``"liveness_timeout"`` (``None``: the
    peer or the network closed it)."""
    cancelled_by_peer: bool | None
    sender_slice: int | None
    receiver_slice: int | None
    bytes_written: int | None
    first_tokens: list[int] | None
    draft_tokens: list[int] | None
    prompt_tokens: int | None
    cached_tokens: int | None
    started_ns: int | None
    first_byte_ns: int | None
    last_byte_ns: int | None
    ended_ns: int | None
    message: str

class BlockSourceFn(Protocol):
    """``(request, group, begin, end) -> (first_ordinal, ids)``: the contiguous run of resident
    blocks ending at ``end`` (shorter than asked only for an evicted window head, never longer,
    no holes; ``end`` past the allocation raises)."""

    def __call__(self, request: int, group: int, begin: int, end: int, /) -> tuple[int, Sequence[int]]: ...

BlockTables = Sequence[Sequence[int | None]]
"""Per layer group, the slot of each block ordinal (negative or ``None``: not resident)."""

Deadlines = Mapping[
    Literal[
        "handshake",
        "registration",
        "write_completion",
        "result_wait",
        "result_per_token",
        "result_idle",
        "aux_wait",
        "heartbeat_interval",
        "liveness_timeout",
        "quiesce",
    ],
    float,
]
"""Seconds, over the core's defaults."""

class DLPackTensor(Protocol):
    """A DLPack producer (a torch tensor, CuPy or JAX array, numpy array): kvpipe calls
    ``__dlpack_device__()`` and ``__dlpack__(max_version=(1, 1))`` (``__dlpack__()`` where that
    keyword is refused) and holds the capsule, unconsumed, while the node exists."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

class CudaStream(Protocol):
    """A CUDA stream, as ``torch.cuda.Stream``: its raw handle and its GPU."""

    @property
    def cuda_stream(self) -> int: ...
    @property
    def device_index(self) -> int: ...

class CudaArray(Protocol):
    """An object exposing ``__cuda_array_interface__`` (version 2 or 3). The interface does not
    say which GPU holds the memory, so the object must also have ``__dlpack_device__``."""

    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

PoolMemory = Buffer | DLPackTensor | CudaArray
"""The memory of one pool, used in place (never copied) and kept alive while its node exists.
Tried in this order:

1. a C-contiguous **buffer** (numpy array, ``bytearray``, ``mmap``): host memory;
2. a **DLPack** tensor (torch tensor, CuPy, JAX): host memory when ``__dlpack_device__()``
   says CPU (1) or CUDA pinned host (3), a **device pool** on GPU ``device_id`` when it says
   CUDA (2) or CUDA managed (13); any other device raises ``ValueError``;
3. a ``__cuda_array_interface__`` array: a device pool on the GPU its ``__dlpack_device__()``
   names.

The pool's bytes are its elements × item size. Strides must describe a C-contiguous array (or
be absent), else ``BufferError``; a decode pool must be writable (``BufferError`` for a
read-only buffer, a ``__cuda_array_interface__`` with ``data=(ptr, True)`` or a DLPack 1.x
tensor flagged read-only; a pre-1.0 DLPack capsule cannot say). A DLPack export flagged as a
copy is refused (writes would land in the copy). A malformed object raises ``TypeError``,
``ValueError`` or ``BufferError`` naming the pool. kvpipe synchronises no CUDA stream when it
takes a pool: submit a chunk only once its KV is computed.

Device pools are passed to the node as GPU memory. A wheel built with the ``cuda`` feature
(``maturin build --features cuda``) serves them: device copies in :func:`mem_pair`, pinned
staging or CUDA IPC peer copies (``data_path``) over TCP; where no CUDA driver sees the GPU a
node given one raises :class:`TransportError` ("region#N is memory on GPU K, but the CUDA
driver cannot serve it: ..."). A wheel built without it raises :class:`TransportError`
("region#N is memory on GPU K, which this build's transports cannot read or write yet ...").
Torch CPU tensors (through DLPack) and numpy arrays are host pools and work in every build.
"""

Pools = Mapping[int, PoolMemory]
"""Region id -> the pool's memory (see :data:`PoolMemory`), used in place."""

class Sender:
    """A prefill-side node: kvpipe's core sender over a transport."""

    @staticmethod
    def tcp(
        layout: Sequence[LayerGroup],
        pools: Pools,
        *,
        connections: int = 2,
        deadlines: Deadlines | None = None,
        instance: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        data_path: Literal["socket", "auto", "peer_copy"] = "socket",
        layer_order: Sequence[int] | None = None,
    ) -> Sender:
        """A prefill node over TCP. ``tp_size``/``tp_rank`` and ``pp_size``/``pp_rank``
        are this rank's place in the tensor- and pipeline-parallel topology (default: the whole
        model on one rank). ``ValueError`` when a size is not 1..65535, a rank is not below
        its size, or a layer group's heads (``first_head``, ``kv_heads`` of
        ``model_kv_heads``) are not those of ``tp_rank``: rank ``r`` of ``T`` holds heads
        ``r*H/T .. (r+1)*H/T`` of ``H`` (one replicated head when ``H < T``). The rank's layer
        range (sent in the handshake) is taken from the groups' ``first_layer``.

        ``data_path`` says how KV bytes reach the decode node's pools: ``"socket"`` (the
        default; GPU pools go through pinned staging), ``"peer_copy"`` (CUDA IPC: this node
        offers its exported GPU pools in its handshake and the decode process copies device to
        device straight from them into its own, control frames still over TCP; needs GPU pools
        on both sides on one host, a wheel built with the ``cuda`` feature, and this side
        connecting, else ``connect`` raises with the reason) or ``"auto"`` (peer copies where
        the decode node accepts them, else the socket). With either, ``connect`` returns once
        the decode node answered the offer (within the preamble deadline, else it raises).

        ``layer_order`` lists the layer group of each of the rank's layers in the order the
        engine computes them (default ``None``: the groups one after the other), which the
        ``layers`` of :meth:`submit_chunk` index; a model whose groups interleave lists it. An
        empty order is not the default: it raises ``ValueError``, as does an index that is
        negative or past 65535 (``TypeError``: not a sequence of integers); one that does not
        fit the layout (each group named once per layer it has) raises :class:`ConfigError`."""
    @property
    def transport(self) -> Literal["tcp", "mem"]: ...
    def listen(self, addr: str) -> int: ...
    def connect(self, addr: str) -> int: ...
    def next_event(self, timeout: float = 0.0) -> Event | None: ...
    def is_peer_ready(self, peer: int) -> bool: ...
    def counters(self) -> dict[str, int]: ...
    def session_count(self) -> int: ...
    def open_request(self, request: int, receivers: Sequence[int]) -> None: ...
    def submit_chunk(
        self,
        request: int,
        start: int,
        end: int,
        prompt_len: int,
        blocks: BlockTables | BlockSourceFn,
        *,
        prepopulated_len: int = 0,
        is_last: bool | None = None,
        prefix_sent_early: bool = False,
        layers: tuple[int, int] | None = None,
        after: CudaStream | None = None,
    ) -> int | None:
        """Submits chunk ``[start, end)`` just computed (``None``: it writes nothing).
        ``start``, ``end``, ``prompt_len`` and ``prepopulated_len`` are integers from 0 to
        2**32 - 1; another value raises ``ValueError`` (``TypeError``: not an integer) naming it.

        ``layers=(begin, end)`` submits only those layers of it, as soon as the engine computed
        them (vLLM's ``save_kv_layer``): a chunk's ranges come in order with the same chunk
        arguments, from layer 0 to :meth:`layer_count`, each starting where the previous one
        ended; only the first calls ``blocks``, and each range is a slice of its own. A
        ``layers`` that is not a tuple raises ``TypeError``, one not of two integers from 0 to
        2**32 - 1 ``TypeError`` or ``ValueError`` naming the item; a range that breaks these
        rules raises :class:`UsageError`. Either way nothing changes.

        ``after=stream`` hands the chunk (range) over while the GPU may still be computing it,
        as vLLM calls ``save_kv_layer``: a fence is recorded behind the work queued on
        ``stream`` so far. Over ``mem`` the copies wait for it on the GPU and the call returns
        at once; over ``tcp`` and ``verbs`` the call waits for it first (at most 60 s). Another
        object raises ``TypeError``; a build without GPU support, a GPU the driver does not
        see, or (over ``tcp`` and ``verbs``) work before the fence that failed raises
        :class:`TransportError`, with nothing submitted. Over ``mem`` such a failure fails the
        range's copies, and the request, as a failed write does."""
    def layer_count(self) -> int:
        """The rank's layers (every layer group's), which ``layers`` ranges end at."""
    def submit_prefix(
        self, request: int, prompt_len: int, prepopulated_len: int, blocks: BlockTables | BlockSourceFn
    ) -> int | None: ...
    def submit_aux(
        self,
        request: int,
        first_tokens: Sequence[int],
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        draft_tokens: Sequence[int] = (),
    ) -> None: ...
    def cancel(self, request: int) -> None: ...
    def retire(self, request: int) -> None: ...
    def close(self, timeout: float = 10.0) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: Any) -> bool: ...

class Receiver:
    """A decode-side node: kvpipe's core receiver over a transport."""

    @staticmethod
    def tcp(
        layout: Sequence[LayerGroup],
        pools: Pools,
        *,
        connections: int = 2,
        deadlines: Deadlines | None = None,
        instance: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        data_path: Literal["socket", "auto", "peer_copy"] = "socket",
    ) -> Receiver:
        """A decode node over TCP. ``tp_size``/``tp_rank`` and ``pp_size``/``pp_rank``
        are this rank's place in the tensor- and pipeline-parallel topology (default: the whole
        model on one rank). ``ValueError`` when a size is not 1..65535, a rank is not below
        its size, or a layer group's heads (``first_head``, ``kv_heads`` of
        ``model_kv_heads``) are not those of ``tp_rank``: rank ``r`` of ``T`` holds heads
        ``r*H/T .. (r+1)*H/T`` of ``H`` (one replicated head when ``H < T``). The rank's layer
        range (sent in the handshake) is taken from the groups' ``first_layer``.

        ``data_path`` ``"peer_copy"`` or ``"auto"`` takes peer copies (CUDA IPC) from prefill
        nodes that offer them when they connect here (see :meth:`Sender.tcp`): their handshake
        offers their exported GPU pools, and this node answers in its own, accepting when its
        pools are GPU memory that can open them (one host) and then copying each write device
        to device from the prefill pools into its own, or declining with the reason (the
        prefill node then stays on the socket, unless either side asked for ``"peer_copy"``:
        the prefill node's ``connect`` raises, or this node closes the connection).
        With ``"peer_copy"``, ``listen`` raises when this node cannot take peer copies at all
        (host memory pools, a wheel without the ``cuda`` feature)."""
    @property
    def transport(self) -> Literal["tcp", "mem"]: ...
    def listen(self, addr: str) -> int: ...
    def connect(self, addr: str) -> int: ...
    def next_event(self, timeout: float = 0.0) -> Event | None: ...
    def is_peer_ready(self, peer: int) -> bool: ...
    def counters(self) -> dict[str, int]: ...
    def session_count(self) -> int: ...
    def register(
        self,
        request: int,
        prompt_len: int,
        blocks: Sequence[tuple[int, Sequence[int]]],
        writers: Sequence[int],
        *,
        aux_capacity: int = 1024,
    ) -> int: ...
    def cancel(self, request: int) -> None: ...
    def retire(self, request: int) -> None: ...
    def close(self, timeout: float = 10.0) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: Any) -> bool: ...

def rank_heads(model_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads tensor rank ``tp_rank`` of ``tp_size`` holds, as ``(first_head, kv_heads)``
    (contiguous equal shares; one replicated head when there are fewer heads than ranks).
    Raises ``ValueError`` when neither count divides the other or the rank is out of range."""

def tensor_writes_to(
    model_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int
) -> bool:
    """Whether prefill tensor rank ``src_rank`` of ``src_tp`` writes decode tensor rank
    ``dst_rank`` of ``dst_tp`` (kvpipe's writer rule for a full-attention group: their heads
    overlap and, where heads are replicated, the prefill rank is the replica the decode rank
    takes them from)."""

def mem_pair(
    sender_layout: Sequence[LayerGroup],
    sender_pools: Pools,
    receiver_layout: Sequence[LayerGroup],
    receiver_pools: Pools,
    *,
    deadlines: Deadlines | None = None,
    layer_order: Sequence[int] | None = None,
) -> tuple[Sender, Receiver]:
    """A prefill and a decode node connected in this process. ``layer_order`` is the prefill
    node's, checked as :meth:`Sender.tcp` checks it."""
