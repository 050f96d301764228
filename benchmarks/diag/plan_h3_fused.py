"""Where the fused routing plan's time goes at H3 (B=1, T=37296, H=56, D=128, bf16) on a GPU,
against the torch plan, and what the whole ``sol_attn`` call costs with either plan.

For each mode (top-k 10 %, top-k 20 %, tau 1 + tail) it prints: the torch plan's time, the fused
plan's time per ``tl.dot`` precision and its per-kernel GPU times, whether the fused selection
equals the torch plan's (rows whose block sets differ; 0 expected on these well separated
inputs), the tail terms' difference, and end-to-end ``sol_attn`` (triton backend) with the torch
plan forced (``fused_plan_usable`` patched to False) and with the fused plan, next to dense
SDPA and the kernel alone (``h3``; timed in rounds that run each once, in rotated order, with the
median and range of the per-round speed-up of the fused-plan call); the seed shape in ``cuda_graphs()`` with the host profile of
a graph hit (``seed``); the fused plan's launch parameters at both shapes (``sweep``).

    python benchmarks/diag/plan_h3_fused.py [h3] [seed] [sweep]      # default: h3 seed
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan, fused  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
MODES = (("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
         ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
         ("tau 1 + tail", dict(tau=1.0, tail=True)))


def med(fn, n=20, warm=3):
    return statistics.median(time_calls(fn, dev, n, warm))


def kernel_table(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.key[:60], e.count))
    return ", ".join(f"{name} {t / 1e3:.3f} ms x{c}" for t, name, c in sorted(rows, reverse=True)[:6])


def paired_rounds(fns, rounds=20, warm=2):
    """name -> list of ms: each round times every function once, in an order rotated each round,
    so slow drifts of the machine reach every contender alike (ratios are taken per round)."""
    names = list(fns)
    for name in names:
        time_calls(fns[name], dev, 0, warm)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name] += time_calls(fns[name], dev, 1)
    return times


def h3_cases(modes=MODES):
    """``(label, kwargs, problem, plan)`` for each routing mode at H3 (``make_qkv`` seed 0, bf16),
    the plan built by ``build_plan``; the caller's work for a mode runs under ``no_grad``."""
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    for label, kw in modes:
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            yield label, kw, problem, build_plan(problem)


def compare_kernels(title, fns, ref, base, flop, columns=(), rounds=10):
    """Kernel-only comparison on one plan, printed as a markdown table: each of ``fns`` (name ->
    launch) is run once for its error against ``ref`` (the fp32 definition) and its difference from
    ``fns[base]``'s output (a launch that raises is reported and dropped), then timed in paired
    rounds. ``columns`` adds ``(header, fn(name, ms) -> str)`` columns after TFLOP/s."""
    base_out = fns[base]().float()
    errs = {}
    for name in list(fns):
        try:
            out = fns[name]().float()
            if dev.type == "cuda":
                torch.cuda.synchronize()            # a launch's asynchronous error surfaces here
            errs[name] = (rel_l2(out, ref), rel_l2(out, base_out))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{title} {name}: failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            del fns[name]
    del base_out
    t = paired_rounds(fns, rounds=rounds, warm=2)
    base_t = statistics.median(t[base])
    heads = [h for h, _ in columns]
    print(f"\n## {title}: {flop / 1e12:.2f} TFLOP on listed blocks ({rounds} rounds, kernel only)")
    print("| kernel | ms | TFLOP/s | " + "".join(f"{h} | " for h in heads) + "speed-up | err vs fp32 | diff vs "
          f"{base} |")
    print("|---" * (6 + len(heads)) + "|")
    for name in fns:
        ms = statistics.median(t[name])
        extra = "".join(f"{fn(name, ms)} | " for _, fn in columns)
        print(f"| {name} | {ms:.3f} | {flop / ms / 1e9:.0f} | {extra}{base_t / ms:.3f} | {errs[name][0]:.3e} | "
              f"{errs[name][1]:.1e} |", flush=True)


def ratio_summary(num, den):
    """median and range of the per-round ratios num / den, e.g. '4.02x (3.97-4.06)'."""
    ratios = sorted(a / b for a, b in zip(num, den))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def differing_rows(a, b):
    return int((a.dense_mask() != b.dense_mask()).any(-1).sum())


