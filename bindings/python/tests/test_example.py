"""The examples run: the engine connector (both sides over loopback TCP, every block checked)
and, where torch and transformers are installed, the real-model example on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "engine_connector.py"


def test_engine_connector_example_transfers_and_verifies():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 of 3 requests received" in run.stdout and "KV verified" in run.stdout
    assert "512 of 512 slots free" in run.stdout


def test_disagg_generate_example_verifies_tokens_on_cpu(tmp_path):
    """The real-model example (needs torch and transformers; skipped where they are missing):
    a tiny Llama-shaped model and a sliding-window one, prefill and decode as two processes over
    TCP with host pools, the decode side's tokens equal to a single-process run and a changed
    pool byte changing them."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    example = Path(__file__).parents[1] / "examples" / "disagg_generate.py"
    for model, blocks in (("llama", "contiguous"), ("sliding", "reversed")):
        out = tmp_path / f"{model}.json"
        run = subprocess.run(
            [sys.executable, str(example), "--device", "cpu", "--model", model, "--reps", "1",
             "--prompt-lens", "1000", "--new-tokens", "8", "--decode-blocks", blocks,
             "--out", str(out)],
            capture_output=True, text=True, timeout=600,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        summary = json.loads(out.read_text())
        assert summary["verified"] and summary["corruption_detected"], summary
        (result,) = summary["results"]
        assert result["tokens_compared"] == 9
        # 63 blocks of 16 tokens; a block of one layer is 2 * 16 tokens * 2 heads * 64 * 4 bytes.
        layer_block = 2 * 16 * 2 * 64 * 4
        if model == "llama":
            assert result["kv_bytes"] == 4 * 63 * layer_block
        else:
            # Two full layers send every block; the two sliding ones (window 640) only from the
            # stale boundary (1000 + 1 - 640) // 16 = 22 on.
            assert [g["window"] for g in summary["layer_groups"]] == [None, 640]
            assert result["kv_bytes"] == (2 * 63 + 2 * (63 - 22)) * layer_block
