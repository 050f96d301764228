"""``python -m solattn {info,check,bench}``."""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import textwrap
import time
from typing import List, Optional

import torch

from . import devices, dispatch
from .bench.parsing import ArgParser, device_arg
from .routing import build_plan, live_lengths, live_token_mask
from .testing import block_structured_qkv
from .validation import validate


def _devices() -> List[str]:
    """Present devices, GPUs with their names."""
    def named(d):
        name = devices.device_name(d)
        return f"{d} ({name})" if name else d
    return [named(d) for d in devices.present_devices()]


def info(args) -> int:
    import solattn
    print(f"solattn {solattn.__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print("devices: " + ", ".join(_devices()))
    for dev in sorted({d.split(":")[0].split(" ")[0] for d in _devices()}):
        print(f"\nbackends on {dev} (priority: {' > '.join(dispatch.priority(dev)) or 'none'})")
        for note in devices.entry(dev).known_broken:
            print("  " + _wrapped(f"known on {dev}: {note}", 2))
        for b in dispatch.list_backends(dev):
            state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
            print(f"  {b['name']:<10} {state}")
            print(f"  {'':<10} " + _wrapped(b['description'], 13))
            for note in b["automatic"]:
                print(f"  {'':<10} " + _wrapped(f"automatic choice: {note}", 13))
    print("\n" + _wrapped(_comfy_kitchen_plugin(), 2))
    return 0


def _comfy_kitchen_plugin() -> str:
    """One line on the comfy-kitchen plug-in: off, installed, or why ``SOLATTN_COMFY_KITCHEN``
    could not install it (a missing or incompatible comfy-kitchen, a bad value): reported, never raised."""
    from .integrations import comfy_kitchen as plugin
    value = os.environ.get(plugin.ENV_VAR, "").strip()
    if plugin.is_installed():
        return f"comfy-kitchen plug-in: installed for {', '.join(plugin.installed_devices())}"
    if not value:
        return f"comfy-kitchen plug-in: off ({plugin.ENV_VAR} is unset; see docs/comfyui.md)"
    try:
        installed = plugin.install_from_env()
    except (ImportError, ValueError, RuntimeError) as exc:
        return f"comfy-kitchen plug-in: {plugin.ENV_VAR}={value!r} asks for it, but it is not installed: {exc}"
    return f"comfy-kitchen plug-in: installed for {', '.join(installed) or 'no device'} ({plugin.ENV_VAR}={value!r})"


def _check_problems(device):
    """A few random problems covering the modes and features; block-structured so routing is unambiguous."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        B, T, H, D = 2, 300, 2, 64
        q, k, v = block_structured_qkv(B, T, H, D, dtype, device, seed=len(str(dtype)), spread=3.0,
                                       key_offset=4.0, normalise=True)
        gate = torch.randn(B, T, H, D, generator=g).to(dtype).to(device)
        bl = torch.tensor([64, 40, 64, 17, 44], dtype=torch.int32, device=device)
        bias = torch.randn(B, T, generator=g).to(device)
        yield f"topk 0.3 tail {str(dtype)[6:]}", (q, k, v), dict(topk_ratio=0.3)
        yield f"tau 0.5 no-tail {str(dtype)[6:]}", (q, k, v), dict(tau=0.5, tail=False)
        yield (f"topk+bias+block_len+gate+sinks {str(dtype)[6:]}", (q, k, v),
               dict(topk_ratio=0.3, key_bias=bias, block_len=bl, coarse_gate=gate, sink_blocks=(0, 1),
                    sink_q=(4, 5)))


def _wrapped(text: str, indent: int) -> str:
    """``text`` wrapped to the terminal at word boundaries (never inside a word), continuation
    lines indented by ``indent``; a word longer than the line is left whole."""
    width = max(shutil.get_terminal_size((100, 24)).columns, indent + 40)
    lines = textwrap.wrap(text, width=width - indent, break_long_words=False, break_on_hyphens=False)
    return ("\n" + " " * indent).join(lines) if lines else ""


def check(args) -> int:
    from .backends.reference import reference_forward
    from .testing import tolerance
    device = args.device if args.device is not None else devices.best_device()
    rows, failed = [], False
    infos = [b for b in dispatch.list_backends(device)
             if b["name"] != "reference" and (not args.backends or b["name"] in args.backends)]
    runnable = [b["name"] for b in infos if b["available"]]
    for name, (q, k, v), kw in _check_problems(device):
        p = validate(q, k, v, **kw)
        want = reference_forward(p).float()
        live = live_token_mask(live_lengths(p)).reshape(-1)[:p.T]   # dead rows are unspecified
        for name_ in runnable:
            backend = dispatch.get_backend(name_)
            reasons = backend.not_supported_reasons(p)
            if not reasons and not (args.backends and name_ in args.backends):
                # what the automatic choice would not run (a compile of minutes): only when named
                reasons = [f"{why} (check it with --backends {name_})" for why in backend.automatic_reasons(p)]
            if reasons:
                rows.append((name_, name, "skip", "; ".join(reasons)))
                continue
            t0 = time.perf_counter()
            try:
                got = backend.forward(p, build_plan(p) if backend.uses_plan else None).float()
                err = ((got - want)[:, live].norm() / want[:, live].norm()).item()
                ok = math.isfinite(err) and err < tolerance(q.dtype)
                rows.append((name_, name, "pass" if ok else "FAIL",
                             f"rel L2 {err:.2e} ({(time.perf_counter() - t0) * 1e3:.0f} ms)"))
            except Exception as e:  # report, don't hide: a crash is a failure
                ok = False
                rows.append((name_, name, "FAIL", f"{type(e).__name__}: {e}"))
            failed |= not ok
    print(f"solattn check on {device} (tolerance: fp32 1e-5, bf16/fp16 1e-2 relative L2 vs reference)")
    for b in infos:
        if not b["available"]:
            print(f"  {b['name']:<10} " + _wrapped(f"not run here: {'; '.join(b['reasons'])}", 13))
    if not rows:
        print(f"none of {', '.join(args.backends)} can run here" if args.backends else
              "no backend other than the reference can run here")
        return 1
    w = max(len(r[1]) for r in rows)
    for backend, name, status, detail in rows:
        print(f"  {backend:<10} {name:<{w}}  {status:<5} " + _wrapped(detail, 2 + 10 + 1 + w + 2 + 5 + 1))
    print("FAILED" if failed else "all passed")
    return 1 if failed else 0


def _backend_arg(text: str) -> str:
    """``type=`` for ``check --backends``: a registered backend other than the reference."""
    names = [n for n in dispatch.registered() if n != "reference"]
    if text.lower() not in names:
        raise argparse.ArgumentTypeError(f"received {text!r}; allowed: {', '.join(names)} "
                                         "(the reference is what the others are checked against)")
    return text.lower()


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgParser(prog="python -m solattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="torch version, devices, backends and why each can or cannot run")
    pc = sub.add_parser("check", help="every backend that can run here against the reference")
    pc.add_argument("--device", type=device_arg, default=None, help="device to check (default: best present)")
    pc.add_argument("--backends", nargs="+", metavar="NAME", type=_backend_arg,
                    help="check only these backends (default: every one that can run here)")
    sub.add_parser("bench", help="timings, memory, error and plots (see `bench --help`)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import main as bench_main
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    return {"info": info, "check": check}[args.command](args)
