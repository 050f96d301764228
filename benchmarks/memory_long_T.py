"""Working memory of one sol_attn call at long T under a memory budget (Linux: reads /proc).

    python benchmarks/memory_long_T.py H BUDGET_BYTES

B=1, T=262144, D=64, bf16, top-k 0.001, backend sdpa. Prints the peak resident memory of the call
above what the process held before it, output excluded (the high-water mark is reset first).
"""
import json
import sys

import torch

import solattn


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def main() -> None:
    B, T, H, D = 1, 262144, int(sys.argv[1]), 64
    budget = int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g).to(torch.bfloat16) for _ in range(3))
    solattn.sol_attn(q[:, :4096], k[:, :4096], v[:, :4096], topk_ratio=0.01)   # warm the libraries
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    with solattn.memory_budget(budget):
        out = solattn.sol_attn(q, k, v, topk_ratio=0.001, backend="sdpa")
    working = status("VmHWM") - before - out.numel() * out.element_size()
    print(json.dumps({"H": H, "budget_MiB": budget >> 20, "working_MiB": round(working / 2**20)}))


if __name__ == "__main__":
    main()
