"""Python's two-process TCP transfer against the Rust CLI's, for the same workload.

Each run moves the same requests twice over loopback TCP, each time between two processes:
`kvpipe serve` + `kvpipe demo --transport tcp --connect` (Rust), and
`two_process.py decode` + `two_process.py prefill` (this package, numpy pools). Both decode
sides time from the prefill node's handshake to the last completion and verify every byte
afterwards; their bytes per second are compared. The order alternates from run to run; `ratio`
is the median of the runs' own ratios (Python / Rust), robust to the machine's load changing
between runs. Target: ratio >= 0.9.

Both prefill sides write every byte of each chunk's KV into their pool before submitting it,
inside the timed window: the Rust demo its hashed content (a mixing function per 8 bytes), the
Python side by default a copy of a random block stamped on every page (`python_compute_s`
reports its total), which costs less CPU on a machine whose cores the transport shares;
`--content hash` makes the Python side hash every 8 bytes with numpy instead, at least as costly
as the Rust demo's content.

    python bench_tcp.py --kvpipe target/release/kvpipe [--runs 5] [workload flags]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

TWO_PROCESS = Path(__file__).parents[1] / "tests" / "two_process.py"


def run_pair(decode_cmd, prefill_cmd, port_pattern, timeout):
    """Starts the decode side, reads its port, runs the prefill side, returns the decode JSON."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    decode = subprocess.Popen(
        decode_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stream = decode.stdout if port_pattern == "port" else decode.stderr
        port = None
        for line in stream:
            m = re.search(r"port (\d+)" if port_pattern == "port" else r":(\d+)\s*$", line)
            if m:
                port = m.group(1)
                break
        if port is None:
            raise RuntimeError(f"{decode_cmd[0]}: no port: {decode.stderr.read()}")
        prefill = subprocess.run(
            [*prefill_cmd, "--connect", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if prefill.returncode != 0:
            raise RuntimeError(f"prefill side failed: {prefill.stdout}{prefill.stderr}")
        out, err = decode.communicate(timeout=timeout)
        if decode.returncode != 0:
            raise RuntimeError(f"decode side failed: {out}{err}")
        decoded = json.loads(out.strip().splitlines()[-1])
        prefilled = json.loads(prefill.stdout.strip().splitlines()[-1])
        return decoded, prefilled
    finally:
        decode.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvpipe", required=True, help="the release `kvpipe` binary")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--prefill-ms-per-chunk", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--content", choices=["stamp", "hash"], default="stamp",
                   help="the Python prefill side's KV computation (see two_process.py)")
    args = p.parse_args()

    workload = [
        "--model", args.model,
        "--prompt-tokens", str(args.prompt_tokens),
        "--requests", str(args.requests),
    ]
    prefill_flags = [
        "--chunk-tokens", str(args.chunk_tokens),
        "--connections", str(args.connections),
        "--prefill-ms-per-chunk", str(args.prefill_ms_per_chunk),
    ]
    rust = (
        [args.kvpipe, "serve", "--listen", "127.0.0.1:0", "--json", *workload],
        [args.kvpipe, "demo", "--transport", "tcp", "--json", *workload, *prefill_flags],
        "stderr",
    )
    py = [sys.executable, str(TWO_PROCESS)]
    content = ["--content", args.content]
    python = (
        [*py, "decode", "--listen", "127.0.0.1:0", *workload, *content],
        [*py, "prefill", *workload, *prefill_flags, *content],
        "port",
    )
    rust_runs, python_runs, ratios, compute = [], [], [], []
    for i in range(args.runs):
        order = [("rust", rust), ("python", python)]
        if i % 2:
            order.reverse()
        got = {}
        for name, (decode_cmd, prefill_cmd, pattern) in order:
            report, prefill_report = run_pair(decode_cmd, prefill_cmd, pattern, args.timeout)
            if not report.get("verified"):
                raise SystemExit(f"{name} run {i}: not verified: {report}")
            got[name] = report
            if name == "python":
                compute.append(prefill_report["compute_seconds"])
        if got["rust"]["bytes"] != got["python"]["bytes"]:
            raise SystemExit(f"the two moved different bytes: {got}")
        rust_runs.append(got["rust"]["gbps"])
        python_runs.append(got["python"]["gbps"])
        ratios.append(got["python"]["gbps"] / got["rust"]["gbps"])
        print(f"run {i}: python {python_runs[-1]:.3f} GB/s, rust {rust_runs[-1]:.3f} GB/s, "
              f"ratio {ratios[-1]:.3f}", file=sys.stderr)
    result = {
        "transport": "tcp",
        "bytes": got["rust"]["bytes"],
        "python_gbps": statistics.median(python_runs),
        "baseline": "kvpipe-cli-tcp-demo",
        "baseline_gbps": statistics.median(rust_runs),
        "ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(python_runs) / statistics.median(rust_runs),
        "runs": args.runs,
        "python_content": args.content,
        "python_compute_s": statistics.median(compute),
        "python_runs_gbps": python_runs,
        "baseline_runs_gbps": rust_runs,
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "chunk_tokens": args.chunk_tokens,
        "requests": args.requests,
        "connections": args.connections,
        "prefill_ms_per_chunk": args.prefill_ms_per_chunk,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
