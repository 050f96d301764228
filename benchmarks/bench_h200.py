"""One-call H200 benchmark of the ``triton`` backend.

    python benchmarks/bench_h200.py --out DIR [--budget-s 330] [--sweep] [--variants]
                                    [--config WARPS,STAGES,TMA] [--skip main,tsweep]
    python benchmarks/bench_h200.py --quick --out DIR    # correctness + H3/seed at 10/20 %, no tail
    python benchmarks/bench_h200.py --dry-run --out DIR  # tiny shapes, CPU interpreter

Sections, in priority order (each is skipped once the time budget is spent):

1. correctness on CUDA: triton vs the reference at small shapes, every feature, bf16/fp16,
   D 64/128, with a NaN-poisoned output (every element must be written);
2. optional config sweep (warps, stages, TMA or pointer loads) at H3, topk 10%/20%, no tail,
   and with ``--variants`` the diagnostic kernels of ``kernel_variants.py`` (math only,
   loads only);
3. the main table at the H3 shape (B=1, T=37296, H=56, D=128) and the seed shape
   (B=2, T=4056, H=16, D=128), bf16, topk 10% and 20%, tail off/on, coarse gate off/on:
   dense ``F.scaled_dot_product_attention``, the ``sdpa`` backend, the ``triton``
   backend (kernel only, plan built beforehand, and end to end through ``sol_attn``),
   FlexAttention with a ``BlockMask`` made from the same plan (no-tail rows: it has no
   tail or coarse branch, and without them the centring cancels, so it computes the
   same function);
4. a sweep over T (B=1, H=24, D=128, topk 10%, no tail).

Inputs: ``solattn.bench.make_inputs`` with ``--spread`` (default 0: i.i.d. Gaussians, the
inputs of the recorded runs; correctness cases use 2, block-structured, so that the selection
is unambiguous). Each row: median ms (``triton.testing.do_bench``, return_mode="median", as in
the recorded runs; it flushes L2 between calls, which ``solattn.bench.time_calls`` does not), speed-up over
dense in the same run, TFLOP/s counted on kept blocks, peak extra memory, relative L2
error. FLOPs: sparse paths ``4 * kept_pairs * 64 * 64 * D`` where ``kept_pairs`` is the
sum of ``plan.kv_num_blocks`` over (b, h, query block) (two matmuls, 2 FLOPs per MAC;
ragged last blocks counted as full); dense ``4 * B * H * T * T * D``.
Error: against the reference (fp32, the definition) on the full problem where it fits,
else on a one-head slice (every statistic and the selection are per (b, h), so head 0
of the full call must equal the reference of head 0 alone).

Outputs under --out: bench_h200.csv, bench_h200.md, bench_h200.png, bench_h200.log.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
from solattn import BLOCK  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.validation import validate  # noqa: E402
from solattn.backends import reference  # noqa: E402
from solattn.backends.reference import reference_forward  # noqa: E402
from solattn.backends.triton import DEFAULT_CONFIGS, KernelConfig, launch  # noqa: E402
from solattn.bench import flop_count, log, make_inputs, measure_peak, rel_l2, synchronize, time_calls  # noqa: E402

from kernel_variants import VARIANTS, run_variant  # noqa: E402

T0 = time.time()
LOG = []


def say(*a):
    line = " ".join(str(x) for x in a)
    log(line)
    LOG.append(line)


def elapsed():
    return time.time() - T0


def sync():
    synchronize(torch.device(DEV))


def bench(fn, warmup=25, rep=100):
    if DEV != "cuda":  # --dry-run on the CPU (interpreter): one timed call
        return time_calls(fn, torch.device(DEV), 1)[0]
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_extra_mib(fn):
    """Peak device memory allocated during one call, above what was allocated before it (MiB)."""
    if DEV != "cuda":
        return float("nan")
    out, mib, _ = measure_peak(fn, torch.device(DEV))
    del out
    return mib


def make_qkv(B, T, H, D, dtype, seed, spread=None):
    spread = ARGS.spread if spread is None else spread
    return list(make_inputs((B, T, H, D), dtype, torch.device(DEV), seed=seed, spread=spread))


# ----------------------------------------------------------------------------- 1. correctness

def correctness(configs):
    say("\n## 1. correctness on CUDA (triton vs reference, NaN-poisoned output)")
    rows = []
    dev = DEV
    cases = []
    for D in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            cases.append((f"topk D{D} {str(dtype)[6:]}", dict(B=2, T=1000, H=2, D=D, dtype=dtype), dict(topk_ratio=0.2, tail=False)))
            cases.append((f"topk+tail D{D} {str(dtype)[6:]}", dict(B=1, T=777, H=3, D=D, dtype=dtype), dict(topk_ratio=0.1, tail=True)))
    D = 128
    bf = torch.bfloat16
    cases += [
        ("tau+tail", dict(B=1, T=1100, H=2, D=D, dtype=bf), dict(tau=0.5, tail=True)),
        ("tau", dict(B=1, T=1100, H=2, D=D, dtype=bf), dict(tau=1.0, tail=False)),
        ("T=1", dict(B=1, T=1, H=2, D=D, dtype=bf), dict(topk_ratio=0.2, tail=True)),
        ("T=65", dict(B=1, T=65, H=2, D=D, dtype=bf), dict(topk_ratio=0.2, tail=True)),
        ("key_bias+tail", dict(B=2, T=900, H=2, D=D, dtype=bf), dict(topk_ratio=0.2, tail=True, key_bias="rand")),
        ("all masked, no tail", dict(B=1, T=300, H=2, D=D, dtype=bf), dict(topk_ratio=0.3, tail=False, key_bias="none")),
        ("block_len+coarse", dict(B=1, T=1000, H=2, D=D, dtype=bf), dict(topk_ratio=0.2, tail=True, block_len=True, coarse_gate=True)),
        ("sinks+sink_q+coarse", dict(B=2, T=1000, H=2, D=D, dtype=bf), dict(topk_ratio=0.1, tail=True, sink_blocks=(0, 2), sink_q=(3, 4), coarse_gate=True)),
        ("strided", dict(B=2, T=700, H=2, D=D, dtype=bf, strided=True), dict(topk_ratio=0.2, tail=True, coarse_gate=True)),
    ]
    for name, shp, kw in cases:
        B, T, H, D, dtype = shp["B"], shp["T"], shp["H"], shp["D"], shp["dtype"]
        if DEV != "cuda":  # dry run: tiny
            T, H = min(T, 200), 1
        q, k, v = make_qkv(B, T, H, D, dtype, seed=len(rows) + 1, spread=2.0)
        if shp.get("strided"):
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
            k = torch.cat([k, k], dim=-1)[..., ::2]
        kw = dict(kw)
        n = (T + BLOCK - 1) // BLOCK
        if kw.get("key_bias") == "rand":
            kw["key_bias"] = torch.randn(B, T, device=dev)
            kw["key_bias"][:, 100:180] = -math.inf
        elif kw.get("key_bias") == "none":
            kw["key_bias"] = torch.zeros(T, dtype=torch.bool, device=dev)
        if kw.get("block_len"):
            kw["block_len"] = torch.randint(1, 65, (n,), device=dev, dtype=torch.int32)
        if kw.get("coarse_gate"):
            kw["coarse_gate"] = torch.randn(B, T, H, D, device=dev, dtype=dtype)
        problem = validate(q, k, v, **kw)
        plan = build_plan(problem)
        ref = reference_forward(problem)
        for cfg in configs:
            out = torch.full((B, T, H, D), float("nan"), device=dev, dtype=dtype)
            launch(problem, plan, config=cfg, out=out)
            sync()
            finite = bool(torch.isfinite(out).all())
            err = rel_l2(out, ref)
            ok = finite and err < 1.5e-2
            rows.append(dict(case=name, config=cfg_name(cfg), rel_l2=err, all_written=finite, ok=ok))
            say(f"  {'ok ' if ok else 'BAD'} {name:28s} {cfg_name(cfg):10s} rel_l2={err:.2e} written={finite}")
    bad = [r for r in rows if not r["ok"]]
    say(f"  correctness: {len(rows) - len(bad)}/{len(rows)} ok")
    return rows


def cfg_name(cfg, variant=""):
    return f"w{cfg.num_warps}/s{cfg.num_stages}/{'tma' if cfg.tma else 'ptr'}" + (f"/{variant}" if variant else "")


# ----------------------------------------------------------------------------- helpers for rows

def kept_flops(plan, D):
    kept = int(plan.kv_num_blocks.long().sum().item())
    return flop_count((0, 0, 0, D), kept), kept


def ref_output(problem, heads=None):
    """The reference output of the whole call, or of its first ``heads`` heads alone."""
    if heads is None:
        return reference_forward(problem)
    sl = lambda t: t[:, :, :heads] if t is not None else None  # noqa: E731
    sub = validate(sl(problem.q), sl(problem.k), sl(problem.v), tau=problem.tau, scale=problem.scale,
                   sink_blocks=problem.sink_blocks, sink_q=problem.sink_q, key_bias=problem.key_bias,
                   topk_ratio=problem.topk_ratio, tail=problem.tail, block_len=problem.block_len,
                   coarse_gate=sl(problem.coarse_gate))
    return reference_forward(sub)


def flex_runner(problem, plan):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    idx = torch.zeros(B, H, n, n, dtype=torch.int32, device=plan.kv_indices.device)
    idx[..., :plan.kv_indices.shape[-1]] = plan.kv_indices
    exact = plan.dense_mask()

    def selected(b, h, q_idx, kv_idx):  # only evaluated by eager flex; the compiled kernel walks the indices
        return exact[b, h, q_idx // BLOCK, kv_idx // BLOCK]

    # every kept block is passed as a "full" block: the compiled kernel then skips mask_mod
    # (its fastest path); keys past T are still cut by its sequence-length bound
    bm = BlockMask.from_kv_blocks(torch.zeros_like(plan.kv_num_blocks), idx.contiguous(),
                                  plan.kv_num_blocks.contiguous(), idx.contiguous(), BLOCK_SIZE=BLOCK,
                                  mask_mod=selected, seq_lengths=(T, T))
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False) if DEV == "cuda" else flex_attention
    qh, kh, vh = (t.transpose(1, 2) for t in (problem.q, problem.k, problem.v))
    opts = {"BLOCK_M": BLOCK, "BLOCK_N": BLOCK}
    return lambda: _FLEX(qh, kh, vh, block_mask=bm, scale=problem.scale, kernel_options=opts)


_FLEX = None


# ----------------------------------------------------------------------------- 2. sweep

#: every shipping knob: warps x stages x (TMA, pointer loads)
SWEEP = [KernelConfig(1, w, st, tma=t) for t in (True, False) for w in (4, 8) for st in (2, 3, 4)]


def sweep(shape, ratios=(0.1, 0.2), configs=None, variants=()):
    """Time ``configs`` (production kernel) and the diagnostic ``variants`` (with the first config)."""
    configs = configs or SWEEP
    B, T, H, D = shape
    say(f"\n## 2. config sweep, B={B} T={T} H={H} D={D} bf16, topk, no tail")
    q, k, v = make_qkv(B, T, H, D, torch.bfloat16, seed=7)
    runs = [(cfg, "") for cfg in configs] + [(configs[0], name) for name in variants]
    rows = []
    for r in ratios:
        problem = validate(q, k, v, topk_ratio=r, tail=False)
        plan = build_plan(problem)
        flops, _ = kept_flops(plan, D)
        for cfg, variant in runs:
            if elapsed() > ARGS.budget_s * 0.45:
                say("  (sweep cut short by the time budget)")
                break
            name = cfg_name(cfg, variant)
            fn = ((lambda: run_variant(variant, problem, plan, cfg)) if variant
                  else (lambda: launch(problem, plan, config=cfg)))
            try:
                ms = bench(fn)
            except Exception as e:  # out of shared memory etc.
                say(f"  {name:12s} topk {r}: failed: {str(e).splitlines()[0][:120]}")
                continue
            rows.append(dict(ratio=r, config=name, ms=ms, tflops=flops / ms / 1e9))
            say(f"  topk {r:.0%} {name:22s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    best = {}
    for r in rows:
        if r["config"].count("/") > 2:    # a diagnostic variant: not a candidate
            continue
        if r["ratio"] not in best or r["ms"] < best[r["ratio"]]["ms"]:
            best[r["ratio"]] = r
    return rows, best


# ----------------------------------------------------------------------------- 3. main table

def main_table(shapes, cfg):
    say("\n## 3. main table")
    rows = []
    for label, (B, T, H, D) in shapes:
        if elapsed() > ARGS.budget_s:
            say(f"  (skipping {label}: time budget spent)")
            continue
        q, k, v = make_qkv(B, T, H, D, torch.bfloat16, seed=11)
        gate = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16)
        dense_flops = 4.0 * B * H * T * T * D
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        dense = lambda: F.scaled_dot_product_attention(qh, kh, vh)  # noqa: E731
        dense_ms = bench(dense, rep=200)
        dense_mem = peak_extra_mib(dense)
        rows.append(dict(shape=label, ratio="", tail="", gate="", path="dense sdpa", ms=dense_ms, speedup=1.0,
                         tflops=dense_flops / dense_ms / 1e9, kept=1.0, mem_mib=dense_mem, rel_l2=""))
        say(f"  {label} dense sdpa {dense_ms:.3f} ms ({dense_flops / dense_ms / 1e9:.0f} TFLOP/s)")
        heads = None if reference.estimated_bytes(B, H, T) < 24 << 30 else 1
        solattn.set_memory_budget(48 << 30, backend="reference")
        for r in (0.1, 0.2):
            combos = ((False, False),) if ARGS.quick else ((False, False), (True, False), (False, True), (True, True))
            for tail, use_gate in combos:
                if elapsed() > ARGS.budget_s:
                    break
                cg = gate if use_gate else None
                problem = validate(q, k, v, topk_ratio=r, tail=tail, coarse_gate=cg)
                sync()
                t_plan = time.time()
                plan = build_plan(problem)
                sync()
                plan_ms = (time.time() - t_plan) * 1e3
                flops, kept = kept_flops(plan, D)
                frac = plan.kept_fraction
                base = dict(shape=label, ratio=r, tail=tail, gate=use_gate, kept=round(frac, 4))
                paths = [("triton", lambda: launch(problem, plan, config=cfg))]
                paths.append(("triton e2e (sol_attn)", lambda: solattn.sol_attn(
                    q, k, v, topk_ratio=r, tail=tail, coarse_gate=cg, backend="triton")))
                if "sdpa" in solattn.dispatch.registered() and not use_gate and not ARGS.quick:
                    sd = solattn.dispatch.get_backend("sdpa")
                    paths.append(("sdpa backend", lambda: sd.forward(problem, plan)))
                if not tail and not use_gate and not ARGS.quick:
                    try:
                        paths.append(("flex BlockMask", flex_runner(problem, plan)))
                    except Exception as e:
                        say(f"  flex unavailable: {e}")
                ref = None
                for name, fn in paths:
                    try:
                        out = fn()
                        sync()
                        if ref is None:
                            ref = ref_output(problem, heads)
                        out = out.transpose(1, 2) if name.startswith("flex") else out
                        err = rel_l2(out[:, :, :ref.shape[2]], ref)
                        del out
                        ms = bench(fn, rep=150 if B * H * T > 1e6 else 100)
                        mem = peak_extra_mib(fn)
                    except Exception as e:
                        say(f"  {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                        continue
                    row = dict(base, path=name, ms=ms, speedup=dense_ms / ms, tflops=flops / ms / 1e9,
                               mem_mib=mem, rel_l2=err)
                    if name == "triton":
                        row["plan_ms"] = plan_ms
                    rows.append(row)
                    say(f"  {label} topk {r:.0%} tail={int(tail)} gate={int(use_gate)} {name:22s} {ms:8.3f} ms "
                        f"x{dense_ms / ms:5.2f} {flops / ms / 1e9:6.1f} TF/s mem {mem:8.1f} MiB err {err:.2e}"
                        + (f" (plan {plan_ms:.1f} ms, kept {frac:.3f})" if name == "triton" else ""))
                del plan, problem, ref
        del q, k, v, gate
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- 4. T sweep

def t_sweep(cfg, Ts=(2048, 4096, 8192, 16384, 32768, 65536)):
    say("\n## 4. sweep over T (B=1, H=24, D=128, bf16, topk 10%, no tail)")
    rows = []
    H, D = 24, 128
    for T in Ts:
        if elapsed() > ARGS.budget_s:
            say("  (T sweep cut short by the time budget)")
            break
        q, k, v = make_qkv(1, T, H, D, torch.bfloat16, seed=T)
        problem = validate(q, k, v, topk_ratio=0.1, tail=False)
        plan = build_plan(problem)
        flops, _ = kept_flops(plan, D)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        dense_ms = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh))
        tri_ms = bench(lambda: launch(problem, plan, config=cfg))
        row = dict(T=T, dense_ms=dense_ms, triton_ms=tri_ms, speedup=dense_ms / tri_ms,
                   triton_tflops=flops / tri_ms / 1e9, kept=round(plan.kept_fraction, 4))
        if ARGS.flex_sweep:
            try:
                row["flex_ms"] = bench(flex_runner(problem, plan))
            except Exception as e:
                say(f"  flex failed at T={T}: {e}")
        rows.append(row)
        say(f"  T={T:6d} kept {plan.kept_fraction:.3f} dense {dense_ms:8.3f} ms  triton {tri_ms:8.3f} ms "
            f"x{dense_ms / tri_ms:5.2f} {flops / tri_ms / 1e9:6.1f} TF/s"
            + (f"  flex {row['flex_ms']:.3f} ms" if "flex_ms" in row else ""))
        del q, k, v, problem, plan
    return rows


# ----------------------------------------------------------------------------- output

def write_outputs(out_dir, corr, sweep_rows, main_rows, t_rows, cfg):
    os.makedirs(out_dir, exist_ok=True)
    keys = ["shape", "ratio", "tail", "gate", "path", "ms", "speedup", "tflops", "kept", "mem_mib", "rel_l2",
            "plan_ms"]
    with open(os.path.join(out_dir, "bench_h200.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["section"] + keys + ["T", "dense_ms", "triton_ms", "flex_ms",
                                                               "triton_tflops", "config", "case", "all_written",
                                                               "ok"], extrasaction="ignore")
        w.writeheader()
        for r in corr:
            w.writerow(dict(r, section="correctness"))
        for r in sweep_rows:
            w.writerow(dict(r, section="sweep"))
        for r in main_rows:
            w.writerow(dict(r, section="main"))
        for r in t_rows:
            w.writerow(dict(r, section="T sweep"))

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)

    md = [f"# triton backend on {device_name()} (torch {torch.__version__}, "
          f"triton {__import__('triton').__version__})", "",
          f"Kernel config: {cfg_name(cfg)}. Times: median of do_bench. TFLOP/s on kept blocks "
          "(4 x kept_pairs x 64 x 64 x D; dense: 4 B H T^2 D). mem: peak allocation above what was "
          "allocated before the call (includes the output). rel_l2 vs the fp32 reference "
          "(whole call, or head 0 where the reference would not fit).", "",
          "| shape | topk | tail | gate | path | ms | x dense | TFLOP/s | kept | mem MiB | rel L2 |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in main_rows:
        md.append("| " + " | ".join([r["shape"], fmt(r["ratio"], ".0%"), str(r["tail"]), str(r["gate"]), r["path"],
                                     fmt(r["ms"], ".3f"), fmt(r["speedup"], ".2f"), fmt(r["tflops"], ".0f"),
                                     fmt(r["kept"], ".3f"), fmt(r["mem_mib"], ".0f"), fmt(r["rel_l2"], ".1e")]) + " |")
    if t_rows:
        md += ["", "## T sweep (B=1, H=24, D=128, topk 10%, no tail)", "",
               "| T | kept | dense ms | triton ms | x dense | triton TFLOP/s | flex ms |", "|---|---|---|---|---|---|---|"]
        for r in t_rows:
            md.append(f"| {r['T']} | {r['kept']:.3f} | {r['dense_ms']:.3f} | {r['triton_ms']:.3f} | "
                      f"{r['speedup']:.2f} | {r['triton_tflops']:.0f} | {fmt(r.get('flex_ms', ''), '.3f')} |")
    if sweep_rows:
        md += ["", "## config sweep (H3, no tail)", "", "| topk | config | ms | TFLOP/s |", "|---|---|---|---|"]
        for r in sweep_rows:
            md.append(f"| {r['ratio']:.0%} | {r['config']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
    n_ok = sum(r["ok"] for r in corr)
    md += ["", f"Correctness on CUDA: {n_ok}/{len(corr)} cases ok (rel L2 < 1.5e-2, every element written)."]
    if corr:
        md.append("worst rel L2: " + f"{max(r['rel_l2'] for r in corr):.2e}")
    with open(os.path.join(out_dir, "bench_h200.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        ax = axes[0]
        sel = [r for r in main_rows if r["tail"] in ("", False) and r["gate"] in ("", False)]
        labels = [f"{r['shape']}\n{fmt(r['ratio'], '.0%')}\n{r['path']}" for r in sel]
        ax.barh(range(len(sel)), [r["speedup"] for r in sel], color=[
            {"dense sdpa": "grey", "triton": "tab:red", "flex BlockMask": "tab:blue", "sdpa backend": "tab:green"}
            .get(r["path"], "tab:orange") for r in sel])
        ax.set_yticks(range(len(sel)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.axvline(1.0, color="k", lw=0.5)
        ax.set_xlabel("speed-up over dense SDPA (no tail, no gate)")
        ax = axes[1]
        if t_rows:
            ax.plot([r["T"] for r in t_rows], [r["speedup"] for r in t_rows], "o-", color="tab:red", label="triton")
            if any("flex_ms" in r for r in t_rows):
                ax.plot([r["T"] for r in t_rows if "flex_ms" in r],
                        [r["dense_ms"] / r["flex_ms"] for r in t_rows if "flex_ms" in r], "s-", label="flex")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("T (B=1, H=24, D=128, topk 10%)")
            ax.set_ylabel("speed-up over dense")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "bench_h200.png"), dpi=110)
    except Exception as e:
        say(f"plot failed: {e}")
    with open(os.path.join(out_dir, "bench_h200.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")


def device_name():
    return torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter dry run)"


def parse_config(text):
    """``WARPS,STAGES,TMA`` (e.g. ``4,3,1``) -> KernelConfig; KernelConfig checks the values."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise SystemExit(f"--config received {text!r}; allowed: WARPS,STAGES,TMA as three integers, e.g. 4,3,1")
    w, st, t = (int(p) for p in parts)
    try:
        return KernelConfig(1, w, st, tma=t)
    except ValueError as e:
        raise SystemExit(f"--config {text}: {e}")


