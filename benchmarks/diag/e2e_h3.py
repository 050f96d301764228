"""``sol_attn`` end to end at H3 (B=1, T=37296, H=56, D=128, bf16) against dense SDPA, timed two
ways in the same rounds, and the host's share of a call.

- **one call**: the device synchronised before each call, events around it (what the speed issue's
  goal table and ``plan_h3_fused.py`` report): the host's latency to the first launch
  (validation, the plan's Python) is on the clock, as for a model whose GPU queue has run dry.
- **queued**: ``CALLS`` calls back to back between two events, per call: the host issues while
  the GPU works on the previous call, as in a model's forward where attention is queued behind
  other GPU work. Dense SDPA is timed the same way in both.

Per mode it prints the medians, the median and range of the per-round ratios (dense / solattn),
the output's relative error against the fp32 definition, and the host's wall time to issue one
call while the GPU is busy (``perf_counter`` around the call, no synchronisation).

    python benchmarks/diag/e2e_h3.py [host]      # host: then a cProfile of top-k 20 % calls
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import MODES, ratio_summary  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import fused  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
CALLS = 5
ROUNDS = 12


def queued_ms(fn, calls=CALLS):
    """ms per call of ``calls`` back-to-back calls between two events (synchronised before)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def host_issue_ms(fn, busy, calls=10):
    """median host wall time (ms) to issue one call of ``fn`` while the GPU runs ``busy`` work."""
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        busy()                       # keeps the GPU busy for longer than the host takes to issue
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def main():
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def dense():
        return F.scaled_dot_product_attention(qt, kt, vt)

    print("| mode | dense one call | solattn one call | ratio one call | dense queued | solattn queued | "
          "ratio queued | host issue ms | err vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, kw in MODES:
        with torch.no_grad():
            def call():
                return solattn.sol_attn(q, k, v, backend="triton", **kw)
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
            err = rel_l2(call().float(), ref)
            del ref
            for fn in (dense, call):
                time_calls(fn, dev, 0, 2)
            one = {"dense": [], "sol": []}
            queued = {"dense": [], "sol": []}
            for r in range(ROUNDS):
                order = [("dense", dense), ("sol", call)][::1 if r % 2 == 0 else -1]
                for name, fn in order:
                    one[name] += time_calls(fn, dev, 1)
                for name, fn in order:
                    queued[name].append(queued_ms(fn))
            host = host_issue_ms(call, dense)
        md = {key: statistics.median(val) for key, val in (("d1", one["dense"]), ("s1", one["sol"]),
                                                           ("dq", queued["dense"]), ("sq", queued["sol"]))}
        print(f"| {label} | {md['d1']:.2f} | {md['s1']:.2f} | {ratio_summary(one['dense'], one['sol'])} | "
              f"{md['dq']:.2f} | {md['sq']:.2f} | {ratio_summary(queued['dense'], queued['sol'])} | {host:.3f} | "
              f"{err:.2e} |", flush=True)


def host_profile(label="top-k 20 %", calls=20, top=25):
    """cProfile of ``calls`` calls of one mode issued while the GPU is busy: where the host's time goes."""
    import cProfile
    import io
    import pstats
    kw = dict(MODES)[label]
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with torch.no_grad():
        call = lambda: solattn.sol_attn(q, k, v, backend="triton", **kw)  # noqa: E731
        call()
        prof = cProfile.Profile()
        for _ in range(calls):
            torch.cuda.synchronize()
            F.scaled_dot_product_attention(qt, kt, vt)
            prof.enable()
            call()
            prof.disable()
        torch.cuda.synchronize()
        problem = validate(q, k, v, **kw)
        plan = fused.fused_plan(problem)
        parts = {"validate": lambda: validate(q, k, v, **kw), "fused plan": lambda: fused.fused_plan(problem),
                 "kernel launch": lambda: tb.launch(problem, plan), "whole call": call}
        busy = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        print("\nhost issue ms (no profiler): " + ", ".join(f"{name} {host_issue_ms(fn, busy):.3f}"
                                                             for name, fn in parts.items()))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"\n## host profile, {label}, {calls} calls issued while the GPU is busy\n{buf.getvalue()}")


if __name__ == "__main__":
    main()
    if "host" in sys.argv[1:]:
        host_profile()
