"""A vLLM KV connector over kvpipe: the prefill instance pushes each prefill chunk's KV blocks
to the decode instance as soon as the step that computed them ran.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpipeConnector",
        "kv_connector_module_path": "kvpipe.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute"}'

This module imports vLLM (``import kvpipe`` never does); it was written and tested against
vLLM 0.25.0 (``scripts/test-vllm``).

**Routing.** A proxy sends each request to both instances at once, with the same kvpipe
request id (a ``u64``; :func:`request_id` hashes a string to one) in ``kv_transfer_params``:

- to the decode instance: ``{"do_remote_prefill": True, "kvpipe_request": ID,
  "kvpipe_prefill_engine": PREFILL_ENGINE_ID}`` (the prefill instance's
  ``kv_transfer_config.engine_id``);
- to the prefill instance (``max_tokens=1``): ``{"do_remote_decode": True, "kvpipe_request":
  ID, "kvpipe_decode": "HOST:PORT", "kvpipe_decode_tp": N}`` (the decode instance's kvpipe
  address, rank ``r`` listening on ``PORT + r``, and its tensor-parallel size).

The decode instance reports the prompt as loaded externally and asynchronously, registers its
blocks with its kvpipe receiver when the scheduler allocates them, and reports the request as
received only once kvpipe completed it; a transfer that failed is reported through vLLM's load
error path (``get_block_ids_with_load_errors``), so the engine recomputes the prompt (with
``kv_load_failure_policy`` ``"recompute"``; vLLM's default ``"fail"`` fails the request). The
prefill instance submits every scheduled chunk to its kvpipe sender after the forward pass that
computed it (``wait_for_save``) and keeps the request's blocks (``request_finished`` returns
``True``) until kvpipe reports the request quiesced.

Settings (``kv_connector_extra_config``): ``kvpipe_listen`` (the decode receiver's address;
default ``kv_ip:kv_port``, each tensor rank adding its rank to the port),
``kvpipe_connections`` (TCP connections per peer, 2), ``kvpipe_deadlines`` (``{name: seconds}``
over kvpipe's defaults), ``kvpipe_registration_timeout`` (seconds the decode side waits for the
prefill ranks' handshakes before it fails a request, 60), ``kvpipe_preempt_wait`` (seconds
the prefill worker waits for a preempted request's transfer to quiesce, 15),
``kvpipe_tp_rank`` (this worker's tensor rank where vLLM's tensor-parallel group is not
initialised).

``kvpipe_layers_per_slice`` (default 0: off): with ``N`` > 0 the prefill worker pushes each
range of ``N`` layers of the step's chunks from ``save_kv_layer``, as soon as the range's last
layer is computed, while the forward pass goes on with the later layers (kvpipe's layer slices:
the last chunk's transfer overlaps its own compute). On the GPU each range is handed to kvpipe
by a worker thread once a CUDA event recorded after the layer completed; ``wait_for_save`` pushes
what is left and waits until every range of the step was handed over. A step whose layers are
not reported (``save_kv_layer`` not called, e.g. under full CUDA graphs) is pushed whole in
``wait_for_save``, as with ``N`` = 0. ``wait_for_layer_load`` does nothing: the decode side runs
a request only once all of its KV arrived.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # kvpipe itself works without vLLM; this module does not
    raise ImportError(f"kvpipe.vllm is a vLLM KV connector and needs vLLM (tested with 0.25.0): {e}") from e

import kvpipe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvpipe.vllm")

__all__ = ["KvpipeConnector", "KvpipeHandshakeMetadata", "KvpipeMetadata", "request_id", "engine_tag"]


def request_id(name: str) -> int:
    """A kvpipe request id (``u64``) for a string request id: the first 8 bytes of its
    BLAKE2b hash, so a proxy and both instances derive the same id from the same string. Two
    strings may collide (one pair in about 2^32 live requests); a colliding request is refused
    by the connector (the decode side recomputes it), never mixed up with the other."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def engine_tag(engine_id: str) -> int:
    """The 32-bit tag of a vLLM engine id that a prefill rank's kvpipe ``instance`` carries
    (``tag << 32 | tp_size << 16 | tp_rank``), so the decode side knows which connected peers
    are that engine's ranks."""
    return request_id("engine:" + engine_id) >> 32


