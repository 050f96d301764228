"""``python -m solattn bench``: time dense SDPA and every sol_attn backend that can run, side by side.

    python -m solattn bench                       # best device present, its default problems
    python -m solattn bench --quick               # tiny problems, no flex compile: ~10 s on a CPU (smoke test)
    python -m solattn bench --device cpu --shapes 1,8192,16,128 --ratios 0.1 0.2
    python -m solattn bench --shapes h3 seed --backends dense sdpa triton --out results/h200

What one row is
---------------
One backend on one problem ``(B, T, H, D, dtype, topk_ratio, tail, coarse_gate)``:

- ``time_ms``: median of ``--repeats`` timed calls after ``--warmup`` untimed ones, with the
  device synchronised around each call (CUDA: events; XPU/MPS: ``synchronize`` + ``perf_counter``;
  CPU: ``perf_counter``). The timed calls are interleaved: each round runs dense and every
  backend once, the order rotated by one each round, so a drift in machine load hits all of them
  alike and no row always follows the same other one. A sparse row is the whole
  ``sol_attn(..., backend=name)`` call, routing plan included; ``plan_ms`` is the median time of
  ``build_plan`` alone (part of ``time_ms``). The dense row is ``F.scaled_dot_product_attention``
  on contiguous ``(B, H, T, D)`` copies of the same inputs (no layout copy is timed): the same
  problem without sparsity, re-timed in every (ratio, tail) group beside the sparse rows.
- ``speedup``: dense ``time_ms`` / row ``time_ms``, the two medians over the same rounds (the dense row
  of the same problem and (ratio, tail) group), so it can be read off the two printed times.
- ``peak_mib``: memory the call needed beyond what was held before it (the output included),
  measured on the last warm-up call. CUDA / XPU: ``max_memory_allocated`` after
  ``reset_peak_memory_stats`` minus ``memory_allocated`` before (basis ``allocator``). CPU (Linux):
  the peak of the resident set size, sampled every ~1 ms from ``/proc/self/statm`` by a background
  thread, minus the RSS before the call (freed heap is first returned to the OS with glibc's
  ``malloc_trim``); raised to ``ru_maxrss - RSS before`` when the process's high-water mark grew
  during the call (then it is exact). Sampling can miss a short spike and pages the C allocator
  still holds are reused without growing the RSS, so the CPU figure is a lower bound (basis
  ``rss>=``, printed with ``≥``). Elsewhere ``n/a``: no number that was not measured.
- ``rel_l2``: ``||out - basis|| / ||basis||`` in float64. Basis ``reference``: the reference
  backend (SPEC.md literally, fp32) on the same inputs, when its memory guard lets it run this
  problem; else ``sdpa-fp32``: the portable backend run on fp32 copies of the inputs (the copies
  are exact, so the routing is identical). The dense row's error is against the same basis: dense
  attention is a different operator, so its figure is how much the sparsity changes the output,
  not an accuracy defect (``err_basis`` says ``... (other op)``).

The FLOP and byte models behind ``gflop``, ``gb_moved``, ``gflops`` and ``gbps`` are described in
:mod:`solattn.bench.models` (and in every ``bench.md``).

Input data: ``x = 0.5 * randn + 2 * block_offset`` (``randn`` per token, ``block_offset`` ``randn``
per 64-token block and (b, h)), fixed seed. Block-level logits then spread with a standard deviation
of about 4 whatever D is, so attention concentrates on few key blocks as in the video models the
operator serves, routing is meaningful, and a 10-20 % selection keeps most of the attention mass.

Outputs in ``--out`` (default: ``$SOLATTN_BENCH_DIR/<device>-<date>-<time>``, else
``~/solattn-bench/<device>-<date>-<time>``; the folder is printed): ``bench.csv``, ``bench.md`` (environment, models, table) and ``bench.png``
(time against T, log-log, one line per backend / ratio / tail; skipped without matplotlib).

Modules: :mod:`~solattn.bench.parsing` (options, presets, :class:`Config`),
:mod:`~solattn.bench.timing` (synchronise, time calls, progress log),
:mod:`~solattn.bench.memory` (peak memory), :mod:`~solattn.bench.models` (FLOP and byte models),
:mod:`~solattn.bench.runner` (inputs, error basis, the timed rounds) and
:mod:`~solattn.bench.report` (tables, CSV, Markdown, plot).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ..backends import reference as reference_module
from .memory import measure_peak
from .models import BYTE_MODELS, bytes_moved, flop_count
from .parsing import (DENSE, DTYPE_NAMES, DTYPES, PRESETS, ArgParser, Config, UsageError,
                      build_parser, parse_device, parse_shapes, resolve)
from .report import (COLUMNS, LEGEND, environment, legend_lines, markdown_table, text_table, write_csv,
                     write_markdown, write_plot)
from .runner import _shape_str, make_inputs, rel_l2, run
from .timing import flush_l2, log, paired_rounds, ratio_summary, reset_clock, synchronize, time_calls


def main(argv: Optional[Sequence[str]] = None) -> int:
    reset_clock()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = resolve(args)
        os.makedirs(cfg.out, exist_ok=True)   # before minutes of timing, not after
    except UsageError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"--out received {cfg.out!r}, where no folder can be made ({exc.strerror or exc}); "
                     "allowed: a writable folder path")
    if cfg.vsa:
        return _main_vsa(cfg)
    log("; ".join([f"device {cfg.device}", f"dtype {DTYPE_NAMES[cfg.dtype]}",
                   "shapes " + " ".join(_shape_str(s) for s in cfg.shapes),
                   "ratios " + ", ".join(f"{r:g}" for r in cfg.ratios),
                   "tail " + ("off+on" if len(cfg.tails) > 1 else "off"),
                   "backends " + ", ".join(([DENSE] if cfg.with_dense else []) + cfg.backends),
                   "error basis the reference backend where it fits its memory budget of "
                   f"{reference_module.budget.bytes / 2**30:.1f} GiB, else sdpa on fp32 copies"]))
    log(f"results go to {os.path.abspath(cfg.out)}")
    if not cfg.with_dense and not cfg.backends:
        log("nothing to time")
        return 2
    rows = run(cfg)
    csv_path = os.path.join(cfg.out, "bench.csv")
    md_path = os.path.join(cfg.out, "bench.md")
    png_path = os.path.join(cfg.out, "bench.png")
    write_csv(rows, csv_path)
    note = write_plot(rows, png_path, cfg) if cfg.plot and rows else ("no plot (--no-plot)" if rows else "")
    if note:
        log(note)
    write_markdown(rows, cfg, md_path, note)
    print(text_table(rows))
    if rows:
        import shutil
        print("\n".join(legend_lines(shutil.get_terminal_size((100, 24)).columns)))
    for s in cfg.skipped_lines():
        print(f"not run: {s}")
    print(f"\nwrote {os.path.abspath(csv_path)}, {os.path.abspath(md_path)}" + ("" if note else f", {os.path.abspath(png_path)}"))
    return 0 if rows else 1


def _main_vsa(cfg: Config) -> int:
    """``--shapes vsa``: video_sparse_attn problems (:mod:`solattn.bench.vsa`)."""
    from . import vsa
    log(f"device {cfg.device}, dtype {DTYPE_NAMES[cfg.dtype]}, video_sparse_attn problems "
        + "; ".join(p.label for p in cfg.vsa) + (", forward and forward + backward" if cfg.backward else ""))
    log(f"results go to {os.path.abspath(cfg.out)}")
    rows = vsa.run_vsa(cfg)
    csv_path, md_path = os.path.join(cfg.out, "bench.csv"), os.path.join(cfg.out, "bench.md")
    write_csv(rows, csv_path, vsa.COLUMNS)
    with open(md_path, "w") as f:
        f.write(vsa.markdown(rows, cfg, environment(cfg)))
    print(vsa.text_table(rows))
    for s in cfg.skipped_lines():
        print(f"not run: {s}")
    print(f"\nwrote {os.path.abspath(csv_path)}, {os.path.abspath(md_path)}")
    return 0 if rows else 1


__all__ = ["main", "run", "resolve", "build_parser", "parse_shapes", "Config", "PRESETS", "DTYPES",
           "DTYPE_NAMES", "DENSE", "ArgParser", "UsageError", "parse_device", "COLUMNS", "BYTE_MODELS", "time_calls", "measure_peak", "make_inputs",
           "flop_count", "bytes_moved", "rel_l2", "synchronize", "flush_l2", "paired_rounds", "ratio_summary", "log", "reset_clock", "environment",
           "text_table", "LEGEND", "legend_lines", "markdown_table", "write_csv", "write_markdown", "write_plot"]