def h3():
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dense = med(lambda: F.scaled_dot_product_attention(qt, kt, vt))
    print(f"H3 dense SDPA {dense:.2f} ms", flush=True)
    for label, kw in MODES:
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            ref_plan = build_plan(problem)
            t_torch = med(lambda: build_plan(problem), 10, 2)
            print(f"\n## H3 {label}: torch plan {t_torch:.3f} ms, kernels: {kernel_table(lambda: build_plan(problem))}",
                  flush=True)
            for prec in (None, "ieee"):
                fused.DOT_PRECISION = prec
                try:
                    fp = fused.fused_plan(problem)
                    diff = differing_rows(fp, ref_plan)
                    tail = ""
                    if problem.tail:
                        tail = (f", tail_value rel {rel_l2(fp.tail_value, ref_plan.tail_value):.1e}"
                                f" tail_lse max |d| {(fp.tail_lse - ref_plan.tail_lse).abs().nan_to_num(0).max():.1e}")
                    t = med(lambda: fused.fused_plan(problem), 10, 2)
                    print(f"fused plan [{fused.dot_precision(dev)}]: {t:.3f} ms, rows differing from torch plan "
                          f"{diff}{tail}; kernels: {kernel_table(lambda: fused.fused_plan(problem))}", flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"fused plan [{prec}]: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            fused.DOT_PRECISION = None
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)

            def call():
                return solattn.sol_attn(q, k, v, backend="triton", **kw)

            def call_torch_plan():
                usable = fused.fused_plan_usable
                fused.fused_plan_usable = lambda problem: False
                try:
                    return call()
                finally:
                    fused.fused_plan_usable = usable
            e_fused, e_torch = rel_l2(call().float(), ref), rel_l2(call_torch_plan().float(), ref)
            del ref
            t = paired_rounds({"dense": lambda: F.scaled_dot_product_attention(qt, kt, vt),
                               "kernel": lambda: tb.launch(problem, ref_plan),
                               "fused": call, "torch": call_torch_plan})
        t_dense, t_kernel, t_e2e_fused, t_e2e_torch = (statistics.median(t[x]) for x in ("dense", "kernel", "fused", "torch"))
        print(f"dense {t_dense:.2f} ms; kernel alone {t_kernel:.2f} ms ({t_dense / t_kernel:.2f}x dense); e2e torch plan "
              f"{t_e2e_torch:.2f} ms ({t_dense / t_e2e_torch:.2f}x, err {e_torch:.2e}); e2e fused plan {t_e2e_fused:.2f} ms "
              f"({t_dense / t_e2e_fused:.2f}x, err {e_fused:.2e}); per-round ratio e2e fused: "
              f"{ratio_summary(t['dense'], t['fused'])} over {len(t['dense'])} rounds", flush=True)


SWEEP = ({}, dict(select_warps=4), dict(select_warps=2), dict(select_warps=1),
         dict(block_i=16, select_warps=4), dict(block_i=16, select_warps=2), dict(block_i=16, select_warps=1),
         dict(block_i=32, select_warps=2), dict(block_i=64, select_warps=4), dict(bj=64, select_warps=4),
         dict(bj=64, block_i=16, select_warps=2), dict(rb=16, block_i=16, select_warps=2),
         dict(block_i=16, select_warps=4, select_stages=1), dict(means_warps=2), dict(means_warps=1))


def sweep():
    """Fused-plan launch parameters at H3 and the seed shape (plan alone, median ms)."""
    for shape in ((1, 37296, 56, 128), (2, 4056, 16, 128)):
        q, k, v = make_qkv(*shape, dtype=torch.bfloat16, device=dev, seed=0)
        for label, kw in (MODES[0], MODES[2]):
            problem = validate(q, k, v, **kw)
            with torch.no_grad(), torch.cuda.device(dev):
                ref_plan = build_plan(problem)
                print(f"\n## sweep {shape} {label}", flush=True)
                for tuning in SWEEP:
                    try:
                        same = differing_rows(fused._fused_plan(problem, tuning), ref_plan)
                        t = med(lambda: fused._fused_plan(problem, tuning), 20, 3)
                        kt = kernel_table(lambda: fused._fused_plan(problem, tuning))
                        print(f"  {tuning}: {t:.3f} ms, rows differing {same}; {kt}", flush=True)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"  {tuning}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def host_profile(call, calls=300, top=14) -> str:
    """cProfile of ``calls`` back-to-back calls (synchronised before and after), ``top`` rows by own time."""
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(calls):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def seed_host():
    """The seed shape in ``cuda_graphs()``: dense SDPA against graphs captured with pointer loads
    and with TMA loads (``TMA_IN_GRAPHS``, the default), in the same rounds; the host profile of
    graph hits."""
    from solattn.graphs import GraphCache
    q, k, v = make_qkv(2, 4056, 16, 128, dtype=torch.bfloat16, device=dev, seed=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    def dense_fn():
        return F.scaled_dot_product_attention(qt, kt, vt)
    print(f"seed dense SDPA {med(dense_fn, 200, 10):.3f} ms")
    for label, kw in (MODES[0], MODES[2]):
        def call():
            return solattn.sol_attn(q, k, v, backend="triton", **kw)
        caches = {"pointer": GraphCache(), "TMA": GraphCache()}

        def in_graph(loads):
            def run():
                tb.TMA_IN_GRAPHS = loads == "TMA"          # read at capture only
                with solattn.cuda_graphs(cache=caches[loads]):
                    return call()
            return run
        with torch.no_grad():
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
            errs = {loads: rel_l2(in_graph(loads)().float(), ref) for loads in caches}
            del ref
            t = paired_rounds({"dense": dense_fn, "pointer": in_graph("pointer"), "TMA": in_graph("TMA")},
                              rounds=200, warm=10)
            prof = host_profile(in_graph("TMA"))
        tb.TMA_IN_GRAPHS = True
        stats = ", ".join(f"{name}: {c.stats.captures} capture(s) {c.stats.replays} replays" for name, c in caches.items())
        for loads in caches:
            print(f"## seed {label} cuda_graphs {loads} loads e2e {statistics.median(t[loads]):.3f} ms against "
                  f"dense {statistics.median(t['dense']):.3f} ms, per-round ratio {ratio_summary(t['dense'], t[loads])}, "
                  f"err {errs[loads]:.2e}", flush=True)
        print(f"({stats}); host profile of 300 hits (TMA):\n{prof}", flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    what = sys.argv[1:] or ["h3", "seed"]
    if "sweep" in what:
        sweep()
    if "seed" in what:
        seed_host()
    if "h3" in what:
        h3()