def _kv_id(p: dict) -> int | None:
    """``kvpipe_request`` as a kvpipe request id, or ``None`` when it is not one (a malformed
    ``kv_transfer_params`` value, which comes from the client's request body: that one request
    is transferred no KV, the engine keeps running)."""
    try:
        v = int(p["kvpipe_request"])
    except (KeyError, TypeError, ValueError):
        return None
    return v if 0 <= v < 1 << 64 else None


def _decode_target(p: dict) -> tuple[str, int] | None:
    """``kvpipe_decode`` (``host:port`` of the decode instance's rank 0) and
    ``kvpipe_decode_tp`` (its tensor-parallel size, default 1), or ``None`` when malformed."""
    addr = p.get("kvpipe_decode")
    if not isinstance(addr, str) or ":" not in addr:
        return None
    host, port = addr.rsplit(":", 1)
    try:
        port_n, tp = int(port), int(p.get("kvpipe_decode_tp", 1))
    except (TypeError, ValueError):
        return None
    if not host or not 0 <= port_n < 65536 or not 1 <= tp < 65536 or port_n + tp > 65536:
        return None
    return addr, tp


@dataclass
class KvpipeHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler about itself: its decode receiver's address (``None``
    on a prefill-only worker), its kvpipe instance id and its tensor rank."""

    address: str | None
    instance: int
    tp_rank: int
    tp_size: int


@dataclass
class _Chunk:
    req_id: str
    kv_id: int
    new_block_ids: list[int]
    start: int
    end: int
    prompt_len: int
    prepopulated: int
    decode_addr: str | None  # set on the request's first chunk: open it towards these ranks
    decode_tp: int


@dataclass
class _Registration:
    req_id: str
    kv_id: int
    prompt_len: int
    first_ordinal: int
    block_ids: list[int]
    prefill_tag: int


@dataclass
class KvpipeMetadata(KVConnectorMetadata):
    """One step's work from the scheduler to the workers: chunks to send (after the forward
    pass), registrations to post and transfers to cancel (before it)."""

    chunks: list[_Chunk] = field(default_factory=list)
    registrations: list[_Registration] = field(default_factory=list)
    cancel_sends: list[str] = field(default_factory=list)
    preempted_sends: list[str] = field(default_factory=list)
    cancel_recvs: list[str] = field(default_factory=list)
    # prefill requests finished before their first chunk: cancelled towards their decode ranks
    cancel_unopened: list = field(default_factory=list)  # _Chunk


@dataclass
class _LayeredStep:
    """A step whose chunks are pushed range of layers by range (``save_kv_layer``)."""

    chunks: list  # (_Chunk, block table)
    sent: int = 0  # layers pushed so far
    failed: set = field(default_factory=set)  # kvpipe ids whose ranges stopped


class _Submitter:
    """Hands layer ranges to kvpipe, in order, each once the GPU completed the event recorded
    after its last layer: the forward pass never waits for the GPU."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kvpipe-layers", daemon=True)
        self.thread.start()

    def put(self, event, push):
        self.queue.put((event, push))

    def drain(self):
        self.queue.join()

    def close(self):
        self.queue.put(None)
        self.thread.join(10)

    def _run(self):
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                event, push = item
                event.synchronize()
                push()
            except Exception:  # a push logs and cancels its own failures; anything else is a bug
                logger.exception("kvpipe: pushing a range of layers failed")
            finally:
                self.queue.task_done()


@dataclass
class _SendState:
    kv_id: int
    decode_addr: str
    decode_tp: int
    prompt_len: int
    prepopulated: int = -1
    sent_to: int = 0  # tokens submitted so far
    opened: bool = False
    abandoned: bool = False


class KvpipeConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1`` over kvpipe (push mode). The scheduler side decides what
    moves; the worker side owns a kvpipe :class:`~kvpipe.Sender` (producer) and/or
    :class:`~kvpipe.Receiver` (consumer) over the worker's KV tensors.

    A chunk is pushed whole after its forward pass (``wait_for_save``) or, with
    ``kvpipe_layers_per_slice``, range of layers by range from ``save_kv_layer``;
    ``wait_for_layer_load`` does nothing (a request runs only once its KV arrived)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self._extra = dict(tc.kv_connector_extra_config or {})
        self._engine_id = tc.engine_id
        self._block_size = vllm_config.cache_config.block_size
        self._producer = tc.kv_role in ("kv_producer", "kv_both")
        self._consumer = tc.kv_role in ("kv_consumer", "kv_both")
        self._model_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
            self._worker = None
        else:
            self._sched = None
            self._worker = _WorkerSide(self, vllm_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # HND puts each block's bytes in kvpipe's order ([K|V][head][token][dim]), so another
        # tensor-parallel split on the other side receives head slices.
        return "HND"

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched.handshake = dict(metadata)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        """Before the forward pass that may overwrite them: a preempted prefill request's blocks
        went back to vLLM, so its transfer is cancelled and waited for until quiesced."""
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request runs only once all of its KV arrived (no layer-wise loading)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """With ``kvpipe_layers_per_slice``: pushes the step's chunks' range of layers that this
        layer completes (see the module doc); otherwise nothing."""
        if self._worker is not None:
            self._worker.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        self._worker.send_chunks(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake_metadata() if self._worker else None

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()

    # ---- for tests and operators ----
    @property
    def worker(self) -> _WorkerSide:
        """The worker side's state (its kvpipe nodes, counters); ``None`` on the scheduler."""
        return self._worker


class _SchedulerSide:
    def __init__(self, conn: KvpipeConnector):
        self.c = conn
        self.handshake: dict[int, KVConnectorHandshakeMetadata] = {}
        self.sends: dict[str, _SendState] = {}
        self.loading: set[str] = set()  # decode requests given to kvpipe (loaded once only)
        self.meta = KvpipeMetadata()

    # decode
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params or {}
        if (not self.c._consumer or not p.get("do_remote_prefill") or "kvpipe_request" not in p
                or request.request_id in self.loading):
            return 0, False
        if _kv_id(p) is None:
            logger.warning("kvpipe: request %s: kvpipe_request %r is not an id from 0 to 2**64 - 1; "
                           "its prompt is computed here", request.request_id, p.get("kvpipe_request"))
            return 0, False
        missing = request.num_prompt_tokens - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = request.kv_transfer_params or {}
        if num_external_tokens <= 0 or not p.get("do_remote_prefill") or request.request_id in self.loading:
            return
        bs = self.c._block_size
        prompt = request.num_prompt_tokens
        local = prompt - num_external_tokens
        first = local // bs
        ids = list(blocks.get_block_ids()[0][first: -(-prompt // bs)])
        self.loading.add(request.request_id)
        tag = engine_tag(p.get("kvpipe_prefill_engine", ""))
        kv_id = _kv_id(p)
        if kv_id is None:  # refused in get_num_new_matched_tokens already
            return
        self.meta.registrations.append(_Registration(request.request_id, kv_id, prompt, first, ids, tag))

    # prefill
    def on_new_request(self, request):
        p = request.kv_transfer_params or {}
        if self.c._producer and p.get("do_remote_decode") and "kvpipe_request" in p and "kvpipe_decode" in p:
            kv_id, target = _kv_id(p), _decode_target(p)
            if kv_id is None or target is None:
                logger.warning("kvpipe: request %s: malformed kv_transfer_params (kvpipe_request %r, "
                               "kvpipe_decode %r, kvpipe_decode_tp %r); its KV is not sent",
                               request.request_id, p.get("kvpipe_request"), p.get("kvpipe_decode"),
                               p.get("kvpipe_decode_tp"))
                return
            self.sends[request.request_id] = _SendState(kv_id, target[0], target[1], request.num_prompt_tokens)

    def build_connector_meta(self, so):
        for preempted in so.preempted_req_ids or ():
            s = self.sends.get(preempted)
            if s is not None and s.opened and not s.abandoned:
                s.abandoned = True
                self.meta.preempted_sends.append(preempted)
        for new in so.scheduled_new_reqs:
            self._chunk(new.req_id, new.block_ids[0], new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self.sends:
                nb = cached.new_block_ids[i]
                self._chunk(rid, nb[0] if nb else [], cached.num_computed_tokens[i], so)
        meta, self.meta = self.meta, KvpipeMetadata()
        return meta

    def _chunk(self, rid, new_ids, computed, so):
        s = self.sends.get(rid)
        if s is None or s.abandoned or computed >= s.prompt_len:
            return
        if s.prepopulated < 0:
            s.prepopulated = computed
        if computed != s.sent_to and s.opened:  # recomputed after a preemption: not streamable
            s.abandoned = True
            self.meta.cancel_sends.append(rid)
            return
        end = min(computed + so.num_scheduled_tokens.get(rid, 0), s.prompt_len)
        first = not s.opened
        s.opened, s.sent_to = True, end
        self.meta.chunks.append(_Chunk(rid, s.kv_id, list(new_ids), computed, end, s.prompt_len, s.prepopulated,
                                       s.decode_addr if first else None, s.decode_tp))

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self.loading:
            self.loading.discard(rid)
            if request.status == RequestStatus.FINISHED_ABORTED:
                # Aborted, maybe while its KV was still on the way: vLLM keeps the blocks of a
                # request waiting for remote KV until the worker reports it received, which
                # the worker does once kvpipe quiesced it (nothing happens if it arrived).
                self.meta.cancel_recvs.append(rid)
        s = self.sends.pop(rid, None)
        if s is None:
            return False, None
        if not s.opened:
            # Finished before its first chunk (aborted, rejected): the decode side, which may
            # have registered it already, hears the cancel instead of waiting out its deadline.
            self.meta.cancel_unopened.append(_Chunk(rid, s.kv_id, [], 0, 0, s.prompt_len, 0, s.decode_addr,
                                                    s.decode_tp))
            return False, None
        if s.sent_to < s.prompt_len and not s.abandoned:
            self.meta.cancel_sends.append(rid)  # aborted mid-prefill
        return True, {"kvpipe_request": s.kv_id, "kvpipe_prefill_engine": self.c._engine_id}


class _WorkerSide:
    def __init__(self, conn: KvpipeConnector, vllm_config):
        self.c = conn
        self.extra = conn._extra
        self.tp_size = conn._tp_size
        self.tp_rank = self._tp_rank()
        self.sender: kvpipe.Sender | None = None
        self.receiver: kvpipe.Receiver | None = None
        self.address: str | None = None
        self.instance = (engine_tag(conn._engine_id) << 32) | (self.tp_size << 16) | self.tp_rank
        self.layout_hnd = True
        self.cuda = False
        # prefill
        self.decode_peers: dict[str, tuple[int, float]] = {}  # "host:port" -> (peer, connected at)
        self.connect_failed: dict[str, tuple[float, str]] = {}  # "host:port" -> (when, why)
        self.send_tables: dict[int, list[int]] = {}  # kv id -> block table
        self.send_req: dict[int, str] = {}  # kv id -> vLLM id
        self.send_done: set[str] = set()  # quiesced (or never held), not yet finished by vLLM
        self.finished: set[str] = set()  # finished by vLLM, transfer still held
        # decode
        self.peer_instance: dict[int, int] = {}  # prefill peer -> instance
        self.pending: dict[str, tuple[_Registration, float]] = {}
        self.recv_req: dict[int, tuple[str, list[int]]] = {}  # kv id -> (vLLM id, block ids)
        self.recv_ok: set[int] = set()
        self.recv_done: set[str] = set()
        self.load_errors: set[int] = set()
        # layer-wise pushing
        self.layers_per_slice = int(self.extra.get("kvpipe_layers_per_slice", 0))
        if self.layers_per_slice < 0:
            raise ValueError(f"kvpipe: kvpipe_layers_per_slice is {self.layers_per_slice}; it must be 0 (whole "
                             "chunks) or more")
        self.layer_index: dict[str, int] = {}
        self.layered: _LayeredStep | None = None  # the step whose layers are being pushed
        self.submitter: _Submitter | None = None

    def _tp_rank(self) -> int:
        if "kvpipe_tp_rank" in self.extra:
            return int(self.extra["kvpipe_tp_rank"])
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return get_tensor_model_parallel_rank()
        except Exception:  # no tensor-parallel group (one rank)
            return 0

    def _deadlines(self):
        return self.extra.get("kvpipe_deadlines")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def index(name):
            m = re.findall(r"\d+", name)
            return int(m[-1]) if m else 0

        names = sorted(kv_caches, key=index)
        self.layer_index = {name: i for i, name in enumerate(names)}
        pools, groups = {}, None
        for i, name in enumerate(names):
            t = kv_caches[name]
            if t.dim() != 5 or t.shape[1] != 2:
                raise ValueError(f"kvpipe: layer {name} has a KV cache of shape {tuple(t.shape)}; the connector "
                                 "needs vLLM's (num_blocks, 2, block_size, kv_heads, head_dim) layout")
            nb, _, bs, heads, dim = t.shape
            order = sorted(range(5), key=lambda d: -t.stride(d))
            phys = t.permute(order)
            if order[0] != 0 or order[1] != 1 or not phys.is_contiguous():
                raise ValueError(f"kvpipe: layer {name}'s KV cache does not keep each block's K and V together "
                                 f"(strides {t.stride()})")
            self.layout_hnd = order == [0, 1, 3, 2, 4]
            self.cuda = t.is_cuda
            slot = 2 * bs * heads * dim * t.element_size()
            pools[i] = phys.reshape(nb, -1).view(torch.uint8)
            if groups is None:
                groups = (nb, bs, heads, dim, t.element_size())
        nb, bs, heads, dim, elem = groups
        first_head, share = kvpipe.rank_heads(self.c._model_heads, self.tp_size, self.tp_rank)
        if share != heads:
            raise ValueError(f"kvpipe: tensor rank {self.tp_rank} of {self.tp_size} should hold {share} KV heads "
                             f"of {self.c._model_heads}, its cache holds {heads}")
        self.layout = [kvpipe.LayerGroup(
            layers=len(names), kv_heads=heads, head_dim=dim, elem_bytes=elem, tokens_per_block=bs,
            pools=[kvpipe.Pool(region=i, layers=1, slot_bytes=slot, layer_begin=i) for i in range(len(names))],
            model_kv_heads=self.c._model_heads, first_head=first_head)]
        self.pools = pools
        kw = dict(connections=int(self.extra.get("kvpipe_connections", 2)), deadlines=self._deadlines(),
                  instance=self.instance, tp_size=self.tp_size, tp_rank=self.tp_rank)
        if self.c._producer:
            self.sender = kvpipe.Sender.tcp(self.layout, pools, **kw)
        if self.c._consumer:
            self.receiver = kvpipe.Receiver.tcp(self.layout, pools, **kw)
            tc = self.c._kv_transfer_config
            listen = self.extra.get("kvpipe_listen", f"{tc.kv_ip}:{tc.kv_port}")
            host, port = listen.rsplit(":", 1)
            port = int(port) + self.tp_rank if int(port) else 0
            self.address = f"{host}:{self.receiver.listen(f'{host}:{port}')}"

    def handshake_metadata(self):
        return KvpipeHandshakeMetadata(self.address, self.instance, self.tp_rank, self.tp_size)

    # ---- each step ----
    def start_step(self, meta: KvpipeMetadata):
        self.poll()
        self.handle_preemptions(meta)  # done already where the model runner called it
        for reg in meta.registrations:
            if any(rid == reg.req_id for rid, _ in self.recv_req.values()) or reg.kv_id in self.recv_req:
                logger.warning("kvpipe: request %s's id %d is in use; it is recomputed", reg.req_id, reg.kv_id)
                self._recv_failed_local(reg)
                continue
            self.pending[reg.req_id] = (reg, time.monotonic())
        for rid in meta.cancel_recvs:
            if rid in self.pending:
                reg, _ = self.pending.pop(rid)
                self._recv_failed_local(reg)
            else:
                for kv_id, (r, _) in list(self.recv_req.items()):
                    if r == rid:
                        self._quietly(self.receiver.cancel, kv_id)
        for rid in meta.cancel_sends:
            for kv_id, r in list(self.send_req.items()):
                if r == rid:
                    self._quietly(self.sender.cancel, kv_id)
        for ch in meta.cancel_unopened:
            self._cancel_unopened(ch)
        self._post_pending()

    def handle_preemptions(self, meta: KvpipeMetadata):
        waiting = set()
        for rid in meta.preempted_sends:
            for kv_id, r in list(self.send_req.items()):
                if r == rid:
                    self._quietly(self.sender.cancel, kv_id)
                    waiting.add(kv_id)
        deadline = time.monotonic() + float(self.extra.get("kvpipe_preempt_wait", 15.0))
        while waiting & self.send_req.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("kvpipe: preempted requests %s did not quiesce in time; their blocks may still be "
                             "read", sorted(self.send_req[k] for k in waiting & self.send_req.keys()))
                return
            e = self.sender.next_event(min(left, 0.1))
            if e is not None:
                self._sender_event(e)

    def _quietly(self, fn, *args):
        try:
            fn(*args)
        except kvpipe.KvpipeError as e:
            logger.info("kvpipe: %s", e)

    def _recv_failed_local(self, reg: _Registration):
        """A registration that never reached kvpipe: report it received, its blocks unloaded."""
        self.load_errors.update(reg.block_ids)
        self.recv_done.add(reg.req_id)

    def _post_pending(self):
        now = time.monotonic()
        timeout = float(self.extra.get("kvpipe_registration_timeout", 60.0))
        for rid, (reg, since) in list(self.pending.items()):
            writers = self._writers(reg.prefill_tag)
            if writers is None:
                if now - since > timeout:
                    connected = sorted({inst >> 32 for inst in self.peer_instance.values()})
                    logger.warning("kvpipe: no handshake with every writing rank of prefill engine tag %#x "
                                   "(kvpipe_prefill_engine; kvpipe.vllm.engine_tag(name) gives a name's tag) for request %s "
                                   "in %.0f s; engine tags connected: %s",
                                   reg.prefill_tag, rid, timeout,
                                   ", ".join(f"{t:#x}" for t in connected) or "none")
                    del self.pending[rid]
                    self._recv_failed_local(reg)
                continue
            del self.pending[rid]
            try:
                self.receiver.register(reg.kv_id, reg.prompt_len, [(reg.first_ordinal, reg.block_ids)], writers)
            except (kvpipe.KvpipeError, ValueError, TypeError, OverflowError) as e:
                logger.warning("kvpipe: request %s (id %d) not registered: %s", rid, reg.kv_id, e)
                self._recv_failed_local(reg)
                continue
            self.recv_req[reg.kv_id] = (rid, reg.block_ids)

    def _writers(self, tag: int) -> list[int] | None:
        """The ready peers of engine ``tag`` that write this rank, once all of them are ready."""
        ranks = {}
        src_tp = None
        for peer, inst in list(self.peer_instance.items()):
            if not self.receiver.is_peer_ready(peer):  # lost (a restarted engine connects anew)
                del self.peer_instance[peer]
                continue
            if inst >> 32 == tag:
                src_tp = (inst >> 16) & 0xFFFF
                ranks[inst & 0xFFFF] = peer
        if src_tp is None:
            return None
        need = [r for r in range(src_tp) if kvpipe.tensor_writes_to(self.c._model_heads, src_tp, r, self.tp_size, self.tp_rank)]
        if any(r not in ranks for r in need):
            return None
        return [ranks[r] for r in need]

    def send_chunks(self, meta: KvpipeMetadata):
        """After the step's forward pass (``wait_for_save``): the rest of a step pushed layer by
        layer, or every chunk whole."""
        if self.layered is not None:
            step, self.layered = self.layered, None
            if step.sent < len(self.layer_index):
                self._push_layers(step, len(self.layer_index))
            if self.submitter is not None:
                self.submitter.drain()  # every range of this step is with kvpipe before the next step
            return
        if not meta.chunks:
            return
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the chunk's KV is computed before it is read
        for ch, table in self._step_chunks(meta):
            self._submit(ch, table, None, set())

    def save_layer(self, meta: KvpipeMetadata, name: str):
        """``save_kv_layer``: once ``layers_per_slice`` more layers (or the last) are computed,
        the step's chunks' range of them goes out."""
        if self.layers_per_slice == 0 or self.sender is None or not meta.chunks:
            return
        index = self.layer_index.get(name)
        if index is None:
            return
        if self.layered is None:
            self.layered = _LayeredStep(self._step_chunks(meta))
        step, end = self.layered, index + 1
        if end - step.sent >= self.layers_per_slice or (end == len(self.layer_index) and end > step.sent):
            self._push_layers(step, end)

    def _push_layers(self, step: _LayeredStep, end: int):
        """Hands layers ``[step.sent, end)`` of the step's chunks to kvpipe: at once on the CPU, by
        the submitter once the GPU computed them."""
        layers, step.sent = (step.sent, end), end

        def push():
            for ch, table in step.chunks:
                if ch.kv_id not in step.failed:
                    self._submit(ch, table, layers, step.failed)

        if not self.cuda:
            push()
            return
        if self.submitter is None:
            self.submitter = _Submitter()
        done = torch.cuda.Event()
        done.record()  # on the forward pass's stream, after this layer's kernels
        self.submitter.put(done, push)

    def _step_chunks(self, meta: KvpipeMetadata) -> list[tuple[_Chunk, list[int]]]:
        """The step's chunks that go out (their requests opened where new) with their block
        tables, grown by the step's new blocks."""
        out = []
        for ch in meta.chunks:
            if ch.decode_addr is not None:
                if not self._open(ch):
                    continue
            table = self.send_tables.get(ch.kv_id)
            if table is None or self.send_req.get(ch.kv_id) != ch.req_id:
                continue
            table.extend(ch.new_block_ids)
            out.append((ch, table))
        return out

    def _submit(self, ch: _Chunk, table: list[int], layers: tuple[int, int] | None, failed: set[int]):
        """One chunk (``layers``: one range of its layers) to kvpipe, and the aux data after the
        request's last; a refusal cancels the request (and ``failed`` keeps its later ranges)."""
        last = ch.end >= ch.prompt_len
        try:
            self.sender.submit_chunk(ch.kv_id, ch.start, ch.end, ch.prompt_len, [table],
                                     prepopulated_len=ch.prepopulated, is_last=last, layers=layers)
            if last and (layers is None or layers[1] == len(self.layer_index)):
                self.sender.submit_aux(ch.kv_id, [], prompt_tokens=ch.prompt_len, cached_tokens=ch.prepopulated)
        except kvpipe.KvpipeError as e:
            # A request that ended under its chunks (an abort on either side, the decode side's
            # cancel, a lost peer) is routine; anything else is worth a warning.
            level = logging.INFO if isinstance(e, kvpipe.SessionEndedError) else logging.WARNING
            logger.log(level, "kvpipe: request %s chunk %d..%d%s not sent: %s", ch.req_id, ch.start, ch.end,
                       "" if layers is None else f" layers {layers[0]}..{layers[1]}", e)
            failed.add(ch.kv_id)
            self._quietly(self.sender.cancel, ch.kv_id)

    def _open(self, ch: _Chunk) -> bool:
        if ch.kv_id in self.send_req:
            logger.warning("kvpipe: request %s's id %d is in use; it is not sent", ch.req_id, ch.kv_id)
            self.send_done.add(ch.req_id)
            return False
        host, port = ch.decode_addr.rsplit(":", 1)
        if not self.layout_hnd and ch.decode_tp != self.tp_size:
            logger.warning("kvpipe: request %s: another tensor-parallel size needs the HND KV layout", ch.req_id)
            self.send_done.add(ch.req_id)
            return False
        peers = []
        try:
            for d in range(ch.decode_tp):
                if kvpipe.tensor_writes_to(self.c._model_heads, self.tp_size, self.tp_rank, ch.decode_tp, d):
                    peers.append(self._decode_peer(f"{host}:{int(port) + d}"))
            self.sender.open_request(ch.kv_id, peers)
        except (kvpipe.KvpipeError, ValueError, TypeError, OverflowError) as e:
            # (ValueError: a decode tensor-parallel size the model's heads cannot be split over.)
            logger.warning("kvpipe: request %s (id %d) not opened: %s", ch.req_id, ch.kv_id, e)
            self.send_done.add(ch.req_id)
            return False
        self.send_req[ch.kv_id] = ch.req_id
        self.send_tables[ch.kv_id] = []
        return True

    def _decode_peer(self, addr: str) -> int:
        """The peer for a decode rank's address: connected on first use, and again when the
        connection is not ready past the handshake deadline (a decode instance that restarted)."""
        handshake = float((self._deadlines() or {}).get("handshake", 5.0))
        known = self.decode_peers.get(addr)
        if known is not None:
            peer, since = known
            if self.sender.is_peer_ready(peer) or time.monotonic() - since < handshake:
                return peer
        failed = self.connect_failed.get(addr)
        if failed is not None and time.monotonic() - failed[0] < handshake:
            # A connect to it failed moments ago (it can take the whole handshake deadline, on
            # the forward pass's thread): the requests meanwhile fail at once instead of
            # each waiting as long again.
            raise kvpipe.TransportError(f"{addr}: {failed[1]} (a connect less than {handshake:.0f} s ago; "
                                        "not tried again yet)")
        try:
            peer = self.sender.connect(addr)
        except kvpipe.KvpipeError as e:
            self.connect_failed[addr] = (time.monotonic(), str(e))
            raise
        self.connect_failed.pop(addr, None)
        self.decode_peers[addr] = (peer, time.monotonic())
        return peer

    def _cancel_unopened(self, ch: _Chunk):
        """A request finished before its first chunk: opened towards its decode ranks this
        rank is connected to, and cancelled at once, so that they hear of it (no connect is
        made for it)."""
        if self.sender is None or ch.kv_id in self.send_req:
            return
        host, port = ch.decode_addr.rsplit(":", 1)
        peers = []
        try:
            for d in range(ch.decode_tp):
                if kvpipe.tensor_writes_to(self.c._model_heads, self.tp_size, self.tp_rank, ch.decode_tp, d):
                    known = self.decode_peers.get(f"{host}:{int(port) + d}")
                    if known is not None and self.sender.is_peer_ready(known[0]):
                        peers.append(known[0])
            if not peers:
                return
            self.sender.open_request(ch.kv_id, peers)
            self.sender.cancel(ch.kv_id)
        except (kvpipe.KvpipeError, ValueError, TypeError, OverflowError) as e:
            logger.info("kvpipe: request %s (id %d) finished before its first chunk; its decode ranks "
                        "were not told: %s", ch.req_id, ch.kv_id, e)
            return
        # Nothing of it is read (no chunk): its Quiesced only retires it (`_sender_event`).

    def poll(self):
        if self.sender is not None:
            while (e := self.sender.next_event(0.0)) is not None:
                self._sender_event(e)
        if self.receiver is not None:
            while (e := self.receiver.next_event(0.0)) is not None:
                if e.kind == "peer_ready":
                    self.peer_instance[e.peer] = e.instance
                elif e.kind == "completed":
                    self.recv_ok.add(e.request)
                elif e.kind == "quiesced":
                    rid, ids = self.recv_req.pop(e.request, (None, []))
                    self._quietly(self.receiver.retire, e.request)
                    if rid is not None:
                        if e.request not in self.recv_ok:
                            self.load_errors.update(ids)
                        self.recv_done.add(rid)
                    self.recv_ok.discard(e.request)
                elif e.kind in ("failed", "timed_out", "cancelled"):
                    logger.info("kvpipe: receiving %s: %s", self.recv_req.get(e.request, ("?",))[0], e.message)
                elif e.kind in ("peer_rejected", "protocol_violation"):
                    logger.warning("kvpipe: %s", e.message)

    def _sender_event(self, e):
        if e.kind == "quiesced":
            rid = self.send_req.pop(e.request, None)
            self.send_tables.pop(e.request, None)
            self._quietly(self.sender.retire, e.request)
            if rid is not None:
                self.send_done.add(rid)
        elif e.kind in ("failed", "timed_out", "cancelled"):
            logger.info("kvpipe: sending %s: %s", self.send_req.get(e.request), e.message)
        elif e.kind == "peer_lost":
            # Its requests fail on their own; later ones connect again.
            for addr, (peer, _) in list(self.decode_peers.items()):
                if peer == e.peer:
                    del self.decode_peers[addr]
                    logger.info("kvpipe: lost decode rank %s: %s", addr, e.message)
        elif e.kind in ("peer_rejected", "protocol_violation"):
            logger.warning("kvpipe: %s", e.message)

    def get_finished(self, finished_req_ids: set[str]):
        self.poll()
        self._post_pending()
        self.finished |= finished_req_ids
        sending = self.send_done & self.finished
        self.send_done -= sending
        self.finished -= sending
        # vLLM's finished ids of requests this worker never held would pile up: keep only those
        # whose transfer is still open here.
        held = set(self.send_req.values())
        self.finished &= held | self.send_done
        recving, self.recv_done = self.recv_done, set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def held(self) -> dict[str, int]:
        """Requests whose blocks kvpipe may still touch (not quiesced yet): being sent, being
        received (or waiting for the prefill ranks' handshakes)."""
        return {"sending": len(self.send_req), "receiving": len(self.recv_req) + len(self.pending)}

    def counters(self) -> dict[str, dict[str, int]]:
        """The kvpipe nodes' counters, by role."""
        out = {}
        if self.sender is not None:
            out["sender"] = self.sender.counters()
        if self.receiver is not None:
            out["receiver"] = self.receiver.counters()
        return out

    def close(self):
        if self.submitter is not None:
            self.submitter.close()
            self.submitter = None
        for node in (self.sender, self.receiver):
            if node is not None:
                try:
                    node.close(5.0)
                except kvpipe.KvpipeError as e:
                    logger.info("kvpipe: close: %s", e)
        self.sender = self.receiver = None
