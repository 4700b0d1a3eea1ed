"""Disaggregated generation with a real model: a prefill process computes a prompt's KV cache in
chunks, kvpipe streams each chunk's completed blocks into a decode process's paged KV pool while
the next chunk computes, and the decode process generates from that pool alone. The decode
side's greedy tokens must equal those of one process doing everything.

    python disagg_generate.py --device cuda                  # Llama-shaped model, bf16, 1k and 8k
    python disagg_generate.py --device cuda --prompt-lens 1024,8192,32768
    python disagg_generate.py --device cuda --model sliding  # Qwen2, sliding layers every other
    python disagg_generate.py --device cpu                   # tiny model, host pools, fp32
    python disagg_generate.py --device cuda --data-path socket --decode-blocks reversed

The model is built from a config written here with random weights from a fixed seed
(``torch.manual_seed``); nothing is downloaded (``HF_HUB_OFFLINE=1``). This process is the decode
side; it starts the prefill side as a child process (``--role prefill``) and drives it over its
stdin/stdout. The two talk KV only through kvpipe's TCP transport: on CUDA with
``--data-path peer_copy`` (the default there) the prefill process copies device to device into
the decode process's pools through CUDA IPC (control frames over TCP); ``--data-path socket``
moves GPU bytes through pinned staging over loopback TCP; on CPU the pools are host memory and
the bytes go over the sockets.

**The paged KV pool** is laid out as vLLM lays it out (FlashInfer's NHD layout): per layer one
tensor ``(num_blocks, 2, block_size, kv_heads, head_dim)``. kvpipe names block slot ``b`` of a
pool as the bytes ``[b * slot_bytes, (b + 1) * slot_bytes)`` and assumes
``[layer][K|V][head][token][dim]`` inside a slot. kvpipe has no ``[K|V][token][head][dim]``
layout, so this script describes each layer as its own pool (``layers=1``, ``slot_bytes`` = one
layer's block, ``2 * block_size * kv_heads * head_dim * elem_bytes``): a block slot is then
exactly vLLM's contiguous ``pool[b]``, and kvpipe copies whole slots byte for byte. The order
inside a slot only matters to kvpipe when it cuts heads out of a slot (different tensor-parallel
sizes on the two sides), which this example does not do (one rank each side, whole blocks; the
last, partly filled block is sent whole). vLLM's FlashAttention backend keeps K and V apart,
``(2, num_blocks, block_size, kv_heads, head_dim)`` per layer: a slot would then be two
separate ranges, which one kvpipe pool cannot name (it would take a K and a V layer group of
``kv_factor=1`` sharing one block table).

The prefill loop hands each chunk to a submit thread, which waits for a CUDA event recorded after
the chunk's copy into the pool (kvpipe synchronises no stream) and then calls ``submit_chunk``,
so the next chunk's kernels are launched meanwhile.

**Layer groups**: the Llama config is one full-attention group. The sliding config (Qwen2 with
``layer_types`` alternating sliding/full and a ``sliding_window``) has two groups: the full layers
and the sliding layers with ``window=sliding_window``; kvpipe sends the sliding group's blocks
only from its stale boundary ``(prompt_len + 1 - window) // block_size`` on, and the decode side
registers only those.

**The checks**, printed as one JSON object (and written to ``--out``):
``verified``: the decode side's tokens (first token from the prefill side's aux data, then
``--new-tokens`` greedy steps from the KV rebuilt out of the pool) equal those of the ``local``
run, where the decode process computes the same chunked prefill itself and generates;
``corruption_detected``: one byte of the decode pool changed before a second generation (the
high byte of a V element of the prompt token the first decode step attends to most) changes the
logits and the tokens; the time to first token on the decode
side for ``pipelined`` (each chunk submitted as computed), ``monolithic`` (the whole prompt
submitted once prefill ends) and ``local`` runs, with ratios. TTFT here is from the moment the
decode process tells the prefill process to start until the decode process holds the first token
and a cache it can generate from (the KV landed in its pool and gathered into a
``DynamicCache``); for ``local`` until its own prefill produced the first token.
"""

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import kvpipe  # noqa: E402

