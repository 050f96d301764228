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


#: ops that only make views or read metadata (no kernel launch on a GPU or XPU); empty / empty_like
#: allocate from the caching allocator without a launch
METADATA_OPS = {f"aten::{name}" for name in (
    "view", "slice", "reshape", "unsqueeze", "squeeze", "alias", "select", "split", "split_with_sizes",
    "expand", "expand_as", "as_strided", "transpose", "permute", "t", "narrow", "detach", "detach_",
    "lift_fresh", "_reshape_alias", "flatten", "unflatten", "unbind", "view_as", "chunk", "empty",
    "empty_like", "result_type", "resolve_conj", "resolve_neg", "is_nonzero")}


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
        compute = Counter({name: c for name, c in top.items() if name not in METADATA_OPS})
        print(f"{kw}: {sum(top.values())} top-level aten ops, {sum(compute.values())} of them not views "
              f"(on a GPU or XPU, launches), {sdpa} SDPA calls, {sum(top.values()) / max(1, sdpa):.0f} ops "
              f"and {sum(compute.values()) / max(1, sdpa):.0f} launches per SDPA call; commonest: "
              f"{top.most_common(12)}; commonest launches: {compute.most_common(12)}")


if __name__ == "__main__":
    main()
