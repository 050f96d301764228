"""Session-10 probe (H200): where the seed shape's end-to-end time goes, whether a whole
``sol_attn`` call can be captured in a CUDA graph, the fused backward's kernels split by kernel
(exact delta on / off), and a warp-specialised variant of the forward loop.

    python benchmarks/diag/session10_probe.py > probe.txt
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn import dispatch  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton.backward import BackwardConfig, fused_backward, lse_shape  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")


def med(xs):
    return sorted(xs)[len(xs) // 2]


def host_us(fn, n=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def seed_probe():
    print("## seed shape: host issue time and graph capture", flush=True)
    q, k, v = make_qkv(2, 4056, 16, 128, dtype=torch.bfloat16, device=dev, seed=0)
    dense = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    print(f"dense e2e ms {med(time_calls(dense, dev, 50, 5)):.3f}  host us {host_us(dense):.1f}")
    for label, kw in (("topk10", dict(topk_ratio=0.1, tail=False)), ("tau1 tail", dict(tau=1.0, tail=True))):
        call = lambda: solattn.sol_attn(q, k, v, backend="triton", **kw)
        e2e = med(time_calls(call, dev, 50, 5))
        print(f"[{label}] sol_attn e2e ms {e2e:.3f}  host us {host_us(call):.1f}")
        problem = validate(q, k, v, kw.get("tau", 1.0), None, None, None, None, kw.get("topk_ratio", 0.0),
                           kw["tail"], None, None, 0)
        chosen = dispatch.choose(problem, "triton")
        plan = build_plan(problem, fused=True)
        parts = {
            "validate": lambda: validate(q, k, v, kw.get("tau", 1.0), None, None, None, None,
                                         kw.get("topk_ratio", 0.0), kw["tail"], None, None, 0),
            "choose": lambda: dispatch.choose(problem, "triton"),
            "build_plan fused": lambda: build_plan(problem, fused=True),
            "launch": lambda: tb.launch(problem, plan),
            "backend.forward": lambda: chosen.forward(problem, plan),
        }
        for name, fn in parts.items():
            print(f"   host us {name:18s} {host_us(fn):8.1f}   gpu+host ms {med(time_calls(fn, dev, 30, 3)):.3f}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:6000])
        # whole call in a CUDA graph
        try:
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(2):
                    call()
            torch.cuda.current_stream().wait_stream(st)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out_g = call()
            g.replay()
            torch.cuda.synchronize()
            err = rel_l2(out_g.float(), call().float())
            rep = med(time_calls(g.replay, dev, 100, 5))
            rep_clone = med(time_calls(lambda: (g.replay(), out_g.clone()), dev, 100, 5))
            print(f"   graph replay ms {rep:.3f}  replay+clone {rep_clone:.3f}  host us {host_us(g.replay):.1f}  "
                  f"err vs eager {err:.2e}")
        except Exception as e:  # noqa: BLE001
            print("   graph capture failed:", type(e).__name__, str(e)[:300])


def backward_probe():
    print("## H3 backward: kernels by kind, exact delta on/off", flush=True)
    B, T, H, D = 1, 37296, 56, 128
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=0)
    problem = validate(q, k, v, 1.0, None, None, None, None, 0.1, False, None, None, 0)
    plan = build_plan(problem)
    lse = torch.empty(lse_shape(B, T, H), dtype=torch.float32, device=dev)
    out = tb.launch(problem, plan, lse=lse)
    go = torch.randn_like(out)
    print(f"forward (lse) ms {med(time_calls(lambda: tb.launch(problem, plan, lse=lse), dev, 10, 2)):.2f}")
    print(f"forward (no lse) ms {med(time_calls(lambda: tb.launch(problem, plan), dev, 10, 2)):.2f}")
    print(f"plan ms {med(time_calls(lambda: build_plan(problem), dev, 10, 2)):.2f}")
    print(f"query_lists ms {med(time_calls(lambda: plan.query_lists(), dev, 10, 2)):.2f}")
    ref = None
    for exact in (True, False):
        for w, s in ((4, 2), (4, 3), (8, 2)):
            cfg = BackwardConfig(w, s, w, s, exact_delta=exact)
            try:
                g = fused_backward(problem, plan, out, lse, go, config=cfg)
                t = med(time_calls(lambda: fused_backward(problem, plan, out, lse, go, config=cfg), dev, 5, 1))
                if ref is None:
                    ref = g
                e = max(rel_l2(a.float(), b.float()) for a, b in ((g.dq, ref.dq), (g.dk, ref.dk), (g.dv, ref.dv)))
                print(f"exact={exact} warps={w} stages={s}: {t:.2f} ms  (diff to first {e:.2e})", flush=True)
            except Exception as ex:  # noqa: BLE001
                print(f"exact={exact} warps={w} stages={s}: failed {type(ex).__name__} {str(ex)[:200]}")
    from torch.profiler import ProfilerActivity, profile
    cfg = BackwardConfig(4, 2, 4, 2, exact_delta=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_backward(problem, plan, out, lse, go, config=cfg)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


WS_SRC = None


def ws_probe():
    print("## forward loop with tl.range(warp_specialize=True)", flush=True)
    import triton  # noqa: F401
    from solattn.backends.triton import kernel as km
    import inspect
    src = inspect.getsource(km.sol_attn_fwd.fn)
    B, T, H, D = 1, 37296, 56, 128
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=0)
    problem = validate(q, k, v, 1.0, None, None, None, None, 0.1, False, None, None, 0)
    plan = build_plan(problem, fused=True)
    base = tb.launch(problem, plan)
    cfg0 = tb.DEFAULT_CONFIGS[128]
    print(f"production {med(time_calls(lambda: tb.launch(problem, plan), dev, 10, 2)):.2f} ms")
    variants = {
        "ws": "tl.range(0, count, warp_specialize=True)",
        "ws_s3": "tl.range(0, count, num_stages=3, warp_specialize=True)",
    }
    header = ("import triton.language as tl\n"
              "from solattn.backends.triton.kernel import gpu_jit, program_start, block_logits, "
              "softmax_update, write_rows\n\n")
    for name, rng in variants.items():
        body = src.replace("range(0, count)", rng).replace("def sol_attn_fwd(", f"def fwd_{name}(")
        d = tempfile.mkdtemp()
        path = os.path.join(d, f"variant_{name}.py")
        with open(path, "w") as f:
            f.write(header + body)
        sys.path.insert(0, d)
        try:
            mod = __import__(f"variant_{name}")
            kern = getattr(mod, f"fwd_{name}")
            for warps in (4, 8):
                cfg = tb.KernelConfig(1, warps, 3, tma=True)
                out = tb.run_kernel(kern, problem, plan, cfg)
                err = rel_l2(out.float(), base.float())
                t = med(time_calls(lambda: tb.run_kernel(kern, problem, plan, cfg), dev, 10, 2))
                print(f"{name} warps={warps}: {t:.2f} ms, diff to production {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: failed {type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc(limit=2)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    for fn in (seed_probe, backward_probe, ws_probe):
        try:
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
