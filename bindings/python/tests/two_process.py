"""The two sides of a two-process transfer over TCP with numpy pools, as `kvpipe serve` and
`kvpipe demo --transport tcp --connect` run it from Rust: the same model geometry, prompt,
chunks and requests, the same pool layout (one pool per layer group, each request's blocks in
consecutive slots) and the same timing (the decode side times from the prefill node's handshake
to the last completion).

    python two_process.py decode --listen 127.0.0.1:0 [workload flags]   # prints "port N" first
    python two_process.py prefill --connect 127.0.0.1:N [workload flags]

The prefill side computes each chunk's KV (a deterministic pattern per request, block and word)
into its pool, then submits the chunk; the decode side checks every byte of every pool when the
requests have quiesced (each registered block equals the pattern, every other slot still holds
its filler) and exits non-zero on any difference. Both print one JSON line at the end.
"""

import argparse
import json
import sys
import time

import numpy as np

import kvpipe

MODELS = {
    # name: (layers, kv_heads, head_dim, elem_bytes), one full-attention group (kv_factor 2)
    "llama3-8b": (32, 8, 128, 2),
    "tiny": (4, 2, 16, 2),
}

# One block of KV is a random base block (the same in both processes) whose first word of every
# 4 KiB page is stamped with the request, the block ordinal and the page: a block landing in the
# wrong slot, a page landing in the wrong place and any corrupted byte all show. Computing it is
# a copy plus a strided store, so the prefill side's "compute" costs about what writing the KV
# costs, as in the Rust demo.
PAGE_WORDS = 512
# `--content hash` instead: every 8 bytes a multiply-xorshift of (word index ^ block key), which
# costs about what the Rust demo's content function costs (several passes over the block).
MIX = np.uint64(0x9E3779B97F4A7C15)
SHIFT = np.uint64(29)


def workload_args(p):
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--prefill-ms-per-chunk", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the whole run may take")
    p.add_argument("--content", choices=["stamp", "hash"], default="stamp",
                   help="how a block's KV is computed (stamp: a copy plus a stamp per page)")


