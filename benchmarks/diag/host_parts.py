"""Where the host's time goes in one ``sol_attn`` call on a GPU, without a profiler's own cost:
every Triton launch of the call timed with ``perf_counter`` in place (``kernel.compiled`` wrapped),
the whole call around them, and the host cost of a few primitives for scale (an empty call, a
``torch.empty``, a torch kernel launch, a TMA descriptor). All while the GPU is kept busy by dense
SDPA, so that no launch waits for the device.

Session 20: the device machines' hosts took 0.66-1.9 ms to issue one H3 call, and a launch cache
that skipped ``JITFunction.run``'s binding and specialisation did not shorten it.

    python benchmarks/diag/host_parts.py [funcs]

``funcs``: also the inclusive host time of each step of the call (validation, dispatch, the plan,
the kernel's operands, ...), each wrapped with ``perf_counter`` in its module.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.backends.triton import kernel as tk  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402

dev = torch.device("cuda")
CALLS = 40


def us(samples):
    return f"{statistics.median(samples) * 1e6:7.1f} us (p10 {sorted(samples)[len(samples) // 10] * 1e6:6.1f})"


def _enter_exit(device):
    with torch.cuda.device(device):
        pass


def primitive(fn, busy, n=200):
    torch.cuda.synchronize()
    busy()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return out


#: (module, function) pairs timed inclusively with ``funcs``
FUNCS = (("solattn.pipeline", "validate"), ("solattn.dispatch", "choose"), ("solattn.pipeline", "build_plan"),
         ("solattn.pipeline", "fused_plan_allowed"), ("solattn.pipeline", "backward_buffers"),
         ("solattn.pipeline", "run_for_backward"), ("solattn.ops", "plain_eager"), ("solattn.ops", "eager_call"),
         ("solattn.routing.fused", "fused_plan_usable"), ("solattn.routing.fused", "_fused_plan"),
         ("solattn.routing.fused", "dot_precision"), ("solattn.backends.triton.backend", "kernel_operands"),
         ("solattn.backends.triton.backend", "run_kernel"), ("solattn.backends.triton.backend", "_tma_ok"),
         ("solattn.backends.base", "_compute_capability_reasons"))


def wrap_funcs(record):
    """Wrap every FUNCS entry that exists with a timer into ``record``; returns an undo list."""
    import importlib
    undo = []
    for mod_name, name in FUNCS:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name, None)
        if fn is None:
            continue

        def timed(*args, _fn=fn, _key=f"{mod_name.split('.')[-1]}.{name}", **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                record[_key].append(time.perf_counter() - t0)
        setattr(mod, name, timed)
        undo.append((mod, name, fn))
    return undo


def main(funcs=False):
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    import triton
    print("triton", triton.__version__)
    launches = defaultdict(list)
    real = tk.compiled

    def timed(interpret, kernel=tk.sol_attn_fwd):
        inner = real(interpret, kernel)

        class Timed:
            def __getitem__(self, grid):
                run = inner[grid]

                def go(*args, **kwargs):
                    t0 = time.perf_counter()
                    out = run(*args, **kwargs)
                    launches[kernel.fn.__name__].append(time.perf_counter() - t0)
                    return out
                return go
        return Timed()

    for label, shape in (("H3", (1, 37296, 56)), ("seed", (2, 4056, 16))):
        B, T, H = shape
        q, k, v = make_qkv(B, T, H, 128, dtype=torch.bfloat16, device=dev, seed=0)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        reps = max(1, 70 // max(1, int(B * H * T * T / 37296 / 37296 / 56 * 70)))
        busy = lambda: [F.scaled_dot_product_attention(qt, kt, vt) for _ in range(reps)]  # noqa: E731
        x = torch.zeros(1024, device=dev)
        xi = torch.zeros(1024, dtype=torch.int32, device=dev)
        from triton.tools.tensor_descriptor import TensorDescriptor
        print(f"\n## {label} (B={B}, T={T}, H={H}): primitives, host time per call (median of 200)")
        for name, fn in (("empty Python call", lambda: None),
                         ("torch.empty(1024) on the GPU", lambda: torch.empty(1024, device=dev)),
                         ("x.add_(1) (one torch launch)", lambda: x.add_(1)),
                         ("TensorDescriptor of k", lambda: TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 64, 1, 128])),
                         ("torch.cuda.current_device()", torch.cuda.current_device),
                         ("torch.cuda.get_device_capability(dev)", lambda: torch.cuda.get_device_capability(dev)),
                         ("torch.cuda.is_available()", torch.cuda.is_available),
                         ("with torch.cuda.device(dev): pass", lambda: _enter_exit(dev)),
                         ("x.to(torch.int32).contiguous() (no-op)", lambda: xi.to(torch.int32).contiguous())):
            print(f"  {name:34s} {us(primitive(fn, busy))}")
        for mode, kw in (("top-k 20 %", dict(topk_ratio=0.2, tail=False)), ("tau 1 + tail", dict(tau=1.0, tail=True))):
            with torch.no_grad():
                call = lambda: solattn.sol_attn(q, k, v, backend="triton", **kw)  # noqa: E731
                call()
                tk.compiled = timed
                steps = defaultdict(list)
                undo = wrap_funcs(steps) if funcs else []
                try:
                    launches.clear()
                    whole = []
                    for _ in range(CALLS):
                        torch.cuda.synchronize()
                        busy()
                        t0 = time.perf_counter()
                        call()
                        whole.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                finally:
                    tk.compiled = real
                    for mod, name, fn in undo:
                        setattr(mod, name, fn)
            per_call = sum(sum(v) for v in launches.values()) / CALLS
            print(f"\n### {label} {mode}: whole call {us(whole)}; Triton launches {per_call * 1e6:.1f} us per call "
                  f"({sum(len(v) for v in launches.values()) // CALLS} launches), the rest "
                  f"{(statistics.median(whole) - per_call) * 1e6:.1f} us")
            for name, samples in launches.items():
                print(f"  {name:24s} {us(samples)}")
            for name, samples in steps.items():
                print(f"  {name:40s} {us(samples)} x{len(samples) // CALLS}")


if __name__ == "__main__":
    main(funcs="funcs" in sys.argv[1:])
