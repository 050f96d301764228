"""What a new user meets first on a CPU: the automatic backend's first call in a fresh process.

Each row runs in a process of its own (nothing compiled, torch's compile cache as the
environment leaves it) at B=1, T=8192, H=16, D=128 bf16, top-k 10 %, no tail:

- ``automatic``: the backend the automatic choice takes, its first call and the median of the
  next ``--repeats`` calls;
- ``warm_up then automatic``: ``solattn.warm_up(solattn.sol_attn, ...)`` (flex's compile where it
  can run), then the automatic choice's first call and median after it;
- ``dense``: ``F.scaled_dot_product_attention`` on the same tensors, the same way.

Every row carries its error against the ``sdpa`` backend on fp32 copies of the inputs (the
reference's T x T scores do not fit its budget here) and the model of its work: FLOPs of the
attention it computes (dense: ``4 B H T^2 D``; sparse: the kept key blocks' share) and the bytes
of q, k, v and the output.

    python benchmarks/bench_first_call.py --out results.md
    python benchmarks/run.py first_call          # the same, kept as results/<device>/first_call.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, statistics, sys, time, torch, solattn
    import torch.nn.functional as F
    from solattn import dispatch
    from solattn.routing import build_plan
    from solattn.validation import validate
    mode, repeats, shape, ratio = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], float(sys.argv[4])
    B, T, H, D = shape
    g = torch.Generator().manual_seed(0)
    blocks = -(-T // 64)
    offset = torch.randn(B, blocks, H, D, generator=g).repeat_interleave(64, 1)[:, :T] * 1.5
    q, k, v = ((torch.randn(B, T, H, D, generator=g) + offset).to(torch.bfloat16) for _ in range(3))
    kw = dict(topk_ratio=ratio, tail=False)
    out = {"mode": mode}
    if mode == "dense":
        fn = lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
        out["backend"] = "dense SDPA"
    else:
        if mode == "warm":
            out["warm_up_s"] = solattn.warm_up(solattn.sol_attn, q, k, v, **kw)
        out["backend"] = dispatch.choose(validate(q, k, v, **kw)).name
        fn = lambda: solattn.sol_attn(q, k, v, **kw)
        plan = build_plan(validate(q, k, v, **kw))
        kept = plan.kv_num_blocks.sum().item() / (B * H * blocks)
        out["kept_fraction"] = kept / blocks
    t0 = time.perf_counter(); y = fn(); out["first_s"] = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    out["median_ms"] = statistics.median(times) * 1e3
    want = solattn.sol_attn(*(x.float() for x in (q, k, v)), backend="sdpa", **kw)
    if mode == "dense":
        want = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    out["error"] = ((y.float() - want).norm() / want.norm()).item()
    print(json.dumps(out))
""")


def run_child(mode: str, repeats: int, shape, ratio: float, timeout: float) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, mode, str(repeats), ",".join(map(str, shape)), str(ratio)],
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        return {"mode": mode, "failed": (res.stderr.strip() or res.stdout.strip() or "?").splitlines()[-1]}
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row["log"] = [line for line in res.stderr.splitlines() if line.startswith("solattn:")]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,8192,16,128", help="B,T,H,D (default 1,8192,16,128)")
    ap.add_argument("--ratio", type=float, default=0.1, help="top-k ratio (default 0.1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls after the first (default 5)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per process (default 400)")
    ap.add_argument("--out", default=None, help="write the Markdown table here too")
    args = ap.parse_args(argv)
    import torch
    import solattn
    from solattn.backends.flex import amx_usable
    shape = [int(x) for x in args.shape.split(",")]
    B, T, H, D = shape
    rows = [run_child(m, args.repeats, shape, args.ratio, args.timeout) for m in ("dense", "automatic", "warm")]
    dense = next((r for r in rows if r["mode"] == "dense" and "failed" not in r), None)
    flops_dense = 4 * B * H * T * T * D
    nbytes = 4 * B * T * H * D * 2
    lines = [f"B={B} T={T} H={H} D={D} bf16, top-k {args.ratio:g}, no tail; CPU: "
             f"{'AMX' if amx_usable() else 'no AMX'}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"SOLATTN_FLEX_CPU={os.environ.get('SOLATTN_FLEX_CPU', '(unset)')}; each row a fresh process; error "
             f"against the sdpa backend on fp32 copies (dense: dense SDPA in fp32); bytes: q, k, v and the output "
             f"({nbytes / 2**20:.0f} MiB)", "",
             "| row | backend | warm_up | first call | then (median) | vs dense (medians) | FLOPs | error |",
             "|---|---|---|---|---|---|---|---|"]
    names = {"dense": "dense", "automatic": "automatic", "warm": "warm_up, then automatic"}
    for r in rows:
        if "failed" in r:
            lines.append(f"| {names[r['mode']]} | failed: {r['failed']} | | | | | | |")
            continue
        flops = flops_dense * r.get("kept_fraction", 1.0)
        ratio = f"{dense['median_ms'] / r['median_ms']:.2f}x" if dense else ""
        warm = f"{r['warm_up_s']:.1f} s" if "warm_up_s" in r else ""
        lines.append(f"| {names[r['mode']]} | {r['backend']} | {warm} | {r['first_s']:.2f} s | {r['median_ms']:.1f} ms "
                     f"| {ratio} | {flops / 1e9:.1f} G | {r['error']:.1e} |")
    logs = sorted({line for r in rows for line in r.get("log", [])})
    if logs:
        lines += ["", "Log lines the calls printed:", ""] + [f"    {line}" for line in logs]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