class Workload:
    def __init__(self, args, region):
        layers, heads, dim, elem = MODELS[args.model]
        self.args = args
        self.tpb = args.tokens_per_block
        self.blocks = -(-args.prompt_tokens // self.tpb)
        self.slots = self.blocks * args.requests + 1
        self.slot_bytes = 2 * heads * self.tpb * dim * elem * layers
        self.region = region
        self.layout = [
            kvpipe.LayerGroup(
                layers=layers,
                kv_heads=heads,
                head_dim=dim,
                elem_bytes=elem,
                tokens_per_block=self.tpb,
                pools=[kvpipe.Pool(region=region, layers=layers, slot_bytes=self.slot_bytes)],
            )
        ]
        # Every page is written (with a filler byte) before the node exists, as the Rust demo's
        # reference cache does with its full-attention pools: page faults stay out of the timing.
        # Plain pages like Rust's heap, not the transparent huge pages numpy asks for by default.
        np._core.multiarray._set_madvise_hugepage(False)
        self.filler = region % 251 + 1
        self.pool = np.full((self.slots, self.slot_bytes), self.filler, dtype=np.uint8)
        self.words = self.pool.view(np.uint64)
        rng = np.random.default_rng(0x6B7670697065)
        self.base = rng.integers(0, 2**63, self.slot_bytes // 8, dtype=np.uint64)
        self.pages = np.arange(-(-self.slot_bytes // 8 // PAGE_WORDS), dtype=np.uint64)
        self.hash = getattr(args, "content", "stamp") == "hash"
        self.word_index = np.arange(self.slot_bytes // 8, dtype=np.uint64)

    def slot(self, request, ordinal):
        """Request i (1-based) holds its blocks in consecutive slots, as the reference cache's
        allocation does."""
        return (request - 1) * self.blocks + ordinal

    def fill(self, out, request, ordinal):
        """The KV of one block (``out``: the slot as 64-bit words)."""
        if self.hash:
            key = np.uint64(((request * 0x1000193) << 24 ^ ordinal * 0x5BD1E995) & (2**64 - 1))
            np.bitwise_xor(self.word_index, key, out=out)
            np.multiply(out, MIX, out=out)
            np.bitwise_xor(out, out >> SHIFT, out=out)
            return
        np.copyto(out, self.base)
        stamp = np.uint64((request << 48) | (ordinal << 24))
        np.add(self.pages, stamp, out=out[::PAGE_WORDS])

    def expected(self, request, ordinal):
        out = np.empty_like(self.base)
        self.fill(out, request, ordinal)
        return out


def wait_for(node, kinds, deadline, what):
    while time.monotonic() < deadline:
        event = node.next_event(0.2)
        if event is not None and event.kind in kinds:
            return event
        if event is not None and event.kind in ("peer_rejected", "failed", "timed_out"):
            raise SystemExit(f"{what}: {event.message}")
    raise SystemExit(f"{what}: nothing in time")


def decode(args):
    w = Workload(args, region=1000)
    deadline = time.monotonic() + args.timeout
    rx = kvpipe.Receiver.tcp(w.layout, {w.region: w.pool}, deadlines=two_process_deadlines())
    port = rx.listen(args.listen)
    print(f"port {port}", flush=True)
    ready = wait_for(rx, ("peer_ready",), deadline, "decode side: waiting for the prefill node")
    start = time.monotonic()
    requests = list(range(1, args.requests + 1))
    for r in requests:
        ids = [w.slot(r, o) for o in range(w.blocks)]
        rx.register(r, args.prompt_tokens, [(0, ids)], [ready.peer])
    completed, failed, quiesced, total = [], [], 0, 0
    last = start
    while quiesced < len(requests):
        if time.monotonic() > deadline:
            raise SystemExit("decode side: the transfer did not finish in time")
        e = rx.next_event(0.2)
        if e is None:
            continue
        if e.kind == "completed":
            total += e.bytes_written
            last = time.monotonic()
            completed.append(e.request)
            if e.first_tokens != [e.request]:
                failed.append(e.request)
        elif e.kind in ("failed", "timed_out", "cancelled"):
            print(f"decode side: {e.message}", file=sys.stderr)
            failed.append(e.request)
        elif e.kind == "quiesced":
            quiesced += 1
            rx.retire(e.request)
    seconds = last - start
    refused = rx.counters()["writes_refused"]
    rx.close(10.0)
    # Every byte: registered blocks hold the prefill side's content, all else its filler.
    mismatched = 0
    owner = {}
    for r in requests:
        for o in range(w.blocks):
            owner[w.slot(r, o)] = (r, o)
    for slot in range(w.slots):
        if slot in owner:
            ok = np.array_equal(w.words[slot], w.expected(*owner[slot]))
        else:
            ok = bool((w.pool[slot] == w.filler).all())
        mismatched += not ok
    verified = mismatched == 0 and not failed and len(completed) == len(requests)
    report = {
        "role": "decode",
        "transport": "tcp",
        "binding": "python",
        "model": args.model,
        "requests": len(requests),
        "completed": len(completed),
        "bytes": total,
        "seconds": seconds,
        "gbps": total / seconds / 1e9 if seconds > 0 else 0.0,
        "mismatched_slots": mismatched,
        "writes_refused": refused,
        "verified": verified,
        "checked_bytes": int(w.pool.nbytes),
    }
    print(json.dumps(report), flush=True)
    return 0 if verified else 1


def two_process_deadlines():
    """Long waits for the other side's engine, as the Rust two-process commands use."""
    return {
        "registration": 600.0,
        "result_wait": 600.0,
        "result_per_token": 0.0,
        "result_idle": 600.0,
        "write_completion": 60.0,
    }


def prefill(args):
    w = Workload(args, region=1)
    deadline = time.monotonic() + args.timeout
    tx = kvpipe.Sender.tcp(
        w.layout, {w.region: w.pool}, connections=args.connections, deadlines=two_process_deadlines()
    )
    peer = tx.connect(args.connect)
    wait_for(tx, ("peer_ready",), deadline, "prefill side: handshake")
    requests = list(range(1, args.requests + 1))
    tables = {r: [[w.slot(r, o) for o in range(w.blocks)]] for r in requests}
    for r in requests:
        tx.open_request(r, [peer])
    start = time.monotonic()
    events = []
    next_start = {r: 0 for r in requests}
    chunks = 0
    compute = 0.0
    while next_start:
        for r in list(next_start):
            begin = next_start[r]
            end = min(begin + args.chunk_tokens, args.prompt_tokens)
            # "Prefill": compute this chunk's KV into the pool, block by block.
            t = time.monotonic()
            for o in range(begin // w.tpb, -(-end // w.tpb)):
                w.fill(w.words[w.slot(r, o)], r, o)
            compute += time.monotonic() - t
            if args.prefill_ms_per_chunk:
                time.sleep(args.prefill_ms_per_chunk / 1000)
            tx.submit_chunk(r, begin, end, args.prompt_tokens, tables[r])
            chunks += 1
            if end >= args.prompt_tokens:
                del next_start[r]
                tx.submit_aux(r, [r], prompt_tokens=args.prompt_tokens)
            else:
                next_start[r] = end
            while (e := tx.next_event(0.0)) is not None:
                events.append(e)
    while sum(e.kind == "quiesced" for e in events) < len(requests):
        if time.monotonic() > deadline:
            raise SystemExit("prefill side: the transfer did not finish in time")
        e = tx.next_event(0.2)
        if e is not None:
            events.append(e)
    seconds = time.monotonic() - start
    completed = [e for e in events if e.kind == "completed"]
    for e in events:
        if e.kind in ("failed", "timed_out", "cancelled"):
            print(f"prefill side: {e.message}", file=sys.stderr)
    for r in requests:
        tx.retire(r)
    tx.close(10.0)
    report = {
        "role": "prefill",
        "transport": "tcp",
        "binding": "python",
        "requests": len(requests),
        "completed": len(completed),
        "chunks": chunks,
        "bytes": sum(e.bytes_written for e in completed),
        "seconds": seconds,
        "compute_seconds": compute,
    }
    print(json.dumps(report), flush=True)
    return 0 if len(completed) == len(requests) else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--listen", default="127.0.0.1:0")
    workload_args(d)
    f = sub.add_parser("prefill")
    f.add_argument("--connect", required=True)
    workload_args(f)
    args = p.parse_args(argv)
    return decode(args) if args.role == "decode" else prefill(args)


if __name__ == "__main__":
    sys.exit(main())
