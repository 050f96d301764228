"""Where the end-to-end time of ``sol_attn`` goes on a GPU: plan stages, backends, SDPA mask dtypes.

    PYTHONPATH=. python benchmarks/probe_gpu.py [--out DIR] [--device cuda] [--shapes seed h3]

Prints a table and writes probe_gpu.md under --out. Inputs, timing (median of --repeats calls
after --warmup, the device synchronised around each), peak memory, error and FLOP counts are
``python -m solattn bench``'s own (``solattn.bench``), so the figures compare with its tables.
Not a test: figures only.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import solattn
from solattn import dispatch, routing
from solattn.validation import validate
from solattn.backends.sdpa import sdpa_forward
from solattn.bench import ProblemArgParser, flop_count, log, make_inputs, measure_peak, rel_l2, time_calls


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = ProblemArgParser("benchmarks/probe_gpu.py", __doc__.split("\n\n")[0], shapes=("seed", "h3"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for probe_gpu.md")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per figure, median (default 50)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    dev, ratio = args.device, args.ratio
    lines = ["| shape | what | ms | TFLOP/s | peak MiB | rel. L2 vs sdpa fp32 |", "|---|---|---|---|---|---|"]

    def ms(fn) -> float:
        return statistics.median(time_calls(fn, dev, args.repeats, warmup=args.warmup))

    def row(shape: str, what: str, t: float, flops: Optional[float] = None, peak: Optional[float] = None,
            err: Optional[float] = None) -> None:
        cells = [f"{t:.3f}", "" if flops is None else f"{flops / t / 1e9:.3g}",
                 "" if peak is None else f"{peak:.0f}", "" if err is None else f"{err:.2e}"]
        lines.append(f"| {shape} | {what} | " + " | ".join(cells) + " |")
        log(f"{shape:>16} {what:<48} " + "  ".join(cells))

    for shape in args.shapes:
        name = "x".join(map(str, shape))
        D = shape[3]
        q, k, v = make_inputs(shape, torch.bfloat16, dev)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dense = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        _, peak, _ = measure_peak(dense, dev)
        row(name, "dense F.sdpa", ms(dense), flop_count(shape, None), peak)
        for tail in (False, True):
            p = validate(q, k, v, topk_ratio=ratio, tail=tail)
            stats = routing.block_stats(p)
            exact = routing.select_exact(p, stats)
            plan = routing.build_plan(p)
            kept = flop_count(shape, int(plan.kv_num_blocks.sum().item()))
            if not tail:
                row(name, "plan: block_stats", ms(lambda: routing.block_stats(p)))
                row(name, "plan: select_exact", ms(lambda: routing.select_exact(p, stats)))
                row(name, "plan: indices_from_mask", ms(lambda: routing.indices_from_mask(exact)))
            row(name, f"plan: build_plan tail={tail}", ms(lambda: routing.build_plan(p)))
            row(name, f"sdpa backend (plan given) tail={tail}", ms(lambda: sdpa_forward(p, plan)), kept)
            basis = solattn.sol_attn(q.float(), k.float(), v.float(), topk_ratio=ratio, tail=tail,
                                     backend="sdpa")
            for b in ("triton", "sdpa"):
                reasons = dispatch.get_backend(b).not_supported_reasons(p)
                if reasons:
                    lines.append(f"| {name} | {b}, tail={tail} | not run: {'; '.join(reasons)} | | | |")
                    continue
                call = lambda b=b: solattn.sol_attn(q, k, v, topk_ratio=ratio, tail=tail, backend=b)  # noqa: E731
                out, peak, _ = measure_peak(call, dev)
                row(name, f"sol_attn end to end, {b}, tail={tail}", ms(call), kept, peak, rel_l2(out, basis))
            del basis
        # does the device's SDPA take an fp32 additive mask with bf16 inputs, and at what cost?
        nr, L = 256, 60 * 64
        qq = torch.randn(nr, 1, 64, D, device=dev, dtype=torch.bfloat16)
        kk = torch.randn(nr, 1, L, D, device=dev, dtype=torch.bfloat16)
        vv = torch.randn(nr, 1, L, D, device=dev, dtype=torch.bfloat16)
        for mname, mask in (("none", None),
                            ("bf16 (nr,1,1,L)", torch.zeros(nr, 1, 1, L, device=dev, dtype=torch.bfloat16)),
                            ("fp32 (nr,1,1,L)", torch.zeros(nr, 1, 1, L, device=dev))):
            try:
                row(name, f"F.sdpa on gathered ({nr} x 64 x {L}), mask {mname}",
                    ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)))
            except Exception as e:  # report what the device refuses
                lines.append(f"| {name} | mask {mname} | refused: {type(e).__name__}: {e} | | | |")
                log(f"mask {mname} refused: {e}")
        del q, k, v, qt, kt, vt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    with open(os.path.join(args.out, "probe_gpu.md"), "w") as f:
        f.write(f"# probe_gpu on {device_name} (torch {torch.__version__})\n\n")
        f.write(f"top-k {ratio:g}, bf16, {args.warmup} warm-up + {args.repeats} timed calls (median)\n\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
