"""The engine connector example runs: both sides over loopback TCP, every block checked."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "engine_connector.py"


def test_engine_connector_example_transfers_and_verifies():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 of 3 requests received" in run.stdout and "KV verified" in run.stdout
    assert "512 of 512 slots free" in run.stdout
