"""`python -m solattn info` and `check`."""

from __future__ import annotations

import subprocess
import sys

import torch

from solattn import cli


def test_info_lists_torch_devices_and_backends():
    res = subprocess.run([sys.executable, "-m", "solattn", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert torch.__version__ in res.stdout
    assert "devices: cpu" in res.stdout
    for name in ("sdpa", "reference"):
        assert f"  {name}" in res.stdout
    assert "priority: sdpa" in res.stdout


def test_check_passes_here(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "sdpa" in out and "pass" in out and "FAIL" not in out


def test_check_fails_with_exit_code_1_when_a_backend_is_wrong(monkeypatch, capsys):
    from solattn.backends import sdpa as sdpamod
    real = sdpamod.sdpa_forward
    monkeypatch.setattr(sdpamod, "sdpa_forward", lambda p, plan, nbytes=None: real(p, plan) * 1.1)
    assert cli.main(["check", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out
