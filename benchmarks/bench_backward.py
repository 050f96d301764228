"""Training-step timing of solattn's triton fused backward against dense SDPA, and its gradient error.

    python benchmarks/bench_backward.py --out benchmarks/results/h200/backward.md
    python benchmarks/bench_backward.py --quick        # seed shape only (a fast check)

For each case (H3: B=1, T=37296, H=56, D=128; seed: B=2, T=4056, H=16, D=128; bf16): dense SDPA
forward and forward + backward; ``sol_attn`` on ``triton`` forward and forward + backward (the
fused backward), with the backward's parts (plan rebuild, kernels incl. the transposed lists);
the relative L2 error of the fused gradients (q, k, v, gate) against the portable backward
(``sol_attn(..., backend="sdpa")``: sdpa forward, recomputed through sdpa); a FLOP model; peak
memory. Then a launch-config sweep of the backward kernels on the first case. Prints a markdown
table and writes it to ``--out``. Needs a CUDA GPU with Triton; about 3 minutes on an H200.

FLOP model (multiply-adds x 2): dense forward ``4 B H T^2 D``, backward ``2.5x`` that (flash's
five T x T x D products against two); solattn counts the same per kept (query, key) pair
(``kept`` = the plan's kept fraction), so "useful TFLOP/s" compares like with like. The fused
kernels do more than that model: dq recomputes QK^T and dO V^T (3 products with dS K), dk/dv
recomputes both (4 products): 7 against flash's 5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import solattn  # noqa: E402
from solattn.backends.triton.backend import launch  # noqa: E402
from solattn.backends.triton.backward import fused_backward, lse_shape  # noqa: E402
from solattn.backends.triton.tuning import BackwardConfig  # noqa: E402
from solattn.bench.report import publish  # noqa: E402
from solattn.bench.timing import log, reset_clock, time_calls  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

H3 = dict(B=1, T=37296, H=56, D=128)
SEED = dict(B=2, T=4056, H=16, D=128)
CASES = [
    ("H3 top-k 10% no tail", H3, dict(topk_ratio=0.10, tail=False), False),
    ("H3 top-k 10% tail + gate", H3, dict(topk_ratio=0.10, tail=True), True),
    ("H3 top-k 20% no tail", H3, dict(topk_ratio=0.20, tail=False), False),
    ("seed top-k 10% no tail", SEED, dict(topk_ratio=0.10, tail=False), False),
    ("seed top-k 10% tail + gate", SEED, dict(topk_ratio=0.10, tail=True), True),
    ("seed top-k 20% no tail", SEED, dict(topk_ratio=0.20, tail=False), False),
]


def median(xs):
    return sorted(xs)[len(xs) // 2]


def run_case(name, shape, kw, with_gate, dev, repeats):
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=0)
    gate = torch.rand(B, T, H, D, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16) \
        if with_gate else None
    w = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(2)).to(dev, torch.bfloat16)
    ins = [q, k, v] + ([gate] if with_gate else [])
    leaves = [x.clone().requires_grad_(True) for x in ins]
    extra = {"coarse_gate": leaves[3]} if with_gate else {}
    row = {"case": name}

    # dense SDPA (no gate term: the dense baseline is plain attention)
    dq_, dk_, dv_ = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))

    def dense_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(dq_, dk_, dv_)

    def dense_fwd_bwd():
        for x in (dq_, dk_, dv_):
            x.grad = None
        o = F.scaled_dot_product_attention(dq_, dk_, dv_)
        o.backward(w.transpose(1, 2))

    row["dense fwd"] = median(time_calls(dense_fwd, dev, repeats, warmup=2))
    row["dense fwd+bwd"] = median(time_calls(dense_fwd_bwd, dev, repeats, warmup=2))
    # the yardstick for a bf16 backward: dense SDPA's own bf16 gradient error against fp32 SDPA
    dense_grads = [x.grad.clone() for x in (dq_, dk_, dv_)]
    f32 = [x.detach().float().requires_grad_(True) for x in (dq_, dk_, dv_)]
    try:
        F.scaled_dot_product_attention(*f32).backward(w.transpose(1, 2).float())
        row["dense bf16 grad err"] = ", ".join(f"{n} {rel_l2(a, b.grad):.1e}"
                                               for n, a, b in zip("qkv", dense_grads, f32))
    except (torch.OutOfMemoryError, RuntimeError) as err:
        row["dense bf16 grad err"] = f"fp32 SDPA failed ({type(err).__name__})"
    del f32, dense_grads
    log(f"{name}: dense {row['dense fwd']:.1f} / {row['dense fwd+bwd']:.1f} ms")

    def sol_fwd():
        with torch.no_grad():
            return solattn.sol_attn(q, k, v, backend="triton", coarse_gate=gate, **kw)

    def sol_fwd_bwd():
        for x in leaves:
            x.grad = None
        out = solattn.sol_attn(*leaves[:3], backend="triton", **extra, **kw)
        out.backward(w)

    row["sol fwd"] = median(time_calls(sol_fwd, dev, repeats, warmup=2))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    row["sol fwd+bwd"] = median(time_calls(sol_fwd_bwd, dev, repeats, warmup=2))
    row["peak GiB"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else float("nan")
    fused = [x.grad.clone() for x in leaves]

    # the backward's parts, outside autograd: plan rebuild, then kernels (+ transposed lists)
    problem = validate(q, k, v, coarse_gate=gate, **kw)
    plan = build_plan(problem)
    lse = torch.empty(lse_shape(B, T, H), dtype=torch.float32, device=dev)
    resid = torch.empty_like(q)
    out = launch(problem, plan, lse=lse, resid=resid)
    row["kept"] = plan.kept_fraction
    row["plan"] = median(time_calls(lambda: build_plan(problem), dev, repeats, warmup=1))
    row["bwd kernels"] = median(time_calls(lambda: fused_backward(problem, plan, out, lse, resid, w), dev, repeats,
                                           warmup=2))
    log(f"{name}: solattn {row['sol fwd']:.1f} / {row['sol fwd+bwd']:.1f} ms "
        f"(plan {row['plan']:.1f}, kernels {row['bwd kernels']:.1f}), kept {row['kept']:.3f}")

    # gradient error against the portable backward (sdpa forward, recomputed through sdpa)
    ref_leaves = [x.clone().requires_grad_(True) for x in ins]
    ref_extra = {"coarse_gate": ref_leaves[3]} if with_gate else {}
    names = "q k v gate".split()[:len(ins)]
    try:
        solattn.sol_attn(*ref_leaves[:3], backend="sdpa", **ref_extra, **kw).backward(w)
    except torch.OutOfMemoryError:
        # no reference at this size, the timings stand (the portable backward ran out of an
        # H200's memory at H3 top-k 20 % while it kept every chunk's gathered keys for autograd)
        row["grad err"] = "reference backward out of memory"
        ref_leaves = None
        torch.cuda.empty_cache()
    if ref_leaves is not None:
        row["grad err"] = ", ".join(f"{n} {rel_l2(a, b.grad):.1e}" for n, a, b in zip(names, fused, ref_leaves))
    del ref_leaves

    flop_fwd_dense = 4.0 * B * H * T * T * D
    flop_fwd = flop_fwd_dense * row["kept"]
    row["useful TFLOP/s fwd+bwd"] = 3.5 * flop_fwd / (row["sol fwd+bwd"] * 1e-3) / 1e12
    row["dense TFLOP/s fwd+bwd"] = 3.5 * flop_fwd_dense / (row["dense fwd+bwd"] * 1e-3) / 1e12
    row["speed-up fwd+bwd"] = row["dense fwd+bwd"] / row["sol fwd+bwd"]
    return row, (problem, plan, out, lse, resid, w)


def sweep(state, dev, repeats):
    """Kernel time of every backward launch config on one case (the default first)."""
    problem, plan, out, lse, resid, w = state
    default = BackwardConfig()
    configs = [default]
    for dqw in (4, 8):
        for dqs in (2, 3):
            for kvw in (4, 8):
                for kvs in (2, 3):
                    c = BackwardConfig(dqw, dqs, kvw, kvs)
                    if c != default:
                        configs.append(c)
    rows = []
    for c in configs:
        try:
            ms = median(time_calls(lambda: fused_backward(problem, plan, out, lse, resid, w, config=c), dev, repeats,
                                   warmup=1))
        except Exception as err:  # a config that does not compile (shared memory) is reported, not fatal
            rows.append((c, None, f"{type(err).__name__}: {str(err)[:80]}"))
            continue
        rows.append((c, ms, ""))
        log(f"sweep {c}: {ms:.2f} ms")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_backward.md")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="seed shape only")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="only the cases whose name contains one of these texts")
    parser.add_argument("--smoke", action="store_true",
                        help="check this script on the CPU: tiny shapes, kernels in Triton's interpreter")
    args = parser.parse_args()
    if args.smoke:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        dev = torch.device("cpu")
        tiny = dict(B=1, T=300, H=2, D=32)
        cases = [("smoke top-k 30% no tail", tiny, dict(topk_ratio=0.3, tail=False), False),
                 ("smoke top-k 30% tail + gate", tiny, dict(topk_ratio=0.3, tail=True), True)]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_backward.py needs a CUDA GPU (the fused backward is the triton backend's); "
                     "--smoke checks the script on the CPU")
        dev = torch.device("cuda")
        cases = [c for c in CASES if not args.quick or c[1] is SEED]
    if args.cases:
        cases = [c for c in cases if any(t in c[0] for t in args.cases)]
        if not cases:
            sys.exit(f"--cases received {args.cases}; allowed: texts found in the case names "
                     f"{[c[0] for c in (CASES if not args.smoke else [])]}")
    reset_clock()
    rows, first = [], None
    for name, shape, kw, gate in cases:
        row, state = run_case(name, shape, kw, gate, dev, args.repeats)
        rows.append(row)
        if first is None:
            first = state
        else:
            del state
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    cols = ["case", "kept", "dense fwd", "dense fwd+bwd", "sol fwd", "sol fwd+bwd", "speed-up fwd+bwd",
            "plan", "bwd kernels", "useful TFLOP/s fwd+bwd", "dense TFLOP/s fwd+bwd", "peak GiB", "grad err",
            "dense bf16 grad err"]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter smoke run)"
    lines = [f"# solattn fused backward, {where}, torch {torch.__version__}, "
             f"bf16 (times in ms, medians of {args.repeats})", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            x = r[c]
            cells.append(f"{x:.3f}" if c == "kept" else f"{x:.2f}" if isinstance(x, float) else str(x))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "sol fwd+bwd: `sol_attn(..., backend='triton')` forward (plan + kernel, LSE written) and the "
              "fused backward (plan rebuilt + kernels + block-level autograd); grad err: relative L2 against "
              "`backend='sdpa'` (its backward recomputes through sdpa); dense bf16 grad err: dense SDPA's bf16 "
              "gradients against fp32 SDPA's on the same inputs (the level a bf16 backward reaches)."]
    if not args.no_sweep and not args.smoke and first is not None:
        lines += ["", f"## Backward launch configs ({rows[0]['case']}, kernels only; first row: the default)", "",
                  "| dq warps | dq stages | dk/dv warps | dk/dv stages | ms | note |",
                  "|---|---|---|---|---|---|"]
        for c, ms, note in sweep(first, dev, args.repeats):
            lines.append(f"| {c.dq_warps} | {c.dq_stages} | {c.dkdv_warps} | {c.dkdv_stages} | "
                         f"{'' if ms is None else f'{ms:.2f}'} | {note} |")
    publish(lines, args.out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
