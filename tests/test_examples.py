"""Examples started the wrong way say how to start them, without a traceback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_distributed_example_run_plainly_says_use_torchrun():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    script = ROOT / "examples" / "distributed_sol_attn.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "run me with torchrun --nproc-per-node N" in r.stderr
    assert f"torchrun --standalone --nproc-per-node 2 {script} --device cpu" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
