"""The report: the terminal table, ``bench.csv``, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from ..devices import device_name
from .models import model_text
from .parsing import DENSE, DTYPE_NAMES, Config

COLUMNS = ["backend", "device", "dtype", "B", "T", "H", "D", "ratio", "tau", "tail", "coarse_gate",
           "time_ms", "plan_ms", "speedup", "peak_mib", "peak_basis", "rel_l2", "err_basis",
           "kept_fraction", "gflop", "gb_moved", "gflops", "gbps", "repeats"]


def _fmt(col: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        if col in ("rel_l2",):
            return f"{value:.2e}"
        if col in ("ratio", "kept_fraction"):
            return f"{value:.3g}"
        if col == "speedup":
            return f"{value:.2f}x"
        if col in ("gflop", "gb_moved"):
            return f"{value:.3g}"
        if col in ("time_ms", "plan_ms", "peak_mib", "gflops", "gbps"):
            return f"{value:.4g}" if value < 1000 else f"{value:.0f}"
        return f"{value:.4g}"
    return str(value)


TABLE = [("backend", "backend"), ("shape BxTxHxD", None), ("routing", "ratio"), ("tail", "tail"),
         ("time ms", "time_ms"), ("plan ms", "plan_ms"), ("vs dense", "speedup"),
         ("peak MiB", "peak_mib"), ("rel. L2", "rel_l2"), ("error basis", "err_basis"),
         ("kept", "kept_fraction"), ("GFLOP", "gflop"), ("GB moved", "gb_moved"),
         ("GFLOP/s", "gflops"), ("GB/s", "gbps")]


def _tera(rows: List[dict]) -> bool:
    """Show FLOP/s in TFLOP/s when some row reaches 1 TFLOP/s (GPUs), else GFLOP/s."""
    return any((r.get("gflops") or 0) >= 1000 for r in rows)


def table_head(rows: List[dict]) -> List[str]:
    return [("TFLOP/s" if key == "gflops" and _tera(rows) else h) for h, key in TABLE]


def table_cells(row: dict, tera: bool = False) -> List[str]:
    cells = []
    for _, key in TABLE:
        if key is None:
            cells.append(f"{row['B']}x{row['T']}x{row['H']}x{row['D']}")
        elif key == "ratio":
            cells.append(f"top-k {_fmt(key, row[key])}" if row[key] else f"tau {row.get('tau', 1.0):g}")
        elif key == "peak_mib" and row["peak_mib"] is not None:
            cells.append(("≥" if row["peak_basis"] == "rss>=" else "") + _fmt(key, row[key]))
        elif key == "gflops" and tera and row[key] is not None:
            cells.append(f"{row[key] / 1000:.4g}")
        else:
            cells.append(_fmt(key, row[key]))
    return cells


#: what each table column means, printed under the terminal table and in bench.md
LEGEND = [
    ("backend", "dense = F.scaled_dot_product_attention without sparsity; a solattn backend name; "
                "comfy-kitchen = comfy_kitchen.sol_attn on its fused CUDA kernel (when importable)"),
    ("routing", "top-k R: the fraction R of key blocks kept by score; tau X: the threshold rule at X sigmas"),
    ("time ms", "median time per call over the timed rounds; a sparse row is the whole sol_attn call, "
                "routing plan included"),
    ("plan ms", "the routing plan alone (the one this backend runs from: the fused Triton plan where "
                "triton takes it, else build_plan's torch path), part of time ms (n/a for comfy-kitchen, "
                "which routes inside its own call)"),
    ("vs dense", "speed-up: the time ms of the dense row above (same problem, routing and tail) / "
                 "this row's time ms, both medians over the same rounds (each round runs dense and "
                 "every backend once, in an order rotated each round)"),
    ("peak MiB", "extra memory one call needed beyond what was held before it, output included; "
                 "a leading ≥ marks CPU resident-set sampling, a lower bound; n/a: not measured on "
                 "this device"),
    ("rel. L2", "||out - basis|| / ||basis|| against the error basis named in the next column"),
    ("error basis", "reference = the definition computed in fp32; sdpa-fp32 = the portable backend on "
                    "fp32 copies (where the reference does not fit); \"(other op)\" on the dense row: "
                    "dense attention is compared with the sparse operator, so its error is how much the "
                    "sparsity changes the output, not an accuracy defect"),
    ("kept", "fraction of (query block, key block) pairs attended exactly, forced neighbours and sinks "
             "included"),
    ("GFLOP, GB moved", "the two-number model: FLOPs on the kept blocks, modelled bytes (see bench.md)"),
    ("GFLOP/s, GB/s", "those per second of time ms (TFLOP/s when a row reaches 1000 GFLOP/s)"),
]


def legend_lines(width: int = 100) -> List[str]:
    """The column legend for the terminal, wrapped at word boundaries."""
    import textwrap
    key_w = max(len(k) for k, _ in LEGEND) + 2
    lines = ["Columns:"]
    for key, text in LEGEND:
        body = textwrap.wrap(text, width=max(40, width - 2 - key_w), break_long_words=False,
                             break_on_hyphens=False)
        lines.append("  " + key.ljust(key_w) + body[0])
        lines += ["  " + " " * key_w + more for more in body[1:]]
    return lines


def text_table(rows: List[dict]) -> str:
    head = table_head(rows)
    body = [table_cells(r, _tera(rows)) for r in rows]
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def markdown_table(rows: List[dict]) -> str:
    head = table_head(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(table_cells(r, _tera(rows))) + " |" for r in rows]
    return "\n".join(lines)


def publish(lines: List[str], path: str) -> str:
    """A benchmark script's markdown report: printed, and written to ``path`` (folders made)."""
    text = "\n".join(lines) + "\n"
    print(text)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    return text


