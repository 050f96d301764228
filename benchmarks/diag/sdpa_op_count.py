"""Host-side op count of one portable (sdpa) ``sol_attn`` call at the seed shape, per version.

    python benchmarks/diag/sdpa_op_count.py [SOLATTN_ROOT]     # default: this checkout

Every aten op is a host round of dispatch (and on a GPU or XPU a launch for the non-view ones),
so on small problems the count is the backend's host cost. Runs on the CPU (the chunking there
follows the CPU memory model, so counts are for comparing versions, not GPU absolutes): B=2,
T=4056, H=16, D=128 bf16, top-k 10 % and tau 1 with tail; prints the number of top-level aten
ops, the number of SDPA calls and the commonest ops.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import solattn  # noqa: E402


def main():
    print(solattn.__file__)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4056, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    for kw in (dict(topk_ratio=0.1, tail=False), dict(tau=1.0, tail=True)):
        with torch.no_grad():
            solattn.sol_attn(q, k, v, backend="sdpa", **kw)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                solattn.sol_attn(q, k, v, backend="sdpa", **kw)
        top = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                      and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        sdpa = top["aten::scaled_dot_product_attention"]
        print(f"{kw}: {sum(top.values())} top-level aten ops, {sdpa} SDPA calls, "
              f"{sum(top.values()) / max(1, sdpa):.0f} per SDPA call; commonest: {top.most_common(12)}")


if __name__ == "__main__":
    main()
