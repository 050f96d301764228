"""The routing plan on a GPU: the torch plan against the fused Triton plan, and ``sol_attn``
end to end with the ``triton`` backend against dense SDPA.

    python benchmarks/bench_plan.py --out DIR              # H200: seed shape and H3, ~2 min
    python benchmarks/bench_plan.py --out DIR --graphs     # also: plan + kernel replayed as a CUDA graph
    python benchmarks/bench_plan.py --dry-run --out DIR    # tiny shapes, CPU interpreter (checks the script)

Shapes: seed (B=2, T=4056, H=16, D=128) and H3 (B=1, T=37296, H=56, D=128), bf16; configs
top-k 10 % and 20 % (no tail), tau 1 with tail, each without and with a coarse gate. Inputs
are i.i.d. Gaussians (``--spread 0``, the recorded benchmark inputs) plus ``spread`` times a
Gaussian per 64-token block; on i.i.d. inputs the scores are close to each other and fp32
rounding in another summation order can flip near-ties, so the selection check reports the
fraction of (b, h, query block) rows whose selection differs instead of asserting equality.

Per row: median ms over ``--repeats`` CUDA-synchronised calls (``solattn.bench.timing``) of the
torch plan (``build_plan``), the fused plan (``fused_plan``), ``sol_attn(..., backend="triton")``
(fused plan inside), the triton kernel alone on a prebuilt plan, dense
``F.scaled_dot_product_attention``; rows with a differing selection; the largest differences of
the tail and coarse terms; and the relative L2 error of the triton output with each plan against
the ``sdpa`` backend's output (the torch plan). Writes bench_plan.md and bench_plan.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
from solattn.backends.triton import TritonBackend, launch  # noqa: E402
from solattn.bench.timing import log, synchronize, time_calls  # noqa: E402
from solattn.config import current_tuning, set_tuning  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.routing import fused  # noqa: E402
from solattn.routing.fused import fused_plan, fused_plan_usable  # noqa: E402
from solattn.testing import rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

SHAPES = {"seed": (2, 4056, 16, 128), "H3": (1, 37296, 56, 128)}
DRY_SHAPES = {"tiny": (1, 300, 2, 64), "tiny-b2": (2, 200, 2, 64)}
CONFIGS = [("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
           ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
           ("tau 1, tail", dict(tau=1.0, tail=True))]


def make_inputs(shape, dtype, device, seed, spread):
    """q, k, v, gate drawn on the device: i.i.d. N(0, 1) plus ``spread`` N(0, 1) per block."""
    B, T, H, D = shape
    g = torch.Generator(device=device).manual_seed(seed)
    n = -(-T // 64)
    out = []
    for _ in range(3):
        x = torch.randn(B, T, H, D, generator=g, device=device)
        if spread:
            x += spread * torch.randn(B, n, H, D, generator=g, device=device).repeat_interleave(64, dim=1)[:, :T]
        out.append(x.to(dtype))
    gate = torch.rand(B, T, H, D, generator=g, device=device).to(dtype)
    return (*out, gate)


def median_ms(fn, device, repeats, warmup=3):
    return statistics.median(time_calls(fn, device, repeats, warmup=warmup))


def compare_plans(a, b):
    """Selection and pooled-term differences between plans ``a`` (torch) and ``b`` (fused)."""
    rows = (a.dense_mask() != b.dense_mask()).any(dim=-1)
    res = {"rows_differ": float(rows.float().mean()),
           "count_differ": float((a.kv_num_blocks != b.kv_num_blocks).float().mean()),
           "touches_differ": float((a.touches_dead != b.touches_dead).float().mean()),
           "key_mean_maxabs": float((a.key_mean - b.key_mean).abs().max())}
    same = ~rows
    for name in ("tail_lse", "tail_value", "coarse"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            continue
        if name != "coarse":                          # tail terms depend on the selection
            x, y = x[same], y[same]
        if name == "tail_lse":
            fin = torch.isfinite(x) & torch.isfinite(y)
            res["tail_lse_inf_differ"] = int((torch.isfinite(x) != torch.isfinite(y)).sum())
            x, y = x[fin], y[fin]
        res[f"{name}_maxabs"] = float((x - y).abs().max()) if x.numel() else 0.0
    return res


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_shape(label, shape, args, device, results):
    dtype = torch.bfloat16
    q, k, v, gate = make_inputs(shape, dtype, device, args.seed, args.spread)
    dense = None
    if not args.dry_run:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        dense = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), device, args.repeats)
        log(f"{label}: dense {dense:.3f} ms")
    for cname, ckw in CONFIGS:
        for with_gate in (False, True):
            kw = dict(ckw, coarse_gate=gate if with_gate else None)
            name = f"{label} {cname}{' + coarse' if with_gate else ''}"
            row = {"shape": label, "B,T,H,D": shape, "config": cname, "coarse": with_gate}
            try:
                problem = validate(q, k, v, **kw)
                if not fused_plan_usable(problem):
                    raise RuntimeError("fused plan not usable for this problem")
                with torch.no_grad():
                    p_torch = build_plan(problem)
                    p_fused = fused_plan(problem)
                    row.update(compare_plans(p_torch, p_fused))
                    row["kept"] = p_torch.kept_fraction
                    row["torch_plan_ms"] = median_ms(lambda: build_plan(problem), device, args.repeats)
                    row["fused_plan_ms"] = median_ms(lambda: fused_plan(problem), device, args.repeats)
                    row["kernel_ms"] = median_ms(lambda: launch(problem, p_fused), device, args.repeats)
                    row["sol_attn_ms"] = median_ms(
                        lambda: solattn.sol_attn(q, k, v, backend="triton", **kw), device, args.repeats)
                    if args.graphs and device.type == "cuda":
                        try:
                            replay = graph_of(lambda: launch(problem, fused_plan(problem)))
                            row["graph_plan_kernel_ms"] = median_ms(replay, device, args.repeats)
                        except Exception as err:     # capture can fail (e.g. host-side descriptors)
                            row["graph_error"] = f"{type(err).__name__}: {err}"
                    ref = solattn.sol_attn(q, k, v, backend="sdpa", **kw).float()
                    out_fused = solattn.sol_attn(q, k, v, backend="triton", **kw).float()
                    out_torch = TritonBackend().forward(problem, p_torch).float()
                    row["err_fused_vs_sdpa"] = rel_l2(out_fused, ref)
                    row["err_torchplan_vs_sdpa"] = rel_l2(out_torch, ref)
                    del ref, out_fused, out_torch
                if dense is not None:
                    row["dense_ms"] = dense
                    row["speedup_vs_dense"] = dense / row["sol_attn_ms"]
                log(f"{name}: torch plan {row['torch_plan_ms']:.3f} ms, fused {row['fused_plan_ms']:.3f} ms, "
                    f"sol_attn {row['sol_attn_ms']:.3f} ms, rows differ {row['rows_differ']:.2e}")
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"
                log(f"{name}: FAILED {row['error']}")
                traceback.print_exc()
            results.append(row)
            synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(results, device_name):
    head = ("| shape | config | coarse | kept | torch plan ms | fused plan ms | plan speed-up | kernel ms "
            "| sol_attn ms | graph plan+kernel ms | dense ms | vs dense | rows differ | tail_value max abs "
            "| coarse max abs | err fused plan | err torch plan |")
    lines = [f"Routing plan, {device_name}, torch {torch.__version__}, fused dot precision "
             f"{current_tuning(fused.FusedPlanTuning).dot_precision or 'default (tf32x3 on compute capability 8.0+, else ieee)'}", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['config']} | {r['coarse']} | error: {r['error']} |")
            continue
        tp, fp = r.get("torch_plan_ms"), r.get("fused_plan_ms")
        lines.append("| " + " | ".join([
            r["shape"], r["config"], "yes" if r["coarse"] else "no", fmt(r.get("kept"), ".3f"),
            fmt(tp, ".3f"), fmt(fp, ".3f"), fmt(tp / fp if tp and fp else None, ".1f"),
            fmt(r.get("kernel_ms"), ".3f"), fmt(r.get("sol_attn_ms"), ".3f"),
            fmt(r.get("graph_plan_kernel_ms"), ".3f") if "graph_error" not in r else "capture failed",
            fmt(r.get("dense_ms"), ".3f"), fmt(r.get("speedup_vs_dense"), ".2f"),
            fmt(r.get("rows_differ"), ".2e"), fmt(r.get("tail_value_maxabs"), ".1e"),
            fmt(r.get("coarse_maxabs"), ".1e"), fmt(r.get("err_fused_vs_sdpa"), ".2e"),
            fmt(r.get("err_torchplan_vs_sdpa"), ".2e")]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for bench_plan.md / bench_plan.json")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spread", type=float, default=0.0,
                    help="per-block Gaussian offset added to the i.i.d. inputs (0: the recorded inputs)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--dot", choices=("ieee", "tf32x3"), default=None,
                    help="tl.dot precision of the fused plan's fp32 products (default: the shipped choice, "
                         "solattn.routing.fused.dot_precision)")
    ap.add_argument("--graphs", action="store_true", help="also time plan + kernel replayed as a CUDA graph")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    set_tuning(fused.FusedPlanTuning(dot_precision=args.dot))
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, shapes, args.repeats = torch.device("cpu"), DRY_SHAPES, min(args.repeats, 2)
        device_name = "CPU (Triton interpreter, dry run)"
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_plan.py needs a CUDA GPU (or --dry-run)")
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        shapes = SHAPES if args.shapes is None else {s: SHAPES[s] for s in args.shapes.split(",")}
    t0 = time.perf_counter()
    results = []
    for label, shape in shapes.items():
        run_shape(label, shape, args, device, results)
    md = markdown(results, device_name)
    print(md)
    with open(os.path.join(args.out, "bench_plan.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "bench_plan.json"), "w") as f:
        json.dump({"device": device_name, "args": vars(args), "results": results}, f, indent=1, default=str)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