def write_csv(rows: List[dict], path: str, columns: Sequence[str] = COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})


def environment(cfg: Config) -> Dict[str, str]:
    dev = cfg.device
    name = device_name(dev) or platform.processor() or platform.machine()
    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": f"{dev} ({name})",
           "torch": torch.__version__, "python": platform.python_version(),
           "cpu threads (torch)": str(torch.get_num_threads()), "cpu cores": str(os.cpu_count()),
           "dtype": DTYPE_NAMES[cfg.dtype], "repeats": f"{cfg.warmup} warm-up + {cfg.repeats} timed (median)"}
    env["solattn"] = source_revision()
    getloadavg = getattr(os, "getloadavg", None)   # absent on Windows
    if getloadavg is not None:
        try:
            env["load average (1, 5, 15 min) at the end"] = ", ".join(f"{x:.2f}" for x in getloadavg())
        except OSError:
            pass
    return env


def source_revision() -> str:
    """The solattn source commit (and whether the tree differs from it), when run from a checkout.
    ``SOLATTN_REVISION`` overrides it: a copy of the tree run elsewhere (a GPU machine reached
    through a file copy) may carry a stale or no ``.git``, and its runner knows the commit."""
    import subprocess
    given = os.environ.get("SOLATTN_REVISION", "").strip()
    if given:
        return f"git {given} (SOLATTN_REVISION)"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the solattn package
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            raise OSError(head.stderr)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", here], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from .. import __version__
        return f"{__version__} (not a git checkout)"
    return f"git {head.stdout.strip()}" + (" + uncommitted changes under solattn/" if dirty else "")


def write_markdown(rows: List[dict], cfg: Config, path: str, plot_note: str) -> None:
    lines = ["# solattn bench", ""]
    lines += [f"- {k}: {v}" for k, v in environment(cfg).items()]
    lines += ["", markdown_table(rows), ""]
    lines += ["Columns:", ""] + [f"- `{key}`: {text}" for key, text in LEGEND] + [""]
    if cfg.skipped:
        lines += ["Not run:", ""] + [f"- {s}" for s in cfg.skipped_lines()] + [""]
    if plot_note:
        lines += [plot_note, ""]
    lines += [model_text()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot_lines(rows: List[dict]) -> Dict[str, Dict[int, float]]:
    """The plot's data: ``{label: {T: time_ms}}``, one line per (backend, routing, tail[, B/H/D]),
    each point a table row's ``time_ms``. Dense is timed anew beside each (routing, tail) group,
    so it gets a line per group (labelled with the group) whenever there is more than one: each
    sparse line is drawn with the dense times its ``vs dense`` column was taken from."""
    shapes = sorted({(r["B"], r["H"], r["D"]) for r in rows})
    modes = sorted({(r["ratio"], r.get("tau"), r["tail"]) for r in rows}, key=str)
    lines: Dict[str, Dict[int, float]] = {}
    for r in rows:
        mode = (f"r={r['ratio']:g}" if r["ratio"] else f"tau={r.get('tau', 1.0):g}") \
            + (" tail" if r["tail"] else "")
        if r["backend"] == DENSE:
            label = "dense SDPA" + (f" (rounds of {mode})" if len(modes) > 1 else "")
        else:
            label = f"{r['backend']} {mode}"
        if len(shapes) > 1:
            label += f" (B={r['B']},H={r['H']},D={r['D']})"
        pts = lines.setdefault(label, {})
        if r["T"] in pts:
            raise ValueError(f"two rows for the plot's point {label!r} at T={r['T']}")
        pts[r["T"]] = r["time_ms"]
    return lines


def write_plot(rows: List[dict], path: str, cfg: Config) -> str:
    """Time against T, log-log, the lines of :func:`plot_lines`; returns a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)."
    lines = plot_lines(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(lines.items()):
        ts = sorted(pts)
        ax.plot(ts, [pts[t] for t in ts], marker="o", linestyle="--" if label.startswith("dense") else "-",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("time per call (ms, median)")
    ax.set_title(f"solattn bench: {cfg.device.type}, {DTYPE_NAMES[cfg.dtype]}, top-k"
                 + (", coarse gate" if cfg.coarse else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""
