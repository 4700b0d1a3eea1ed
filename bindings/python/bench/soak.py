"""Soak through the Python package: waves of one-block requests (sequential ids, or random
63-bit ones with ``--random-ids``), each completed, quiesced and retired on both sides,
printing the resident set size (MiB) every ``--every`` requests. Exits non-zero when a side's
size grew more than ``--max-growth`` percent between the end of the warm-up (``--warmup``, a
fraction of the run) and the end.

    python soak.py mem [--requests N] [--wave 8]     # the in-process pair
    python soak.py tcp [--requests N] [--wave 32]    # a decode child process over TCP
    python soak.py mem --random-ids                  # ids as engines hash them

Build the package in release first (``maturin develop --release`` in bindings/python): a debug
build is slow enough that the deadlines, not the request count, decide what is held.
"""

import argparse
import subprocess
import sys
import time

import numpy as np

import kvpipe

TPB = 4
SLOT = 64


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def layout(region):
    return [kvpipe.LayerGroup(layers=1, kv_heads=1, head_dim=4, elem_bytes=2, tokens_per_block=TPB,
                              pools=[kvpipe.Pool(region=region, layers=1, slot_bytes=SLOT)])]


def wait_quiesced(node, ids, side, retire=True):
    left = set(ids)
    deadline = time.monotonic() + 30
    while left:
        if time.monotonic() > deadline:
            raise SystemExit(f"{side}: requests {sorted(left)[:4]} did not quiesce in 30 s")
        e = node.next_event(1.0)
        if e is None:
            continue
        if e.kind in ("failed", "timed_out", "cancelled", "peer_rejected", "protocol_violation"):
            raise SystemExit(f"{side}: {e.message}")
        if e.kind == "quiesced":
            left.discard(e.request)
            if retire:
                node.retire(e.request)


def wait_ready(node, side):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        e = node.next_event(1.0)
        if e is not None and e.kind == "peer_ready":
            return e.peer
    raise SystemExit(f"{side}: no handshake in 30 s")


class Meter:
    def __init__(self, args, side):
        self.args, self.side = args, side
        self.warm_at = int(args.requests * args.warmup)
        self.warm = None
        self.next = args.every
        self.start = time.monotonic()

    def served(self, n):
        if self.warm is None and n >= self.warm_at:
            self.warm = rss_mib()
        if n >= self.next or n == self.args.requests:
            self.next += self.args.every
            print(f"{self.side},{n},{time.monotonic() - self.start:.1f},{rss_mib():.1f}", flush=True)

    def verdict(self):
        end = rss_mib()
        growth = (end - self.warm) / self.warm * 100
        print(f"{self.side}: rss after warm-up {self.warm:.1f} MiB, at the end {end:.1f} MiB: "
              f"{growth:+.1f} %", flush=True)
        return 0 if growth <= self.args.max_growth else 1


# Request k's id: k itself, or with --random-ids a 63-bit hash of k (as engines hash their
# string ids: any value, in any order), the same function on both sides.
REQUEST_ID = int


def hashed_id(k):
    z = (k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finaliser
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def prefill_wave(tx, peer, first, n):
    ids = [REQUEST_ID(k) for k in range(first, first + n)]
    for i, r in enumerate(ids):
        tx.open_request(r, [peer])
        tx.submit_chunk(r, 0, TPB, TPB, [[i]])
        tx.submit_aux(r, [1], prompt_tokens=TPB)
    return ids


def decode_wave(rx, peer, first, n):
    ids = [REQUEST_ID(k) for k in range(first, first + n)]
    for i, r in enumerate(ids):
        rx.register(r, TPB, [(0, [i])], [peer], aux_capacity=64)
    return ids


def run_mem(args):
    src = np.full(SLOT * args.wave, 7, dtype=np.uint8)
    dst = np.zeros(SLOT * args.wave, dtype=np.uint8)
    tx, rx = kvpipe.mem_pair(layout(1), {1: src}, layout(2), {2: dst})
    wait_ready(rx, "decode")
    wait_ready(tx, "prefill")
    meter = Meter(args, "mem")
    served = 0
    while served < args.requests:
        n = min(args.wave, args.requests - served)
        decode_wave(rx, kvpipe.MEM_SENDER_PEER, served + 1, n)
        ids = prefill_wave(tx, kvpipe.MEM_RECEIVER_PEER, served + 1, n)
        wait_quiesced(tx, ids, "prefill")
        wait_quiesced(rx, ids, "decode")
        served += n
        meter.served(served)
    return meter.verdict()


def run_tcp_decode(args):
    dst = np.zeros(SLOT * args.wave, dtype=np.uint8)
    rx = kvpipe.Receiver.tcp(layout(2), {2: dst})
    print(f"port {rx.listen('127.0.0.1:0')}", flush=True)
    peer = wait_ready(rx, "decode")
    meter = Meter(args, "decode")
    served = 0
    while served < args.requests:
        n = min(args.wave, args.requests - served)
        ids = decode_wave(rx, peer, served + 1, n)
        wait_quiesced(rx, ids, "decode")
        served += n
        meter.served(served)
    code = meter.verdict()
    rx.close(10.0)
    return code


def run_tcp(args):
    child = subprocess.Popen(
        [sys.executable, __file__, "tcp-decode", *sys.argv[2:]], stdout=subprocess.PIPE, text=True
    )
    try:
        first = child.stdout.readline().split()
        src = np.full(SLOT * args.wave, 7, dtype=np.uint8)
        tx = kvpipe.Sender.tcp(layout(1), {1: src})
        peer = tx.connect(f"127.0.0.1:{first[1]}")
        wait_ready(tx, "prefill")
        meter = Meter(args, "prefill")
        served = 0
        while served < args.requests:
            n = min(args.wave, args.requests - served)
            ids = prefill_wave(tx, peer, served + 1, n)
            wait_quiesced(tx, ids, "prefill")
            served += n
            meter.served(served)
        code = meter.verdict()
        rest, _ = child.communicate(timeout=120)
        print(rest, end="", flush=True)
        tx.close(10.0)
        return code or child.returncode
    finally:
        child.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["mem", "tcp", "tcp-decode"])
    p.add_argument("--requests", type=int, default=400_000)
    p.add_argument("--wave", type=int, default=8)
    p.add_argument("--every", type=int, default=50_000)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--max-growth", type=float, default=5.0)
    p.add_argument("--random-ids", action="store_true",
                   help="random 63-bit request ids in any order instead of 1, 2, 3, ...")
    args = p.parse_args()
    if args.random_ids:
        global REQUEST_ID
        REQUEST_ID = hashed_id
    run = {"mem": run_mem, "tcp": run_tcp, "tcp-decode": run_tcp_decode}[args.mode]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
