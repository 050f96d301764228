"""Time the experiment kernels of ``kernel_variants_m128.py`` against the production kernel.

    python benchmarks/bench_kernel_m128.py --out benchmarks/results/h200/kernel_m128.md
    python benchmarks/bench_kernel_m128.py --dry-run --out /tmp/m128.md    # CPU interpreter, tiny

For each input kind (``--inputs``) and each routing config (top-k 10 %, top-k 20 %, tau 1 with
tail) at the H3 shape (B=1, T=37296, H=56, D=128, bf16): build the plan once (untimed), time the
production kernel (``launch``, default config: w4/s3/TMA) and every variant (host-side
preparation such as the pair lists untimed; kernel launches only) with
``triton.testing.do_bench`` (median), and check each variant's relative L2 against the production
kernel's output (the same function of the same plan; expected ~1e-3 or below, bf16 rounding).

Input kinds:
- ``random``: ``solattn.bench.make_inputs`` (block-structured, spread 2), the inputs of
  ``python -m solattn bench`` and of the comparison table of the issue; every block's offset is
  drawn independently, so neighbouring query blocks choose nearly independent key lists;
- ``smooth``: the same construction with block offsets correlated between neighbouring blocks
  (AR(1), ``--rho``), a stand-in for video tokens, whose neighbouring blocks attend alike.

Columns: ms (median), speed-up over the production kernel, TFLOP/s on useful FLOPs
(``4 x kept_pairs x 64 x 64 x D``, kept pairs from the plan) and on performed FLOPs (the union
kernel computes 128 rows x |union| key blocks per pair), relative L2 to the production kernel.
Pair statistics per config: work ratio (performed / useful of the union kernel), the fraction of
pairs whose lists coincide and whose union costs <= 1.25 x their useful work.
A variant that fails to compile or run is reported and skipped; ``--budget-s`` skips the rest once
spent (the lead's budget is ~3 minutes including compilation).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

T0 = time.time()
LINES = []


def say(msg=""):
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="markdown file to write")
    ap.add_argument("--shape", default="1,37296,56,128", help="B,T,H,D (default: H3)")
    ap.add_argument("--inputs", default="random,smooth", help="comma list of: random, smooth")
    ap.add_argument("--rho", type=float, default=0.9, help="neighbour correlation of block offsets (smooth)")
    ap.add_argument("--configs", default="topk0.1,topk0.2,tau1tail",
                    help="comma list of topk<r> (no tail), topk<r>tail, tau<t>tail, tau<t>")
    ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip what is left after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU through Triton's interpreter")
    return ap.parse_args()


ARGS = parse()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"

import kernel_variants_m128 as M  # noqa: E402
from solattn.backends.triton import launch  # noqa: E402
from solattn.bench import make_inputs, rel_l2  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.validation import BLOCK, validate  # noqa: E402

DEV = torch.device("cpu" if ARGS.dry_run else "cuda")


def bench_ms(fn):
    if DEV.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def smooth_inputs(shape, dtype, seed, rho, spread=2.0):
    """``make_inputs``' construction (0.5 randn per token + ``spread`` randn per 64-token block)
    with each block offset an AR(1) step from the previous block's: correlation ``rho`` between
    neighbours, the same marginal size. Drawn on the CPU from a seeded generator, then moved."""
    B, T, H, D = shape
    n = math.ceil(T / BLOCK)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        e = torch.randn(n, B, H, D, generator=g)
        off = torch.empty_like(e)
        off[0] = e[0]
        c = math.sqrt(1.0 - rho * rho)
        for j in range(1, n):
            off[j] = rho * off[j - 1] + c * e[j]
        x = torch.randn(B, T, H, D, generator=g).mul_(0.5)
        x.add_(off.permute(1, 0, 2, 3).mul(spread).repeat_interleave(BLOCK, dim=1)[:, :T])
        out.append(x.to(dtype=dtype, device=DEV))
    return tuple(out)


def config_kwargs(name):
    tail = name.endswith("tail")
    core = name[:-4] if tail else name
    if core.startswith("topk"):
        return dict(topk_ratio=float(core[4:]), tail=tail)
    if core.startswith("tau"):
        return dict(tau=float(core[3:]), tail=tail)
    raise SystemExit(f"--configs: unknown entry {name!r} (topk<r>[tail] or tau<t>[tail])")


def performed_pairs(name, plan, pp, problem):
    """(query block, key block) pairs of 64 x 64 logits the variant computes."""
    kept = int(plan.kv_num_blocks.long().sum())
    if name.startswith("union"):
        return 2 * int(pp.union_num.long().sum())
    if name.startswith("split"):
        max_overhead = 1.0 if "exact" in name else 1.25
        pairs, singles = M.split_work(pp, problem.n, max_overhead)
        done = 2 * int(pp.union_num.flatten()[pairs.long()].long().sum())
        return done + int(plan.kv_num_blocks.flatten()[singles.long()].long().sum())
    if name.startswith("pair3d"):                  # both halves run max(|E_2p|, |E_2p+1|) steps
        return 2 * int(torch.maximum(pp.n_even, pp.n_odd).long().sum())
    return kept


def main():
    B, T, H, D = (int(x) for x in ARGS.shape.split(","))
    if ARGS.dry_run:
        B, T, H, D = 1, 300, 2, 64
    shape = (B, T, H, D)
    all_variants = M.variants(tma=True)
    names = [v for v in ARGS.variants.split(",") if v] or list(all_variants)
    unknown = [v for v in names if v not in all_variants]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {list(all_variants)}")
    rows, stats_rows, failures = [], [], []
    dev_name = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (interpreter)"
    say(f"shape B={B} T={T} H={H} D={D} bf16 on {dev_name}; variants: {names}")
    for kind in ARGS.inputs.split(","):
        if kind == "random":
            q, k, v = make_inputs(shape, torch.bfloat16, DEV, seed=0)
        elif kind == "smooth":
            q, k, v = smooth_inputs(shape, torch.bfloat16, 0, ARGS.rho)
        else:
            raise SystemExit(f"--inputs: unknown kind {kind!r} (random, smooth)")
        say(f"inputs {kind} ready")
        for cname in ARGS.configs.split(","):
            problem = validate(q, k, v, **config_kwargs(cname))
            plan = build_plan(problem)
            pp = M.pair_plan(plan)
            st = pp.stats()
            kept = int(plan.kv_num_blocks.long().sum())
            useful = 4.0 * kept * BLOCK * BLOCK * D
            stats_rows.append(dict(inputs=kind, config=cname, kept=plan.kept_fraction, **st))
            say(f"{kind} {cname}: kept {plan.kept_fraction:.3f}, union work ratio {st['work_ratio']:.3f}, "
                f"coinciding pairs {st['coincide_frac']:.3f}, union <= 1.25x {st['le_1p25_frac']:.3f}")
            want = launch(problem, plan)
            base_ms = bench_ms(lambda: launch(problem, plan, out=want))
            rows.append(dict(inputs=kind, config=cname, variant="production w4/s3/tma", ms=base_ms,
                             speedup=1.0, useful_tf=useful / base_ms / 1e9, done_tf=useful / base_ms / 1e9,
                             rel=0.0))
            say(f"  production {base_ms:8.3f} ms  {useful / base_ms / 1e9:6.1f} TFLOP/s")
            for name in names:
                if time.time() - T0 > ARGS.budget_s:
                    failures.append(f"{kind} {cname} {name}: skipped (time budget spent)")
                    continue
                try:
                    run = all_variants[name].prepare(problem, plan)
                    out = torch.full_like(want, float("nan"))
                    run(out)
                    err = rel_l2(out, want) if torch.isfinite(out).all() else float("nan")
                    ms = bench_ms(lambda: run(out))
                except Exception as e:  # a variant that does not compile (shared memory, registers)
                    msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                    failures.append(f"{kind} {cname} {name}: {type(e).__name__}: {msg}")
                    say(f"  {name:22s} FAILED: {msg}")
                    traceback.print_exc(limit=2)
                    continue
                done = 4.0 * performed_pairs(name, plan, pp, problem) * BLOCK * BLOCK * D
                rows.append(dict(inputs=kind, config=cname, variant=name, ms=ms, speedup=base_ms / ms,
                                 useful_tf=useful / ms / 1e9, done_tf=done / ms / 1e9, rel=err))
                say(f"  {name:22s} {ms:8.3f} ms  x{base_ms / ms:5.3f}  useful {useful / ms / 1e9:6.1f} / "
                    f"performed {done / ms / 1e9:6.1f} TFLOP/s  rel_l2 {err:.1e}")
        del q, k, v
    write(shape, dev_name, rows, stats_rows, failures, all_variants)
    say(f"wrote {ARGS.out}")


def write(shape, dev_name, rows, stats_rows, failures, all_variants):
    B, T, H, D = shape
    md = [f"# m128 / work-list kernel experiments: B={B} T={T} H={H} D={D} bf16, {dev_name}", "",
          "Kernel only (plan and pair lists built beforehand), median of `triton.testing.do_bench`. "
          "speed-up: production kernel time / variant time in the same config. TFLOP/s on useful "
          "FLOPs (4 x kept pairs x 64 x 64 x D) and on FLOPs performed. rel_l2: against the "
          "production kernel's output.", "",
          "| inputs | config | variant | ms | speed-up | TFLOP/s useful | TFLOP/s performed | rel_l2 |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['inputs']} | {r['config']} | {r['variant']} | {r['ms']:.3f} | {r['speedup']:.3f} | "
                  f"{r['useful_tf']:.0f} | {r['done_tf']:.0f} | {r['rel']:.1e} |")
    md += ["", "Pairs of consecutive query blocks (2p, 2p+1): the union kernel's work over the useful work, "
           "fraction of pairs whose lists coincide, and whose union costs <= 1.25x.", "",
           "| inputs | config | kept | pairs | work ratio | coinciding | <= 1.25x |", "|---|---|---|---|---|---|---|"]
    for s in stats_rows:
        md.append(f"| {s['inputs']} | {s['config']} | {s['kept']:.3f} | {s['pairs']} | {s['work_ratio']:.3f} | "
                  f"{s['coincide_frac']:.3f} | {s['le_1p25_frac']:.3f} |")
    md += ["", "Variants:", ""] + [f"- `{v.name}`: {v.what}" for v in all_variants.values()]
    if failures:
        md += ["", "Failed or skipped:", ""] + [f"- {f}" for f in failures]
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
