"""How a serving engine embeds kvpipe: a connector on each side, called from the hook points
engines already have (a request is scheduled, a prefill chunk was computed, a request finished),
with a toy paged KV cache and scheduler standing in for the engine. No engine is needed.

    python engine_connector.py                      # both sides in this process, over loopback TCP
    python engine_connector.py --role decode --listen 127.0.0.1:7070       # or one per process
    python engine_connector.py --role prefill --connect 127.0.0.1:7070

The decode side registers each request's destination blocks as soon as the request is routed to
it (before its prefill starts); the prefill side streams every chunk's blocks the moment the
chunk is computed, so only the last chunk's transfer is left when prefill ends. Blocks are freed
only after kvpipe's "quiesced" event, never earlier (not even after a failure).
"""

import argparse
import threading
import time

import numpy as np

import kvpipe

# The model's KV shape (one full-attention layer group, bf16) and the engine's settings.
LAYERS, KV_HEADS, HEAD_DIM, ELEM_BYTES, TOKENS_PER_BLOCK = 8, 4, 64, 2, 16
NUM_SLOTS = 512
PROMPTS = {101: 700, 102: 1500, 103: 64}  # request id -> prompt length (tokens)
CHUNK_TOKENS = 256


class PagedKvCache:
    """The engine's paged KV cache: one pool (a numpy array, as a torch CPU tensor's .numpy()
    would be) of fixed-size block slots, a free list, and a block table per request."""

    def __init__(self, region):
        self.region = region
        self.group = kvpipe.LayerGroup(
            layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, elem_bytes=ELEM_BYTES,
            tokens_per_block=TOKENS_PER_BLOCK,
            pools=[kvpipe.Pool(region=region, layers=LAYERS, slot_bytes=self.slot_bytes())],
        )
        self.pool = np.zeros((NUM_SLOTS, self.slot_bytes()), dtype=np.uint8)
        self.free = list(range(NUM_SLOTS - 1, -1, -1))
        self.tables = {}

    @staticmethod
    def slot_bytes():
        return 2 * KV_HEADS * TOKENS_PER_BLOCK * HEAD_DIM * ELEM_BYTES * LAYERS

    def allocate(self, request, prompt_len):
        blocks = -(-prompt_len // TOKENS_PER_BLOCK)
        self.tables[request] = [self.free.pop() for _ in range(blocks)]
        return self.tables[request]

    def release(self, request):
        self.free.extend(self.tables.pop(request))

    def layout(self):
        return [self.group]

    def pools(self):
        return {self.region: self.pool}


def fake_kv(request, ordinal, nbytes):
    """What the model would compute for one block (deterministic, so the decode side can check)."""
    return np.random.default_rng(request * 100_003 + ordinal).integers(0, 256, nbytes, dtype=np.uint8)


class PrefillConnector:
    """The prefill engine's side: a kvpipe Sender fed from the scheduler's hooks."""

    def __init__(self, cache, decode_addr):
        self.cache = cache
        self.sender = kvpipe.Sender.tcp(cache.layout(), cache.pools())
        self.peer = self.sender.connect(decode_addr)
        self._wait_ready()
        self.done = set()

    def _wait_ready(self):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            e = self.sender.next_event(0.1)
            if e is not None and e.kind == "peer_ready":
                return
            if e is not None and e.kind == "peer_rejected":
                raise RuntimeError(f"the decode side refused us: {e.message}")
        raise TimeoutError("no handshake with the decode side")

    # --- hook points ---
    def on_request_scheduled(self, request):
        self.sender.open_request(request, [self.peer])

    def on_chunk_computed(self, request, start, end, prompt_len):
        # kvpipe asks the block table for exactly this chunk's blocks and sends them now.
        self.sender.submit_chunk(request, start, end, prompt_len, [self.cache.tables[request]])

    def on_request_finished(self, request, first_token, prompt_len):
        self.sender.submit_aux(request, [first_token], prompt_tokens=prompt_len)

    def poll(self):
        """Called once per scheduler iteration: frees the blocks of every request kvpipe no
        longer reads."""
        while (e := self.sender.next_event(0.0)) is not None:
            if e.kind in ("failed", "timed_out", "cancelled"):
                print(f"prefill: request {e.request} did not transfer: {e.message}")
            elif e.kind == "quiesced":
                self.cache.release(e.request)
                self.sender.retire(e.request)
                self.done.add(e.request)


def prefill_engine(decode_addr):
    cache = PagedKvCache(region=1)
    conn = PrefillConnector(cache, decode_addr)
    progress = {}
    for request, prompt_len in PROMPTS.items():  # the scheduler admits the requests
        cache.allocate(request, prompt_len)
        conn.on_request_scheduled(request)
        progress[request] = 0
    while progress:  # chunked prefill, one chunk per running request per iteration
        for request in list(progress):
            prompt_len, start = PROMPTS[request], progress[request]
            end = min(start + CHUNK_TOKENS, prompt_len)
            table = cache.tables[request]
            for ordinal in range(start // TOKENS_PER_BLOCK, -(-end // TOKENS_PER_BLOCK)):
                cache.pool[table[ordinal]] = fake_kv(request, ordinal, cache.slot_bytes())
            conn.on_chunk_computed(request, start, end, prompt_len)
            if end == prompt_len:
                conn.on_request_finished(request, first_token=request % 1000, prompt_len=prompt_len)
                del progress[request]
            else:
                progress[request] = end
        conn.poll()
    deadline = time.monotonic() + 30
    while len(conn.done) < len(PROMPTS) and time.monotonic() < deadline:
        conn.poll()
        time.sleep(0.005)
    conn.sender.close()
    print(f"prefill: {len(conn.done)} of {len(PROMPTS)} requests sent; blocks freed: "
          f"{len(cache.free)} of {NUM_SLOTS} slots free")
    return len(conn.done) == len(PROMPTS)


class DecodeConnector:
    """The decode engine's side: a kvpipe Receiver; requests are registered when routed here,
    before their prefill starts (generation-first)."""

    def __init__(self, cache, listen_addr):
        self.cache = cache
        self.receiver = kvpipe.Receiver.tcp(cache.layout(), cache.pools())
        self.port = self.receiver.listen(listen_addr)
        self.prefill_peer = None
        self.ready = {}  # request -> first token, once its KV is complete

    def wait_for_prefill(self, timeout=30):
        deadline = time.monotonic() + timeout
        while self.prefill_peer is None and time.monotonic() < deadline:
            e = self.receiver.next_event(0.1)
            if e is not None and e.kind == "peer_ready":
                self.prefill_peer = e.peer

    # --- hook points ---
    def on_request_routed(self, request, prompt_len):
        table = self.cache.allocate(request, prompt_len)
        self.receiver.register(request, prompt_len, [(0, table)], [self.prefill_peer])

    def poll(self):
        while (e := self.receiver.next_event(0.0)) is not None:
            if e.kind == "completed":
                self.ready[e.request] = e.first_tokens[0]  # its KV is complete: decode can start
            elif e.kind in ("failed", "timed_out", "cancelled"):
                print(f"decode: request {e.request} failed: {e.message}")
            elif e.kind == "quiesced":
                self.receiver.retire(e.request)


def decode_engine(listen_addr, port_box=None):
    cache = PagedKvCache(region=7)
    conn = DecodeConnector(cache, listen_addr)
    print(f"decode: listening on port {conn.port}")
    if port_box is not None:
        port_box.append(conn.port)
    conn.wait_for_prefill()
    for request, prompt_len in PROMPTS.items():
        conn.on_request_routed(request, prompt_len)
    deadline = time.monotonic() + 30
    while len(conn.ready) < len(PROMPTS) and time.monotonic() < deadline:
        conn.poll()
        time.sleep(0.002)
    conn.poll()
    conn.receiver.close()
    ok = len(conn.ready) == len(PROMPTS)
    for request, table in cache.tables.items():
        for ordinal, slot in enumerate(table):
            ok &= np.array_equal(cache.pool[slot], fake_kv(request, ordinal, cache.slot_bytes()))
    print(f"decode: {len(conn.ready)} of {len(PROMPTS)} requests received, first tokens "
          f"{conn.ready}; KV {'verified' if ok else 'WRONG'}")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--connect")
    args = p.parse_args()
    if args.role == "decode":
        return 0 if decode_engine(args.listen) else 1
    if args.role == "prefill":
        return 0 if prefill_engine(args.connect) else 1
    port, result = [], {}
    decode = threading.Thread(target=lambda: result.setdefault("decode", decode_engine(args.listen, port)))
    decode.start()
    while not port:
        time.sleep(0.01)
    ok = prefill_engine(f"127.0.0.1:{port[0]}")
    decode.join()
    return 0 if ok and result.get("decode") else 1


if __name__ == "__main__":
    raise SystemExit(main())