SEED = 1234
DEADLINES = {"registration": 120.0, "result_wait": 300.0, "result_idle": 120.0, "aux_wait": 300.0,
             "write_completion": 120.0, "quiesce": 60.0}


# ---------------------------------------------------------------------------------------------
# The model and its KV shape


def model_config(kind, size):
    """The config of the model: ``kind`` llama (full attention) or sliding (Qwen2, every other
    layer a sliding-window layer); ``size`` small (GPU) or tiny (CPU tests)."""
    if size == "small":
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
        window = 768
    else:
        dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
        window = 640
    # Weights drawn wider than the usual 0.02, so that greedy tokens depend on the whole prompt
    # (with 0.02 a random model repeats one or two tokens whatever its cache holds, and a check
    # of equal tokens would prove little).
    common = dict(max_position_embeddings=65536, tie_word_embeddings=False, initializer_range=0.1,
                  **dims)
    if kind == "llama":
        return LlamaConfig(head_dim=dims["hidden_size"] // dims["num_attention_heads"], **common)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(dims["num_hidden_layers"])]
    return Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=0,
                       layer_types=layer_types, **common)


def build_model(args):
    torch.manual_seed(SEED)
    config = model_config(args.model, args.size)
    config._attn_implementation = "sdpa"
    cls = LlamaForCausalLM if args.model == "llama" else Qwen2ForCausalLM
    model = cls(config).to(dtype=args.torch_dtype, device=args.device).eval()
    checksum = float(sum(p.float().sum().item() for p in model.parameters()))
    return model, checksum