def main():
    global ARGS, DEV
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument("--sweep", action="store_true", help="time every shipping config at H3 first")
    p.add_argument("--variants", action="store_true",
                   help="time the diagnostic kernels of kernel_variants.py (math only, loads only) at H3")
    p.add_argument("--no-correctness", action="store_true")
    p.add_argument("--flex-sweep", action="store_true")
    p.add_argument("--config", default="", help="WARPS,STAGES,TMA (default: DEFAULT_CONFIGS[128])")
    p.add_argument("--skip", default="", help="comma list of sections to skip: main,tsweep")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: correctness, then H3 and seed at 10/20 %% without tail or gate, "
                        "kernel vs dense SDPA only; no T sweep")
    p.add_argument("--spread", type=float, default=0.0,
                   help="block spread of the timing inputs (solattn.bench.make_inputs); 0 = i.i.d. Gaussians")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ARGS = p.parse_args()
    if ARGS.dry_run:
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    say(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {device_name()}, "
        f"backends {solattn.dispatch.registered()}")
    cfg = parse_config(ARGS.config) if ARGS.config else DEFAULT_CONFIGS[128]
    corr, sweep_rows, main_rows, t_rows = [], [], [], []
    try:
        if ARGS.sweep or ARGS.variants:
            configs = SWEEP if ARGS.sweep else [cfg]
            variants = tuple(VARIANTS) if ARGS.variants else ()
            sweep_rows, best = sweep((1, 600, 2, 64) if ARGS.dry_run else (1, 37296, 56, 128),
                                     configs=configs, variants=variants)
            if ARGS.sweep and 0.1 in best and not ARGS.config:
                name = best[0.1]["config"]
                cfg = next(c for c in configs if cfg_name(c) == name)
                say(f"  best at 10%: {name}")
        if not ARGS.no_correctness:
            from dataclasses import replace
            corr = correctness([cfg, replace(cfg, tma=not cfg.tma)])
        say(f"[{elapsed():.0f} s]")
        if "main" not in ARGS.skip:
            shapes = [("H3", (1, 37296, 56, 128)), ("seed", (2, 4056, 16, 128))]
            if ARGS.dry_run:
                shapes = [("H3", (1, 700, 2, 64)), ("seed", (2, 300, 1, 64))]
            main_rows = main_table(shapes, cfg)
        say(f"[{elapsed():.0f} s]")
        if "tsweep" not in ARGS.skip and not ARGS.quick:
            t_rows = t_sweep(cfg, Ts=(256, 512) if ARGS.dry_run else (2048, 4096, 8192, 16384, 32768, 65536))
    except Exception:
        say(traceback.format_exc())
    finally:
        write_outputs(ARGS.out, corr, sweep_rows, main_rows, t_rows, cfg)
        say(f"done in {elapsed():.0f} s")


ARGS = None
DEV = "cuda"

if __name__ == "__main__":
    main()
