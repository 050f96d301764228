"""The portable backend's working memory stays under its budget at long T (never T x T)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, resource, torch, solattn
    def rss():  # peak resident set size of this process, bytes (Linux reports KiB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    B, T, H, D = 1, 32768, 2, 128
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    gate = torch.randn(B, T, H, D)
    solattn.sol_attn(q[:, :256], k[:, :256], v[:, :256], topk_ratio=0.1)  # warm the libraries
    before = rss()
    with solattn.memory_budget(BUDGET):
        out = solattn.sol_attn(q, k, v, topk_ratio=0.05, coarse_gate=gate, backend="sdpa")
    peak = rss()
    print(json.dumps({"working": peak - before - out.numel() * out.element_size(),
                      "finite": bool(torch.isfinite(out).all()), "shape": list(out.shape)}))
""")


@pytest.mark.parametrize("budget", [1 << 30, 256 << 20], ids=["1GiB-default", "256MiB"])
def test_sdpa_peak_memory_under_budget_at_T_32768(budget):
    script = f"BUDGET = {budget}\n" + SCRIPT
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["finite"] and info["shape"] == [1, 32768, 2, 128]
    tt_scores = 1 * 2 * 32768 * 32768 * 4          # a T x T fp32 score tensor: 8 GiB
    assert info["working"] < budget + (64 << 20), info      # the budget (+ allocator slack)
    assert info["working"] < tt_scores / 8
