"""One vLLM instance for the connector tests: vLLM 0.25's real scheduler (``Scheduler`` or
``AsyncScheduler``) with the kvpipe connector loaded by module path on the scheduler side, and
the worker side driven through vLLM's ``KVConnectorModelRunnerMixin`` over CPU KV tensors in
vLLM's per-layer layout ``(num_blocks, 2, block_size, kv_heads, head_dim)`` (HND strides, as
the connector asks). The "model" writes a known pattern per (request, token, layer) into the
blocks of the tokens each step computes, so the decode side can check every byte it got.

A prefill instance runs in its own process (:func:`serve`, driven over a pipe); the decode
instance runs in the test process.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import logging
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16
EOS = 2
PREFILL_ENGINE = "kvpipe-test-prefill"
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def model_dir() -> str:
    """A local model directory with a hand-written config (no weights, no tokenizer)."""
    d = os.path.join(tempfile.gettempdir(), "kvpipe-vllm-tiny-llama")
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * HEAD_DIM * 2,
        "intermediate_size": 128, "num_attention_heads": KV_HEADS * 2, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": EOS, "rms_norm_eps": 1e-5,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def make_config(role: str, async_scheduling: bool, *, extra: dict | None = None, max_batched: int = 32,
                max_seqs: int = 32, policy: str = "recompute", tp: int = 1,
                long_prefill: int = 0, reserve_full_prompt: bool = True) -> VllmConfig:
    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                        max_model_len=4096)
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched, max_model_len=4096,
                            enable_chunked_prefill=True, is_encoder_decoder=False,
                            disable_hybrid_kv_cache_manager=True, async_scheduling=async_scheduling,
                            long_prefill_token_threshold=long_prefill,
                            scheduler_reserve_full_isl=reserve_full_prompt)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    extra = dict(extra or {})
    extra.setdefault("kvpipe_listen", "127.0.0.1:0")
    extra.setdefault("kvpipe_deadlines", {"liveness_timeout": 3.0, "heartbeat_interval": 0.5})
    kv = KVTransferConfig(kv_connector="KvpipeConnector", kv_connector_module_path="kvpipe.vllm", kv_role="kv_both",
                          engine_id=PREFILL_ENGINE if role == "prefill" else "kvpipe-test-decode",
                          kv_connector_extra_config=extra, kv_load_failure_policy=policy)
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(tensor_parallel_size=tp))


def pattern(kv_id: int, token: int, layer: int) -> np.ndarray:
    """The KV bytes (K and V, every head) the model computes for one token of one layer."""
    n = 2 * KV_HEADS * HEAD_DIM * 2
    seed = (kv_id * 1_000_003 + token * 131 + layer * 7) & 0xFFFFFFFF
    base = np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 40503)
    return ((base >> np.uint64(13)) & np.uint64(0xFF)).astype(np.uint8).reshape(2, KV_HEADS, HEAD_DIM * 2)


class Instance:
    """A scheduler, its connector's scheduler and worker sides, and the worker's KV tensors."""

    def __init__(self, role: str, async_scheduling: bool, num_blocks: int = 256, tp: int = 1,
                 layer_wise: bool = False, **config):
        self.role = role
        # The "model" computes layer by layer and reports each layer (``save_kv_layer``), as
        # vLLM's attention layers do; otherwise it writes every layer, then the step ends.
        self.layer_wise = layer_wise
        self.layer_slices = []  # per layer-wise step: the sender's slices before it and after each layer
        self.vllm_config = make_config(role, async_scheduling, tp=tp, **config)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
                             structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=BLOCK)
        assert type(self.scheduler.connector).__name__ == "KvpipeConnector"
        # The workers (one per tensor rank): the connector made as vLLM's workers make it, then
        # its KV tensors, in the per-layer shape (num_blocks, 2, block_size, kv_heads, head_dim)
        # with HND strides; rank r of tp holds KV heads r*H/tp .. (r+1)*H/tp.
        self.tp, self.heads = tp, KV_HEADS // tp
        self.workers, self.phys_by_rank = [], []
        kv = self.vllm_config.kv_transfer_config
        filler = 0xA5 if role == "decode" else 0x3C
        for rank in range(tp):
            cfg = copy.copy(self.vllm_config)
            cfg.kv_transfer_config = dataclasses.replace(
                kv, kv_connector_extra_config=dict(kv.kv_connector_extra_config, kvpipe_tp_rank=rank))
            worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, self.kv_cache_config)
            phys, caches = [], {}
            for name in LAYER_NAMES:
                t = torch.zeros((num_blocks, 2, self.heads, BLOCK, HEAD_DIM), dtype=torch.float16)
                t.view(torch.uint8).fill_(filler)
                phys.append(t.view(torch.uint8).numpy())
                caches[name] = t.permute(0, 1, 3, 2, 4)  # logical NHD shape, physical HND
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.phys_by_rank.append(phys)
        self.worker, self.phys = self.workers[0], self.phys_by_rank[0]
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.aggregator = KVOutputAggregator(tp)  # what vLLM's executor merges the ranks' outputs with
        self.address = self.worker.worker.address
        self.pending = collections.deque()  # async: the step whose output is not applied yet
        self.async_scheduling = async_scheduling
        self.kv_ids: dict[str, int] = {}
        self.on_schedule = None  # called with each SchedulerOutput before the forward pass
        self.log = []  # per step: {req_id: (start, end)} of prefill tokens computed

    # ---- requests ----
    def add(self, req_id: str, kv_id: int, prompt_len: int, max_tokens: int, params: dict):
        tokens = [(kv_id + i) % 997 + 3 for i in range(prompt_len)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                      mm_features=None)
        req.kv_transfer_params = {"kvpipe_request": kv_id, **params}  # params may override it
        self.kv_ids[req_id] = kv_id
        self.scheduler.add_request(req)

    def abort(self, req_id: str):
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ---- one engine step ----
    def step(self):
        so = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(so)
        out = self._execute(so)
        if self.async_scheduling:
            # vLLM's engine core schedules the next step before this one's output is applied.
            self.pending.append((so, out))
            if len(self.pending) > 1 or so.total_num_scheduled_tokens == 0:
                self.scheduler.update_from_output(*self.pending.popleft())
        else:
            self.scheduler.update_from_output(so, out)
        return so

    def flush(self):
        while self.pending:
            self.scheduler.update_from_output(*self.pending.popleft())

    def _execute(self, so):
        outs = [self._execute_rank(so, rank) for rank in range(self.tp)]
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        return self.aggregator.aggregate(outs)

    def _execute_rank(self, so, rank):
        worker = self.workers[rank]
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        worker.handle_preemptions(so.kv_connector_metadata)  # as vLLM's GPU model runner does, first
        if so.total_num_scheduled_tokens == 0:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.vllm_config)
        computed = {}
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
        heads = slice(rank * self.heads, (rank + 1) * self.heads)
        phys = self.phys_by_rank[rank]
        req_ids, sampled, chunks, work = [], [], {}, []
        with set_forward_context(None, self.vllm_config), \
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out:
            for rid, n in so.num_scheduled_tokens.items():
                start = computed[rid]
                req = self.scheduler.requests[rid]
                blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
                end = start + n
                prompt = req.num_prompt_tokens
                work.append((self.kv_ids[rid], blocks, range(start, min(end, prompt))))
                if start < prompt:
                    chunks[rid] = (start, min(end, prompt))
                req_ids.append(rid)
                sampled.append([7] if end >= prompt else [])
            # "forward": this step's tokens' KV, layer by layer
            slices = [self._slices(worker)]
            for layer in range(LAYERS):
                for kv_id, blocks, tokens in work:
                    for t in tokens:
                        phys[layer][blocks[t // BLOCK], :, :, t % BLOCK, :] = pattern(kv_id, t, layer)[:, heads]
                if self.layer_wise:
                    worker.save_kv_layer(LAYER_NAMES[layer], None, None)
                    slices.append(self._slices(worker))
            if self.layer_wise and rank == 0 and chunks:
                self.layer_slices.append(slices)
        if rank == 0:
            self.log.append(chunks)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, kv_connector_output=kv_out)

    @staticmethod
    def _slices(worker) -> int:
        return worker.worker.counters().get("sender", {}).get("slices", 0)

    # ---- checks ----
    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def kv_matches(self, req_id: str, upto_tokens: int) -> bool:
        """Whether the request's first ``upto_tokens`` tokens hold the prefill side's KV."""
        blocks = self.blocks_of(req_id)
        kv_id = self.kv_ids[req_id]
        for t in range(upto_tokens):
            for layer in range(LAYERS):
                if not np.array_equal(self.phys[layer][blocks[t // BLOCK], :, :, t % BLOCK, :],
                                      pattern(kv_id, t, layer)):
                    return False
        return True

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def total_blocks(self) -> int:
        return self.kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block

    def idle(self) -> bool:
        s = self.scheduler
        return not s.requests and self.free_blocks() == self.total_blocks()

    def counters(self):
        return self.worker.worker.counters()

    def held(self):
        total = collections.Counter()
        for worker in self.workers:
            total.update(worker.worker.held())
        return {"sending": total["sending"], "receiving": total["receiving"]}


class _WarningsKept(logging.Handler):
    """Keeps the messages kvpipe's loggers write at WARNING or above, for the test to read."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def serve(conn, async_scheduling: bool, config: dict):
    """The prefill instance's process: runs commands from the test over ``conn``."""
    inst = Instance("prefill", async_scheduling, **config)
    warned = _WarningsKept()
    logging.getLogger("kvpipe").addHandler(warned)
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "add":
            for a in arg:
                inst.add(*a)
            conn.send(("ok", None))
        elif cmd == "step":
            so = inst.step()
            conn.send(("ok", {"scheduled": so.total_num_scheduled_tokens,
                              "chunks": inst.log[-1] if so.total_num_scheduled_tokens else {},
                              "layer_slices": inst.layer_slices[-1] if inst.layer_slices else [],
                              "preempted": sorted(so.preempted_req_ids or ()),
                              "requests": len(inst.scheduler.requests)}))
        elif cmd == "abort":
            inst.abort(arg)
            conn.send(("ok", None))
        elif cmd == "state":
            s = inst.scheduler
            conn.send(("ok", {"requests": sorted(s.requests), "free": inst.free_blocks(),
                              "status": {r: (q.status.name, q.num_computed_tokens, q.num_preemptions)
                                         for r, q in s.requests.items()},
                              "total": inst.total_blocks(), "counters": inst.counters(), "held": inst.held(),
                              "finished_recving": sorted(s.finished_recving_kv_req_ids)}))
        elif cmd == "run_until_idle":
            deadline = time.monotonic() + arg
            while not inst.idle() and time.monotonic() < deadline:
                inst.step()
                time.sleep(0.002)
            inst.flush()
            conn.send(("ok", inst.idle()))
        elif cmd == "warnings":
            conn.send(("ok", list(warned.messages)))
        elif cmd == "close":
            for worker in inst.workers:
                worker.shutdown()
            conn.send(("ok", None))
            return