def head_dim_of(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class KvShape:
    """The model's layer groups as kvpipe sees them, and the paged pools of one side."""

    def __init__(self, config, args, side):
        self.block = args.block_size
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.elem = torch.tensor([], dtype=args.torch_dtype).element_size()
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.window = getattr(config, "sliding_window", None)
        # group 0: full-attention layers; group 1 (if any): sliding-window layers.
        self.groups = [[i for i, t in enumerate(layer_types) if t == "full_attention"]]
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        if sliding:
            self.groups.append(sliding)
        self.windows = [None] + ([self.window] if sliding else [])
        self.num_blocks = -(-max(args.prompt_lens) // self.block) + 3
        self.slot_bytes = 2 * self.block * self.kv_heads * self.head_dim * self.elem
        # Side 0 (prefill) puts ordinal o in slot o + 1; side 1 (decode) in slot o + 2
        # (--decode-blocks contiguous) or num_blocks - 1 - o (reversed: no two blocks adjacent on
        # both sides, so kvpipe cannot coalesce them), so a transfer that ignored the block tables
        # would be caught.
        self.side = side
        self.reversed = side == 1 and args.decode_blocks == "reversed"
        # Per layer, vLLM's (num_blocks, 2, block_size, kv_heads, head_dim) tensor; region = layer.
        self.pools = [torch.zeros((self.num_blocks, 2, self.block, self.kv_heads, self.head_dim),
                                  dtype=args.torch_dtype, device=args.device)
                      for _ in range(config.num_hidden_layers)]

    def layout(self):
        return [
            kvpipe.LayerGroup(
                layers=len(layers), kv_heads=self.kv_heads, head_dim=self.head_dim,
                elem_bytes=self.elem, tokens_per_block=self.block,
                pools=[kvpipe.Pool(region=layer, layers=1, slot_bytes=self.slot_bytes, layer_begin=j)
                       for j, layer in enumerate(layers)],
                window=window,
            )
            for layers, window in zip(self.groups, self.windows)
        ]

    def pool_map(self):
        return {layer: pool for layer, pool in enumerate(self.pools)}

    def slot(self, ordinal):
        """The pool slot of a block ordinal (an int or a tensor of them)."""
        if self.reversed:
            return self.num_blocks - 1 - ordinal
        return ordinal + 1 + self.side

    def first_ordinal(self, group, prompt_len):
        """The group's first block the decode side needs (the stale boundary of a window)."""
        w = self.windows[group]
        if w is None or w >= prompt_len:
            return 0
        return max(0, (prompt_len + 1 - w) // self.block)

    def tables(self, prompt_len):
        total = -(-prompt_len // self.block)
        return [[self.slot(o) for o in range(total)] for _ in self.groups]

    def registration(self, prompt_len):
        total = -(-prompt_len // self.block)
        return [(self.first_ordinal(g, prompt_len),
                 [self.slot(o) for o in range(self.first_ordinal(g, prompt_len), total)])
                for g in range(len(self.groups))]

    def token_index(self, positions, kv):
        """Rows of a layer's pool viewed as (num_blocks * 2 * block, heads, dim) for ``positions``
        (K plane: kv 0, V plane: kv 1)."""
        return self.slot(positions // self.block) * (2 * self.block) + kv * self.block + positions % self.block

    def store_chunk(self, cache, start, end):
        """Copies the K/V of tokens ``[start, end)`` of every layer from the model's cache into
        the pools (``[heads, tokens, dim]`` -> ``[token][head][dim]`` rows)."""
        positions = torch.arange(start, end, device=self.pools[0].device)
        k_rows, v_rows = self.token_index(positions, 0), self.token_index(positions, 1)
        n = end - start
        for layer, pool in enumerate(self.pools):
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            assert keys.shape[-2] >= n, "a chunk must be shorter than the sliding window"
            flat = pool.view(-1, self.kv_heads, self.head_dim)
            flat.index_copy_(0, k_rows, keys[0, :, -n:, :].transpose(0, 1))
            flat.index_copy_(0, v_rows, values[0, :, -n:, :].transpose(0, 1))

    def load_cache(self, config, prompt_len):
        """A DynamicCache rebuilt from this side's pools alone: every full layer's tokens
        ``[0, prompt_len)``, every sliding layer's last ``window - 1`` tokens."""
        cache = DynamicCache(config=config)
        device = self.pools[0].device
        for g, layers in enumerate(self.groups):
            first = 0
            if self.windows[g] is not None:
                first = max(self.first_ordinal(g, prompt_len) * self.block, prompt_len - (self.windows[g] - 1))
            positions = torch.arange(first, prompt_len, device=device)
            k_rows, v_rows = self.token_index(positions, 0), self.token_index(positions, 1)
            for layer in layers:
                flat = self.pools[layer].view(-1, self.kv_heads, self.head_dim)
                k = flat.index_select(0, k_rows).transpose(0, 1).unsqueeze(0).contiguous()
                v = flat.index_select(0, v_rows).transpose(0, 1).unsqueeze(0).contiguous()
                cache.layers[layer].update(k, v)
                if hasattr(cache.layers[layer], "cumulative_length"):
                    cache.layers[layer].cumulative_length = prompt_len
        return cache


def prompt_ids(prompt_len, vocab, device):
    g = torch.Generator().manual_seed(SEED + prompt_len)
    return torch.randint(0, vocab, (1, prompt_len), generator=g).to(device)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def chunked_prefill(model, ids, chunk, on_chunk=None):
    """Runs the prompt through the model ``chunk`` tokens at a time; ``on_chunk(cache, s, e)``
    after each. Returns the cache and the first generated token."""
    cache = DynamicCache(config=model.config)
    prompt_len = ids.shape[1]
    logits = None
    for s in range(0, prompt_len, chunk):
        e = min(prompt_len, s + chunk)
        out = model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits
        if on_chunk is not None:
            on_chunk(cache, s, e)
    return cache, int(logits[0, -1].argmax())


@torch.inference_mode()
def generate(model, cache, first_token, prompt_len, steps, device):
    """Greedy decoding from ``cache`` (holding ``prompt_len`` tokens) and the first token:
    returns the tokens (first one included) and the first step's logits."""
    tokens, first_logits = [first_token], None
    for t in range(steps):
        ids = torch.tensor([[tokens[-1]]], device=device)
        pos = torch.tensor([[prompt_len + t]], device=device)
        logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits
        if first_logits is None:
            first_logits = logits[0, -1].float().clone()
        tokens.append(int(logits[0, -1].argmax()))
    return tokens, first_logits


def wait_for(node, kinds, request, timeout, alive=None):
    """The next event of one of ``kinds`` for ``request``; raises on a failure event, when
    ``alive()`` turns false (the other process ended) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"waiting for {kinds}: the prefill process ended")
        e = node.next_event(min(1.0, max(0.0, deadline - time.monotonic())))
        if e is None:
            continue
        if e.kind in kinds and (request is None or e.request == request):
            return e
        if e.kind in ("failed", "timed_out", "cancelled", "peer_rejected", "protocol_violation") and (
                request is None or e.request in (None, request)):
            raise RuntimeError(f"kvpipe: {e.message}")
    raise TimeoutError(f"no {kinds} event for request {request} within {timeout} s")


# ---------------------------------------------------------------------------------------------
# The prefill process


class Submitter:
    """Hands chunks to kvpipe from a thread of their own, each once the GPU has finished writing
    it into the pool (kvpipe synchronises no stream): the prefill loop records a CUDA event after
    a chunk's copy and goes on launching the next chunk while this thread waits for the event
    and submits, as an engine's KV-save hook would."""

    def __init__(self):
        self.queue = queue.Queue()
        self.busy_s = 0.0
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, device, fn):
        event = None
        if device.startswith("cuda"):
            event = torch.cuda.Event()
            event.record()
        self.queue.put((event, fn))

    def drain(self):
        self.queue.join()
        if self.error is not None:
            raise self.error

    def _run(self):
        while True:
            event, fn = self.queue.get()
            try:
                if event is not None:
                    event.synchronize()
                t = time.monotonic()
                fn()
                self.busy_s += time.monotonic() - t
            except Exception as e:  # raised again by drain()
                self.error = e
            finally:
                self.queue.task_done()


def prefill_main(args):
    model, checksum = build_model(args)
    kv = KvShape(model.config, args, side=0)
    sender = kvpipe.Sender.tcp(kv.layout(), kv.pool_map(), deadlines=DEADLINES,
                               data_path=args.data_path, connections=args.connections)
    peer = sender.connect(args.connect)
    wait_for(sender, ("peer_ready",), None, 60)
    submitter = Submitter()
    say({"ready": True, "checksum": checksum})
    while line := sys.stdin.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        request, prompt_len, mode = cmd["request"], cmd["prompt_len"], cmd["mode"]
        t_start = time.monotonic()
        ids = prompt_ids(prompt_len, model.config.vocab_size, args.device)
        tables = kv.tables(prompt_len)
        sender.open_request(request, [peer])
        submitter.busy_s = 0.0

        def on_chunk(cache, s, e):
            kv.store_chunk(cache, s, e)
            if mode == "pipelined":
                submitter.put(args.device, lambda: sender.submit_chunk(request, s, e, prompt_len, tables))

        _, first = chunked_prefill(model, ids, args.chunk, on_chunk)
        sync(args.device)
        t_prefill_end = time.monotonic()
        if mode == "monolithic":
            submitter.put(args.device, lambda: sender.submit_chunk(request, 0, prompt_len, prompt_len, tables))
        submitter.put(args.device, lambda: sender.submit_aux(request, [first], prompt_tokens=prompt_len))
        submitter.drain()
        t_submitted = time.monotonic()
        wait_for(sender, ("completed",), request, 300)
        t_completed = time.monotonic()
        wait_for(sender, ("quiesced",), request, 60)
        sender.retire(request)
        say({"done": request, "first_token": first, "t_start": t_start, "t_prefill_end": t_prefill_end,
             "t_submitted": t_submitted, "t_completed": t_completed, "submit_s": submitter.busy_s,
             "bytes_written": sender.counters()["bytes_written"]})
    sender.close()


def say(obj):
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------------
# The decode process (this one): drives the prefill process and checks


class PrefillProcess:
    def __init__(self, args, port):
        argv = [sys.executable, os.path.abspath(__file__), "--role", "prefill",
                "--connect", f"127.0.0.1:{port}"] + args.passthrough
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def alive(self):
        return self.proc.poll() is None

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the prefill process ended (exit code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)
            sys.stderr.write(line)  # something else the child printed

    def close(self):
        try:
            self.send({"cmd": "quit"})
        except OSError:
            pass
        self.proc.wait(timeout=60)


class Decode:
    def __init__(self, args):
        self.args = args
        self.model, self.checksum = build_model(args)
        self.kv = KvShape(self.model.config, args, side=1)
        self.receiver = kvpipe.Receiver.tcp(self.kv.layout(), self.kv.pool_map(), deadlines=DEADLINES,
                                            data_path=args.data_path)
        port = self.receiver.listen("127.0.0.1:0")
        self.prefill = PrefillProcess(args, port)
        self.peer = wait_for(self.receiver, ("peer_ready",), None, 300, self.prefill.alive).peer
        hello = self.prefill.read()
        if hello["checksum"] != self.checksum:
            raise RuntimeError("the two processes built different weights")
        self.next_request = 1

    def local(self, prompt_len):
        """The reference: this process computes the chunked prefill itself and generates."""
        a = self.args
        sync(a.device)
        t0 = time.monotonic()
        ids = prompt_ids(prompt_len, self.model.config.vocab_size, a.device)
        cache, first = chunked_prefill(self.model, ids, a.chunk)
        sync(a.device)
        ttft = time.monotonic() - t0
        tokens, logits = generate(self.model, cache, first, prompt_len, a.new_tokens, a.device)
        return {"ttft_s": ttft, "tokens": tokens, "logits": logits}

    def remote(self, prompt_len, mode, corrupt=False):
        """One request prefilled by the other process and carried by kvpipe (``mode``
        pipelined or monolithic); generation from this process's pool only."""
        a = self.args
        request = self.next_request
        self.next_request += 1
        # Stale data from an earlier request must not pass for a transfer.
        for pool in self.kv.pools:
            pool.fill_(float("nan")) if pool.is_floating_point() else pool.zero_()
        sync(a.device)
        self.receiver.register(request, prompt_len, self.kv.registration(prompt_len), [self.peer])
        t0 = time.monotonic()
        self.prefill.send({"cmd": "run", "request": request, "prompt_len": prompt_len, "mode": mode})
        done = wait_for(self.receiver, ("completed",), request, 300, self.prefill.alive)
        t_completed = time.monotonic()
        first = done.first_tokens[0]
        cache = self.kv.load_cache(self.model.config, prompt_len)
        sync(a.device)
        ttft = time.monotonic() - t0
        t_gathered = time.monotonic()
        tokens, logits = generate(self.model, cache, first, prompt_len, a.new_tokens, a.device)
        sent = self.prefill.read()
        wait_for(self.receiver, ("quiesced",), request, 60)
        self.receiver.retire(request)
        result = {
            "ttft_s": ttft, "tokens": tokens, "logits": logits,
            "prefill_s": sent["t_prefill_end"] - sent["t_start"],
            "transfer_tail_s": t_completed - sent["t_prefill_end"],
            "gather_s": t_gathered - t_completed,
            "bytes": done.bytes_written,
            "first_token_matches_prefill": first == sent["first_token"],
        }
        if corrupt:
            result["corruption"] = self.corrupted_run(prompt_len, first, tokens, logits)
        return result

    @torch.inference_mode()
    def most_attended(self, layer, prompt_len, first):
        """The prompt token that head 0 of ``layer`` attends to most in the first decode step
        from this side's pool (eager attention for this one step, to read the weights)."""
        cache = self.kv.load_cache(self.model.config, prompt_len)
        self.model.set_attn_implementation("eager")
        try:
            out = self.model(input_ids=torch.tensor([[first]], device=self.args.device),
                             position_ids=torch.tensor([[prompt_len]], device=self.args.device),
                             past_key_values=cache, use_cache=True, output_attentions=True)
        finally:
            self.model.set_attn_implementation("sdpa")
        weights = out.attentions[layer][0, 0, -1].float()  # over the cache's keys, then itself
        return int(weights[:-1].argmax()), float(weights[:-1].max())

    def corrupted_run(self, prompt_len, first, tokens, logits):
        """Changes one byte of the decode pool and generates again from the pool: the logits must
        change. The byte is the high byte of the first V element (head 0, dim 0) of the prompt
        token that head 0 of the first full-attention layer attends to most in the first step,
        set to 0x46: the element becomes about 1e4 (bf16 and fp32 alike), finite, and carried
        into that step's attention output with the token's weight. (A token the step does not
        attend to would change nothing: with these random weights attention is nearly one-hot.)"""
        layer = self.kv.groups[0][0]
        token, weight = self.most_attended(layer, prompt_len, first)
        pool = self.kv.pools[layer]
        raw = pool.view(torch.uint8).view(-1)
        row = int(self.kv.token_index(torch.tensor([token]), 1)[0])
        offset = row * self.kv.kv_heads * self.kv.head_dim * self.kv.elem + self.kv.elem - 1
        original = raw[offset].clone()
        raw[offset] = 0x46 if int(original) != 0x46 else 0xC6
        changed = {"layer": layer, "token": token, "attention_weight": round(weight, 4), "byte": offset,
                   "old": int(original), "new": int(raw[offset])}
        cache = self.kv.load_cache(self.model.config, prompt_len)
        bad_tokens, bad_logits = generate(self.model, cache, first, prompt_len, self.args.new_tokens,
                                          self.args.device)
        raw[offset] = original
        diff = (bad_logits - logits).abs()
        return {
            "changed": changed,
            "tokens_differ": bad_tokens != tokens,
            "logits_differ": bool(torch.isnan(diff).any() or diff.max() > 0),
            "logits_max_abs_diff": float(diff.max()) if bool(torch.isfinite(diff).all()) else None,
        }

    def close(self):
        self.prefill.close()
        self.receiver.close()


def median(xs):
    return statistics.median(xs)


def decode_main(args):
    started = time.time()
    d = Decode(args)
    results, verified, corruption = [], True, []
    try:
        # Warm-up (kernels, allocator, peer mappings): one of each, not measured.
        warm = min(args.prompt_lens)
        d.local(warm)
        d.remote(warm, "pipelined")
        d.remote(warm, "monolithic")
        for prompt_len in args.prompt_lens:
            runs = {"local": [], "pipelined": [], "monolithic": []}
            for rep in range(args.reps):
                runs["local"].append(d.local(prompt_len))
                runs["pipelined"].append(d.remote(prompt_len, "pipelined", corrupt=(rep == 0)))
                runs["monolithic"].append(d.remote(prompt_len, "monolithic"))
            reference = runs["local"][0]["tokens"]
            ok = all(r["tokens"] == reference for mode in runs for r in runs[mode])
            ok = ok and all(r["first_token_matches_prefill"] for m in ("pipelined", "monolithic")
                            for r in runs[m])
            verified = verified and ok
            c = runs["pipelined"][0]["corruption"]
            corruption.append(c["tokens_differ"] or c["logits_differ"])
            ttft = {m: median([r["ttft_s"] for r in runs[m]]) * 1e3 for m in runs}
            entry = {
                "prompt_len": prompt_len,
                "verified": ok,
                "tokens_compared": len(reference),
                "distinct_tokens": len(set(reference)),
                "tokens": reference,
                "ttft_ms": {m: round(v, 2) for m, v in ttft.items()},
                "ttft_ms_all": {m: [round(r["ttft_s"] * 1e3, 2) for r in runs[m]] for m in runs},
                "ratios": {
                    "pipelined_over_local": round(ttft["pipelined"] / ttft["local"], 3),
                    "monolithic_over_local": round(ttft["monolithic"] / ttft["local"], 3),
                    "monolithic_over_pipelined": round(ttft["monolithic"] / ttft["pipelined"], 3),
                },
                "prefill_ms": {m: round(median([r["prefill_s"] for r in runs[m]]) * 1e3, 2)
                               for m in ("pipelined", "monolithic")},
                "transfer_tail_ms": {m: round(median([r["transfer_tail_s"] for r in runs[m]]) * 1e3, 2)
                                     for m in ("pipelined", "monolithic")},
                "gather_ms": round(median([r["gather_s"] for r in runs["pipelined"]]) * 1e3, 2),
                "kv_bytes": runs["pipelined"][0]["bytes"],
                "corruption": c,
            }
            results.append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "tokens"}), file=sys.stderr, flush=True)
    finally:
        d.close()
    summary = {
        "verified": verified,
        "corruption_detected": all(corruption),
        "model": args.model, "size": args.size, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": str(args.torch_dtype).removeprefix("torch."),
        "layers": d.model.config.num_hidden_layers, "kv_heads": d.kv.kv_heads, "head_dim": d.kv.head_dim,
        "layer_groups": [{"layers": g, "window": w} for g, w in zip(d.kv.groups, d.kv.windows)],
        "block_size": args.block_size, "chunk": args.chunk, "new_tokens": args.new_tokens,
        "reps": args.reps, "data_path": args.data_path, "decode_blocks": args.decode_blocks,
        "pool_layout": "per layer (num_blocks, 2, block_size, kv_heads, head_dim), one kvpipe pool each",
        "torch": torch.__version__, "kvpipe": kvpipe.__version__,
        "wall_s": round(time.time() - started, 1),
        "results": results,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if verified and all(corruption) else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["llama", "sliding"], default="llama")
    p.add_argument("--size", choices=["small", "tiny"], default=None,
                   help="small: 8 layers, hidden 2048, 8 KV heads of 128 (default on CUDA); "
                        "tiny: 4 layers, hidden 256 (default on CPU)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prompt-lens", default=None, help="comma separated (default 1024,8192 on CUDA, "
                                                       "1024 on CPU); 32768 for the long run")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--data-path", choices=["socket", "auto", "peer_copy"], default=None,
                   help="kvpipe's TCP data path (default: peer_copy on CUDA, socket on CPU)")
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--decode-blocks", choices=["contiguous", "reversed"], default="contiguous",
                   help="the decode side's block table: ordinal o in slot o + 2 (runs of blocks "
                        "coalesce into one write per layer) or in slot num_blocks - 1 - o (one "
                        "write per block and layer)")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    p.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    p.add_argument("--connect", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.size = args.size or ("small" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.torch_dtype = getattr(torch, args.dtype)
    args.prompt_lens = [int(x) for x in (args.prompt_lens or ("1024,8192" if cuda else "1024")).split(",")]
    args.data_path = args.data_path or ("peer_copy" if cuda else "socket")
    window = model_config(args.model, args.size).sliding_window if args.model == "sliding" else None
    if window is not None and args.chunk >= window:
        p.error(f"--chunk must be shorter than the sliding window ({window})")
    # What the prefill child needs to build the same model and pools.
    args.passthrough = ["--device", args.device, "--model", args.model, "--size", args.size,
                        "--dtype", args.dtype, "--prompt-lens", ",".join(map(str, args.prompt_lens)),
                        "--chunk", str(args.chunk), "--block-size", str(args.block_size),
                        "--data-path", args.data_path, "--connections", str(args.connections),
                        "--decode-blocks", args.decode_blocks]
    if args.role == "prefill":
        prefill_main(args)
        return 0
    return decode_main(args)


if __name__ == "__main__":
    sys.exit(main())
