"""``video_sparse_attn`` at H3's size on a GPU: the routing plan from the Triton kernels (the
fused plan with VSA's rule, ``solattn.routing.fused.vsa_rule``) against the torch plan, and the
whole call with either, next to dense SDPA.

Geometry: B=1, H=56, D=128, bf16, a 432-token prefix segment and a (16, 48, 48) latent grid, so
T = 37296 and n = 583 tiles (7 prefix tiles, the last with 48 live rows, and 576 cubes), as the
sol_attn H3 benchmarks; inputs ``solattn.testing.make_qkv(seed=0)``. Sparsity 0.9 (the ComfyUI
node's default keep of 10 %), "exempt" and "compete" prefixes, with and without a coarse gate.

For each case: the torch plan's time, the fused plan's time and its per-kernel GPU times, rows
whose block sets differ between the two plans (0 expected on these inputs), then end to end in
paired rounds (``plan_h3_fused.paired_rounds``): dense SDPA, the call with the fused plan, the
call with the torch plan forced (``fused_plan_usable`` patched to False); error of each against
the definition computed by the ``sdpa`` backend on fp32 copies; the kept fraction and the
two-number model (FLOPs on kept pairs, bytes of the fused path) of the fused-plan call.

    python benchmarks/diag/vsa_h3.py
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import differing_rows, kernel_table, med, paired_rounds, ratio_summary  # noqa: E402
from solattn.bench.models import bytes_moved, flop_count  # noqa: E402
from solattn.routing import build_vsa_plan, fused, vsa_topk_from_sparsity  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402
from solattn.tiling import DEFAULT_CUBE, tiled_gate, to_tiled  # noqa: E402
from solattn.tiling import layout as tiled_layout  # noqa: E402

dev = torch.device("cuda")
GRID, PREFIX, H, D, SPARSITY = (16, 48, 48), [432], 56, 128, 0.9
CASES = (("exempt", False), ("compete", False), ("exempt", True))


def near_tie_gaps(problem, got, want, k_vid, P, mode):
    """For each row whose block set differs between the plans: the gap between its k-th and
    (k+1)-th largest competing score in fp64, over the row's largest |score| (a near tie when
    it is at fp32 rounding, ~1e-7)."""
    from solattn.routing import block_stats
    rows = (got.dense_mask() != want.dense_mask()).any(-1).flatten().nonzero().flatten()
    if rows.numel() == 0:
        return []
    stats = block_stats(problem)
    n = problem.n
    qm = stats.qm.double().reshape(-1, n, D)
    km = stats.km.double().reshape(-1, n, D)
    kk = k_vid if mode == "exempt" else min(k_vid + P, n)
    out = []
    for r in rows.tolist()[:8]:
        g, i = divmod(r, n)
        S = (qm[g, i] @ km[g].T) * problem.scale
        comp = S[P:] if mode == "exempt" else S
        top = comp.sort(descending=True).values
        out.append(float((top[kk - 1] - top[kk]) / top.abs().max()))
    return out


def main():
    T = sum(PREFIX) + GRID[0] * GRID[1] * GRID[2]
    q, k, v = make_qkv(1, T, H, D, dtype=torch.bfloat16, device=dev, seed=0)
    gate_t = torch.rand(q.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev).to(q.dtype)
    gate_t = gate_t.float().mul_(0.5).to(q.dtype)     # gates in [0, 0.5)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else dev.type
    print(f"{torch.__version__} {name} {solattn.__version__} git {os.environ.get('SOLATTN_REVISION', '?')} T={T} grid={GRID} "
          f"prefix={PREFIX} H={H} D={D} sparsity={SPARSITY}", flush=True)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    layout = tiled_layout(GRID, DEFAULT_CUBE, tuple(PREFIX), dev)
    P = layout.num_prefix_blocks
    tq, tk, tv = (to_tiled(x, layout) for x in (q, k, v))
    rows = []
    for mode, with_gate in CASES:
        gate = gate_t if with_gate else None
        label = f"{mode}{' + gate' if with_gate else ''}"
        problem = validate(tq, tk, tv, tail=False, block_len=layout.block_len,
                           coarse_gate=tiled_gate(gate, tq, layout))
        n_video = problem.n - P
        k_vid = vsa_topk_from_sparsity(SPARSITY, n_video)
        with torch.no_grad():
            want = build_vsa_plan(problem, k_vid, P, mode)
            got = build_vsa_plan(problem, k_vid, P, mode, fused=True)
            diff = differing_rows(got, want)
            gaps = near_tie_gaps(problem, got, want, k_vid, P, mode)
            t_torch = med(lambda: build_vsa_plan(problem, k_vid, P, mode), 10, 2)
            t_fused = med(lambda: build_vsa_plan(problem, k_vid, P, mode, fused=True), 10, 2)
            kt_f = kernel_table(lambda: build_vsa_plan(problem, k_vid, P, mode, fused=True))
            coarse = "" if not with_gate else f", coarse rel {rel_l2(got.coarse, want.coarse):.1e}"
            print(f"## {label}: k_vid {k_vid} of {n_video}; torch plan {t_torch:.3f} ms, fused plan "
                  f"{t_fused:.3f} ms, rows differing {diff}{coarse}; fused kernels: {kt_f}", flush=True)
            if gaps:
                print(f"   differing rows' gap between the k-th and next competing score (fp64, relative to "
                      f"the row's largest |score|): {', '.join(f'{g:.1e}' for g in gaps)}", flush=True)
            kept = int(got.kv_num_blocks.sum())
            del want, got

            kw = dict(sparsity=SPARSITY, gate=gate, prefix_len=PREFIX, prefix_mode=mode)

            def call():
                return solattn.video_sparse_attn(q, k, v, GRID, backend="triton", **kw)

            def call_torch_plan():
                with mock.patch.object(fused, "fused_plan_usable", lambda problem: False):
                    return call()

            ref = solattn.video_sparse_attn(q.float(), k.float(), v.float(), GRID, backend="sdpa", **kw)
            err_f, err_t = rel_l2(call(), ref), rel_l2(call_torch_plan(), ref)
            del ref
            times = paired_rounds({"dense": lambda: F.scaled_dot_product_attention(qt, kt, vt),
                                   "fused plan": call, "torch plan": call_torch_plan}, rounds=20)
        ms = {name: statistics.median(t) for name, t in times.items()}
        flop = flop_count((1, problem.T, H, D), kept)
        gb = bytes_moved((1, problem.T, H, D), 2, kept, "fused") / 1e9
        print(f"{label}: dense {ms['dense']:.2f} ms; fused plan {ms['fused plan']:.2f} ms "
              f"({ratio_summary(times['dense'], times['fused plan'])} dense, err {err_f:.2e}); torch plan "
              f"{ms['torch plan']:.2f} ms ({ratio_summary(times['dense'], times['torch plan'])}, err {err_t:.2e}); "
              f"fused vs torch plan {ratio_summary(times['torch plan'], times['fused plan'])}; kept "
              f"{kept / (problem.B * H * problem.n ** 2):.3f}, {flop / 1e12:.2f} TFLOP, {gb:.2f} GB", flush=True)
        rows.append((label, ms, times, err_f, err_t, diff))
    print("\n| case | dense | torch plan | fused plan | fused vs torch | rows differing | error (fused / torch) |")
    print("|---|---|---|---|---|---|---|")
    for label, ms, times, err_f, err_t, diff in rows:
        print(f"| {label} | {ms['dense']:.2f} ms | {ms['torch plan']:.2f} ms "
              f"({ratio_summary(times['dense'], times['torch plan'])}) | {ms['fused plan']:.2f} ms "
              f"({ratio_summary(times['dense'], times['fused plan'])}) | "
              f"{ratio_summary(times['torch plan'], times['fused plan'])} | {diff} | {err_f:.2e} / {err_t:.2e} |")


if __name__ == "__main__":
    main()
