"""A two-process transfer over TCP from Python: the decode side runs in a child process, the
prefill side in this one; numpy pools on both sides, every byte checked by the decode side."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

import two_process

HERE = Path(__file__).parent
# Small enough for a debug build on a shared two-core machine; several chunks per request,
# a last chunk that ends mid-block, and three requests prefilled round-robin.
WORKLOAD = ["--model", "tiny", "--prompt-tokens", "1000", "--chunk-tokens", "96",
            "--requests", "3", "--timeout", "60"]


@pytest.mark.parametrize("connections", ["1", "2"])
def test_two_process_tcp_transfer_checks_every_byte(connections, capsys):
    decode = subprocess.Popen(
        [sys.executable, str(HERE / "two_process.py"), "decode", *WORKLOAD],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        first = decode.stdout.readline().split()
        assert first[0] == "port", first
        code = two_process.main(
            ["prefill", "--connect", f"127.0.0.1:{first[1]}", "--connections", connections,
             *WORKLOAD]
        )
        assert code == 0
        out, _ = decode.communicate(timeout=60)
    finally:
        decode.kill()
    prefill_report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads(out.strip().splitlines()[-1])
    assert decode.returncode == 0, report
    assert report["verified"] is True
    assert report["completed"] == 3 and prefill_report["completed"] == 3
    w = two_process.Workload(
        Namespace(model="tiny", tokens_per_block=32, prompt_tokens=1000, requests=3), region=0
    )
    assert report["bytes"] == 3 * w.blocks * w.slot_bytes == prefill_report["bytes"]
    assert report["checked_bytes"] == w.slots * w.slot_bytes
    assert report["mismatched_slots"] == 0 and report["writes_refused"] == 0
