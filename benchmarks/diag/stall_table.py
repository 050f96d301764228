"""Where the attention kernel's warps wait, instruction by instruction, from Nsight Compute's
source view: ``ncu -i REPORT --page source --csv --print-source sass > stalls.csv``, then

    python benchmarks/diag/stall_table.py stalls.csv [top]

prints the sampled stall reasons summed over the kernel, the samples summed by opcode, and the
``top`` SASS instructions (30 by default) by warp-stall samples with their address and their own
largest reasons.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict


def number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main(path: str, top: int = 30):
    with open(path, newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.startswith("==")]
    rows = list(csv.reader(lines))
    head_at = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head, body = rows[head_at], [r for r in rows[head_at + 1:] if len(r) == len(rows[head_at])]
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    addr = next((i for i, c in enumerate(head) if "Address" in c), None)
    total_col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    numeric = [i for i, c in enumerate(head) if i not in (src, addr) and
               sum(number(r[i]) is not None for r in body) > len(body) // 2]
    print(f"{len(body)} SASS lines; columns: {', '.join(head[i] for i in numeric)}\n")
    sums = defaultdict(float)
    for r in body:
        for i in numeric:
            sums[i] += number(r[i]) or 0.0
    total = sums[total_col] or 1.0
    print("## summed over the kernel (share of all warp-stall samples)")
    for i in sorted(numeric, key=lambda i: -sums[i]):
        if sums[i] and "stall" in head[i].lower():
            print(f"  {head[i]}: {sums[i]:.0f} ({100 * sums[i] / total:.1f} %)")
    by_op = defaultdict(float)
    for r in body:
        words = [w for w in r[src].split() if not w.startswith("@")]
        if words:
            by_op[words[0].split(".")[0]] += number(r[total_col]) or 0.0
    print("\n## samples by opcode")
    for op, samples in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {op:<12} {100 * samples / total:5.1f} %")
    print(f"\n## top {top} instructions by samples")
    ranked = sorted(body, key=lambda r: -(number(r[total_col]) or 0.0))[:top]
    for r in ranked:
        samples = number(r[total_col]) or 0.0
        reasons = sorted(((number(r[i]) or 0.0, head[i]) for i in numeric
                          if i != total_col and "stall" in head[i].lower() and "Sampling" not in head[i]),
                         reverse=True)[:3]
        why = ", ".join(f"{name.replace('stall_', '')} {value:.0f}" for value, name in reasons if value)
        where = r[addr] if addr is not None else ""
        print(f"  {100 * samples / total:5.1f} %  {where:>8}  {r[src].strip()[:70]:<70}  {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
