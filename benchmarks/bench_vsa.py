"""``video_sparse_attn`` against dense SDPA and FastVideo's VSA op, forward and forward + backward.

    python benchmarks/bench_vsa.py --out DIR                      # GPU: the cases below, ~3 min on an H200
    python benchmarks/bench_vsa.py --out DIR --device cpu --tiny  # small grids on the CPU (checks the script)

Cases (B=1, H=56, D=128, bf16; gate = the coarse branch's per-token gate, random in [0, 0.5)):

- ``16x48x48`` (T=36864, 576 cubes) at sparsity 0.9 and 0.8, and ``8x32x32`` (T=8192) at 0.9:
  full 4x4x4 cubes, gated coarse branch, the setting FastVideo's op is built for;
- ``H3``: a 432-token prefix segment before the 16x48x48 grid (T=37296), sparsity 0.9, prefix
  ``exempt``, without and with the gate (FastVideo's op has no prefix: solattn and dense only);
- with ``--backward``: forward + backward of the full-cube cases (gradients of q, k, v and the
  gate for a fixed random output gradient).

Contenders: dense ``F.scaled_dot_product_attention`` on ``(B, H, T, D)`` copies (the same problem
without sparsity); ``solattn`` (``video_sparse_attn`` on the ``(B, T, H, D)`` tokens, the tiling
included, backend chosen automatically); when ``fastvideo_kernel`` is importable on a CUDA GPU,
its ``video_sparse_attn`` on inputs tiled beforehand (its calling convention), once with its
default kernel (the sm_90 one on an H100/H200) and once with ``FASTVIDEO_VSA_TRITON=1``.
Times: ``solattn.bench.timing.paired_rounds`` (L2 flushed before each call, rotating order),
medians, speed-up = median of per-round ratios to dense. Error: relative L2 against
``video_sparse_attn`` on fp32 copies through the portable backend (the definition in fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
from solattn.bench.report import source_revision  # noqa: E402
from solattn.bench.timing import log, paired_rounds, ratio_summary  # noqa: E402
from solattn.routing import vsa_topk_from_sparsity  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402

H, D = 56, 128
#: (label, grid, prefix tokens, sparsity, gate)
CASES = [("16x48x48, sparsity 0.9", (16, 48, 48), 0, 0.9, True),
         ("16x48x48, sparsity 0.8", (16, 48, 48), 0, 0.8, True),
         ("8x32x32, sparsity 0.9", (8, 32, 32), 0, 0.9, True),
         ("H3: 432 prefix + 16x48x48, sparsity 0.9", (16, 48, 48), 432, 0.9, False),
         ("H3, gate", (16, 48, 48), 432, 0.9, True)]
TINY = [("4x8x8, sparsity 0.75", (4, 8, 8), 0, 0.75, True),
        ("prefix 70 + 4x8x8, sparsity 0.75", (4, 8, 8), 70, 0.75, True)]


def fastvideo_calls(device, grid, sparsity, prefix):
    """``({name: fn(q, k, v, gate)}, why_not)`` for FastVideo's op on this case."""
    if device.type != "cuda":
        return {}, "FastVideo's op runs on CUDA only"
    if prefix:
        return {}, "FastVideo's op has no prefix segments"
    if importlib.util.find_spec("fastvideo_kernel") is None:
        return {}, "fastvideo_kernel not importable"
    import fastvideo_kernel as fv

    def tiled(x):
        t, block_len = solattn.tile(x, grid)
        return t.transpose(1, 2).contiguous(), block_len

    def call(triton):
        def fn(q, k, v, gate):
            (tq, bl), (tk, _), (tv, _) = tiled(q), tiled(k), tiled(v)
            tg = tiled(gate)[0] if gate is not None else None
            topk = vsa_topk_from_sparsity(sparsity, bl.numel())
            with _env("FASTVIDEO_VSA_TRITON", "1" if triton else None):
                return fv.video_sparse_attn(tq, tk, tv, bl, bl, topk, (4, 4, 4), tg)
        return fn

    return {f"FastVideo {fv.__version__}": call(False), f"FastVideo {fv.__version__}, Triton": call(True)}, ""


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def run_case(device, label, grid, prefix, sparsity, with_gate, rounds, backward, heads, head_dim):
    T = prefix + grid[0] * grid[1] * grid[2]
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    q, k, v = make_qkv(1, T, heads, head_dim, dtype=dtype, device=device, seed=0)
    gate = None
    if with_gate:
        gate = (torch.rand(q.shape, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype).to(device)
    kw = dict(sparsity=sparsity, gate=gate, prefix_len=prefix)
    peers, why_not = fastvideo_calls(device, grid, sparsity, prefix)
    fns = {"dense": lambda q, k, v, g: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                         v.transpose(1, 2)),
           "solattn": lambda q, k, v, g: solattn.video_sparse_attn(q, k, v, grid, **dict(kw, gate=g)),
           **peers}
    ref = solattn.video_sparse_attn(q.float(), k.float(), v.float(), grid, backend="sdpa",
                                    **dict(kw, gate=None if gate is None else gate.float()))
    errs = {}
    for name, fn in list(fns.items()):
        if name == "dense":
            continue
        try:
            out = fn(q, k, v, gate)
            if name.startswith("FastVideo"):
                out = solattn.untile(out.transpose(1, 2), grid)
            errs[name] = rel_l2(out, ref)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            why_not = f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}"
            del fns[name]
    del ref
    rows = []
    with torch.no_grad():
        times = paired_rounds({n: (lambda f=f: f(q, k, v, gate)) for n, f in fns.items()}, device, rounds)
    rows.append(("forward", times, errs))
    if backward:
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        g_leaf = gate.detach().requires_grad_(True) if gate is not None else None
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)

        def train(fn, name):
            def step():
                out = fn(*leaves, g_leaf)
                if name == "dense":
                    out = out.transpose(1, 2)
                elif name.startswith("FastVideo"):
                    out = solattn.untile(out.transpose(1, 2), grid)
                out.backward(dout)
            return step

        times = paired_rounds({n: train(f, n) for n, f in fns.items()}, device, rounds)
        rows.append(("forward + backward", times, {}))
    return T, rows, why_not


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_vsa.md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backward", action="store_true", help="also forward + backward")
    ap.add_argument("--tiny", action="store_true", help="small grids, H=2, D=32 (fp32 on the CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cases = TINY if args.tiny else CASES
    heads, head_dim = (2, 32) if args.tiny else (H, D)
    lines = [f"# video_sparse_attn against dense SDPA and FastVideo's VSA op ({device.type})", ""]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    lines += [f"solattn {source_revision()}, torch {torch.__version__}, {name}"]
    lines += ["", f"B=1, H={heads}, D={head_dim}; {args.rounds} paired rounds, medians; "
              "speed-up: median (range) of per-round ratios to dense; error: relative L2 against the fp32 definition.",
              "", "| case | T | pass | contender | ms | speed-up | error |", "|---|---|---|---|---|---|---|"]
    notes = []
    for label, grid, prefix, sparsity, with_gate in cases:
        log(f"{label}")
        T, rows, why_not = run_case(device, label, grid, prefix, sparsity, with_gate, args.rounds,
                                    args.backward and not prefix, heads, head_dim)
        if why_not:
            notes.append(f"{label}: {why_not}")
        for kind, times, errs in rows:
            for name, t in times.items():
                speed = "1" if name == "dense" else ratio_summary(times["dense"], t)
                err = f"{errs[name]:.2e}" if name in errs else ""
                lines.append(f"| {label} | {T} | {kind} | {name} | {statistics.median(t):.2f} | {speed} | {err} |")
                print(lines[-1], flush=True)
    if notes:
        lines += ["", "Not run: " + "; ".join(dict.fromkeys(notes))]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_vsa.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    main()
