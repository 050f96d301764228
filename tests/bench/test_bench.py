"""``solattn.bench``: the benchmark behind ``python -m solattn bench`` runs, writes its files, and its
numbers are measured, finite and accurate."""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path

import pytest

import solattn
from solattn import bench


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


#: the contenders of the runs below that test the command, not the backends: the flex backend
#: would compile each shape first (tens of seconds on a small CPU)
NO_COMPILE = ("--backends", "dense", "sdpa")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = bench.main(["--quick", "--out", str(out), "--device", "cpu"])
    with open(os.path.join(out, "bench.csv")) as f:
        rows = list(csv.DictReader(f))
    return rc, out, rows


@pytest.mark.slow
def test_quick_writes_csv_markdown_and_plot(quick_run):
    rc, out, rows = quick_run
    assert rc == 0
    for name in ("bench.csv", "bench.md", "bench.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "bench.csv")) as f:
        assert next(csv.reader(f)) == bench.COLUMNS
    md = Path(out, "bench.md").read_text()
    assert "| backend |" in md and "two-number model" in md
    assert "flex" not in {r["backend"] for r in rows} and "- flex: left out by --quick" in md


@pytest.mark.slow
def test_quick_rows_cover_dense_and_portable(quick_run):
    _, _, rows = quick_run
    shapes = {(r["B"], r["T"], r["H"], r["D"]) for r in rows}
    assert len(shapes) == len(bench.PRESETS["quick"])
    for backend in ("dense", "sdpa"):
        got = [r for r in rows if r["backend"] == backend]
        assert len(got) == len(shapes) * 2, backend          # ratios 0.1 and 0.2, tail off
        assert {float(r["ratio"]) for r in got} == {0.1, 0.2}
        assert all(r["tail"] == "False" for r in got)
    assert "reference" not in {r["backend"] for r in rows}  # the oracle is the basis, never timed


def test_quick_leaves_compiling_flex_out_unless_named():
    """--quick is a smoke test of seconds: flex, whose first call of each shape compiles (tens of
    seconds on a small CPU), is left out and the report says so and how to time it."""
    cfg = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu"]))
    assert "flex" not in cfg.backends and "sdpa" in cfg.backends
    named = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu", "--backends", "dense", "flex"]))
    assert named.backends == ["flex"] and not named.skipped
    assert [line for line in cfg.skipped_lines() if line.startswith("flex: ") and "--backends" in line]


@pytest.mark.slow
def test_quick_numbers_finite_positive_and_accurate(quick_run):
    _, _, rows = quick_run
    for r in rows:
        for col in ("time_ms", "speedup", "gflop", "gb_moved", "gflops", "gbps", "kept_fraction"):
            x = float(r[col])
            assert math.isfinite(x) and x > 0, (col, r)
        assert 0 < float(r["kept_fraction"]) <= 1
        assert r["peak_basis"] in ("rss>=", "n/a")
        if r["peak_basis"] == "rss>=":
            assert math.isfinite(float(r["peak_mib"])) and float(r["peak_mib"]) >= 0
        else:
            assert r["peak_mib"] == ""                       # never a number that was not measured
        err = float(r["rel_l2"])
        assert math.isfinite(err) and err >= 0
        if r["backend"] == "dense":
            assert r["err_basis"].endswith("(other op)")
            assert float(r["speedup"]) == 1.0
        else:
            assert r["err_basis"] == "reference"             # the quick problems fit the reference
            assert err < 2e-2, r                             # bf16 against the fp32 definition
            assert float(r["plan_ms"]) > 0
            assert float(r["kept_fraction"]) < 1             # sparse rows count kept blocks only


def test_flop_and_byte_models():
    shape = (1, 8192, 16, 128)
    n = 8192 // 64
    assert bench.flop_count(shape, None) == 4 * 16 * 8192 ** 2 * 128
    pairs = 16 * n * n                                        # every block kept: same FLOPs as dense
    assert bench.flop_count(shape, pairs) == bench.flop_count(shape, None)
    N = 8192 * 16 * 128
    assert bench.bytes_moved(shape, 2, None, "dense") == 2 * 4 * N
    assert bench.bytes_moved(shape, 2, 10, "sdpa") == 2 * (9 * N + 6 * 10 * 64 * 128)
    assert bench.bytes_moved(shape, 2, 10, "fused") == 2 * (5 * N + 2 * 10 * 64 * 128)


def test_parse_shapes_presets_and_tuples():
    assert bench.parse_shapes(["1,4096,16,128"]) == [(1, 4096, 16, 128)]
    assert bench.parse_shapes(["seed", "2,4056,16,128"]) == [(2, 4056, 16, 128)]   # duplicates dropped
    assert bench.parse_shapes(["h3"]) == [(1, 37296, 56, 128)]
    assert bench.parse_shapes(["cpu"])[-1] == (1, 8192, 16, 128)
    with pytest.raises(Exception, match="B,T,H,D"):
        bench.parse_shapes(["1,2,3"])


def test_help_works(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--device", "--dtype", "--shapes", "--ratios", "--tail", "--repeats", "--warmup",
                "--out", "--quick", "--backends", "--coarse-gate"):
        assert opt in text, opt


@pytest.mark.parametrize("argv,option,value", [
    (["--backends", "nonesuch"], "--backends", "nonesuch"),
    (["--shapes", "1,100,2"], "--shapes", "'1,100,2'"),
    (["--shapes", "1,0,2,8"], "--shapes", "'1,0,2,8'"),
    (["--ratios", "0.1", "1.5"], "--ratios", "1.5"),
    (["--repeats", "0"], "--repeats", "0"),
    (["--warmup", "0"], "--warmup", "0"),
    (["--device", "nonesuch"], "--device", "'nonesuch'"),
    (["--graphs"], "--graphs", "cpu"),
])
def test_bad_options_are_one_line_usage_errors(argv, option, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("python -m solattn bench: error: ") and option in err and value in err
    assert "allowed" in err
    assert not (tmp_path / "out").exists()                                # refused before any work


def test_unwritable_out_is_refused_before_timing(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--device", "cpu", "--out", str(blocker / "sub")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(blocker / "sub") in err and "making inputs" not in err


def test_tail_and_coarse_gate_rows(tmp_path):
    rc = bench.main(["--device", "cpu", "--shapes", "1,192,1,32", "--ratios", "0.3", "--tail",
                     "--coarse-gate", "--backends", "sdpa", "--repeats", "1", "--no-plot",
                     "--out", str(tmp_path)])
    assert rc == 0
    rows = _csv_rows(tmp_path / "bench.csv")
    assert [r["backend"] for r in rows] == ["sdpa", "sdpa"]              # dense left out on request
    assert {r["tail"] for r in rows} == {"False", "True"}                # --tail adds tail rows
    assert all(r["coarse_gate"] == "True" and r["speedup"] == "" for r in rows)
    assert all(float(r["rel_l2"]) < 2e-2 for r in rows)
    assert not (tmp_path / "bench.png").exists()


def test_tau_mode_rows_and_peers_not_run_say_why(tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--shapes", "1,256,2,32", "--ratios", "0", "0.2", "--tau", "0.5",
                     "--tail", "--backends", "sdpa", "comfy-kitchen", "--repeats", "1", "--no-plot",
                     "--out", str(tmp_path)])
    assert rc == 0
    rows = _csv_rows(tmp_path / "bench.csv")
    tau_rows = [r for r in rows if float(r["ratio"]) == 0]
    assert len(tau_rows) == 2 and all(float(r["tau"]) == 0.5 for r in tau_rows)
    assert all(r["tau"] == "" for r in rows if float(r["ratio"]) > 0)
    # tau 0.5 keeps a different fraction of blocks than top-k 0.2, and both match the reference
    assert {r["kept_fraction"] for r in tau_rows}.isdisjoint({r["kept_fraction"] for r in rows if r not in tau_rows})
    assert all(float(r["rel_l2"]) < 2e-2 for r in rows)
    md = (tmp_path / "bench.md").read_text()
    assert "| tau 0.5 |" in md and "| top-k 0.2 |" in md
    out = capsys.readouterr().out
    assert "not run: comfy-kitchen: its fused kernel runs on CUDA only" in out


# ------------------------------------------------------------- the table, the plot and the log agree

def _table(text):
    """The terminal table's rows as ``{header: cell}``, cut at the columns of its dashed line."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    spans, col = [], 0
    for dashes in lines[i].split("  "):
        spans.append((col, col + len(dashes)))
        col += len(dashes) + 2
    cut = lambda line: [line[a:b].strip() for a, b in spans]  # noqa: E731
    head = cut(lines[i - 1])
    rows = []
    for line in lines[i + 1:]:
        if not line.strip() or line.startswith("Columns:"):       # the legend follows the table
            break
        rows.append(dict(zip(head, cut(line))))
    return rows


def _printed_close(value, cell):
    """``value`` printed with 4 significant digits gives ``cell`` (within its last digit's half)."""
    x = float(cell)
    return abs(value - x) <= 0.5 * 10 ** (math.floor(math.log10(x)) - 3) * 1.0001


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """Two lengths, two ratios, tail off and on; dense, sdpa and triton (not run on the CPU); what
    the plot draws is recorded from the figure as it is saved."""
    pytest.importorskip("matplotlib")
    import contextlib
    import io

    from matplotlib.figure import Figure
    out = tmp_path_factory.mktemp("grid")
    drawn = {}
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        for line in fig.axes[0].lines:
            drawn[line.get_label()] = list(zip(line.get_xdata(), line.get_ydata()))
        return save(fig, *args, **kwargs)

    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        mp.setattr(Figure, "savefig", record)
        rc = bench.main(["--device", "cpu", "--shapes", "1,64,1,16", "1,128,1,16", "--ratios", "0.1", "0.5",
                         "--tail", "--backends", "dense", "sdpa", "triton", "--repeats", "3", "--out", str(out)])
    assert rc == 0
    return _table(stdout.getvalue()), drawn, stderr.getvalue(), _csv_rows(out / "bench.csv")


def test_plot_draws_the_table_s_numbers(grid_run):
    """Every point of the plot is one row of the table (same backend, routing, tail and T, the same
    time), and every row of the table is a point: dense included, one dense line per rounds group."""
    table, drawn, _, _ = grid_run
    assert len(table) == 2 * 2 * 2 * 2                       # T x ratio x tail x (dense, sdpa)
    plotted = []
    for label, points in drawn.items():
        backend = "dense" if label.startswith("dense SDPA") else label.split()[0]
        ratio = re.search(r"r=([0-9.]+)", label)
        assert ratio, f"the line {label!r} does not say which routing it belongs to"
        for t, ms in points:
            plotted.append((backend, int(t), f"top-k {ratio.group(1)}", "on" if "tail" in label else "off", ms))
    rows = {(r["backend"], int(r["shape BxTxHxD"].split("x")[1]), r["routing"], r["tail"]): r["time ms"]
            for r in table}
    assert len(rows) == len(table) == len(plotted)
    assert {p[:4] for p in plotted} == set(rows)
    for *key, ms in plotted:
        assert _printed_close(ms, rows[tuple(key)]), (key, ms, rows[tuple(key)])


def test_each_ratio_is_the_quotient_of_the_times_beside_it(grid_run):
    table, _, _, csv_rows = grid_run
    dense = {(r["shape BxTxHxD"], r["routing"], r["tail"]): float(r["time ms"]) for r in table
             if r["backend"] == "dense"}
    for r in table:
        shown = float(r["vs dense"].rstrip("x"))
        if r["backend"] == "dense":
            assert r["vs dense"] == "1.00x"
            continue
        quotient = dense[r["shape BxTxHxD"], r["routing"], r["tail"]] / float(r["time ms"])
        # two times rounded to 4 digits, the ratio to 2 decimals
        assert abs(shown - quotient) <= 0.005 + 1.2e-3 * quotient, (r, quotient)
    dense_ms = {(r["T"], r["ratio"], r["tail"]): float(r["time_ms"]) for r in csv_rows if r["backend"] == "dense"}
    for r in csv_rows:                                       # unrounded, in the CSV: exactly that quotient
        assert float(r["speedup"]) == pytest.approx(dense_ms[r["T"], r["ratio"], r["tail"]] / float(r["time_ms"]),
                                                    rel=1e-12)


def test_progress_header_items_apart_and_a_skip_said_once(grid_run):
    _, _, log, _ = grid_run
    header = log.splitlines()[0].split("] ", 1)[1]
    items = header.split("; ")
    assert "backends dense, sdpa, triton" in items, items
    assert any(item.startswith("error basis") and "GiB" in item for item in items), items
    # triton cannot run on the CPU: said once in the log, once in the summary, not per problem
    assert log.count("triton skipped") == 1, log


def test_plot_skipped_without_matplotlib(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)                  # import fails
    cfg = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu"]))
    row = dict(backend="dense", B=1, T=64, H=1, D=16, ratio=0.1, tail=False, time_ms=1.0)
    note = bench.write_plot([row], str(tmp_path / "x.png"), cfg)
    assert "matplotlib" in note and not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------- Windows and macOS

def test_no_module_level_posix_only_imports():
    """``resource`` and ``fcntl`` do not exist on Windows: no solattn module imports them at load."""
    import ast
    import pathlib

    root = pathlib.Path(bench.__file__).resolve().parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:          # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in ("resource", "fcntl")]
    assert not offenders


@pytest.mark.slow
def test_runs_without_resource_and_getloadavg(monkeypatch, tmp_path):
    """What Windows lacks (``resource``, ``os.getloadavg``) only removes figures, never the run."""
    import sys

    from solattn.bench import memory
    monkeypatch.setitem(sys.modules, "resource", None)                    # import resource fails
    monkeypatch.delattr(os, "getloadavg", raising=False)
    assert memory._maxrss_bytes() is None
    rc = bench.main(["--device", "cpu", "--shapes", "1,128,1,32", "--ratios", "0.5", "--repeats", "1",
                     "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    rows = _csv_rows(tmp_path / "bench.csv")
    runnable = {b["name"] for b in solattn.list_backends("cpu") if b["available"]} - {"reference"}
    assert "sdpa" in runnable and {r["backend"] for r in rows} == {"dense"} | runnable   # flex where it compiles
    assert all(r["peak_basis"] == "rss>=" and float(r["peak_mib"]) >= 0 for r in rows)   # sampler alone
    md = (tmp_path / "bench.md").read_text()
    assert "load average" not in md and "| backend |" in md


def test_peak_memory_without_proc_is_not_a_number(monkeypatch):
    """No ``/proc`` (Windows, macOS): the call still runs and returns its output; no figure is made up."""
    import torch

    from solattn.bench import memory
    monkeypatch.setattr(memory, "_rss_bytes", lambda: None)
    x = torch.arange(6.0)
    out, mib, basis = bench.measure_peak(lambda: x * 2, torch.device("cpu"))
    assert torch.equal(out, x * 2) and mib is None and basis == "n/a"


def test_peak_memory_sees_a_large_allocation():
    import torch

    n = 64 << 20                                                         # 64 MiB, touched
    _, mib, basis = bench.measure_peak(lambda: torch.ones(n, dtype=torch.uint8), torch.device("cpu"))
    if basis == "n/a":
        pytest.skip("no /proc here")
    assert basis == "rss>=" and 60 <= mib < 200, mib


# --------------------------------------------------------------------------- benchmarks/run.py

def _runner():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_keeps_the_latest_result_with_commit_and_command(tmp_path, monkeypatch, capsys):
    """``benchmarks/run.py NAME`` writes ``<results>/<device>/NAME.md``: the commit, the command and
    the benchmark's own table; a second run replaces the first."""
    run = _runner()
    monkeypatch.setenv("SOLATTN_REVISION", "abc1234")
    argv = ["forward", "--results", str(tmp_path), "--", "--device", "cpu", "--shapes", "1,128,1,32",
            "--ratios", "0.5", "--repeats", "1", "--no-plot", *NO_COMPILE]
    assert run.main(argv) == 0
    folder = run.device_folder()        # this machine's folder name: cpu, or its GPU's model
    path = tmp_path / folder / "forward.md"
    first = path.read_text()
    assert "- commit: abc1234" in first and "- exit status: 0" in first
    assert "`python benchmarks/run.py forward --results" in first
    assert "(runs `python -m solattn bench --out OUT --device cpu --shapes 1,128,1,32" in first
    assert "| sdpa | 1x128x1x32 | top-k 0.5 |" in first
    monkeypatch.setenv("SOLATTN_REVISION", "def5678")
    assert run.main(argv) == 0
    assert [p.name for p in (tmp_path / folder).iterdir()] == ["forward.md"]
    assert "- commit: def5678" in path.read_text()


def test_runner_lists_and_refuses_unknown_names(capsys):
    run = _runner()
    assert run.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("forward", "peers", "backward", "plan", "vsa", "distributed"):
        assert f"\n{name} " in "\n" + listed, name
    with pytest.raises(SystemExit) as exc:
        run.main(["nonesuch"])
    assert exc.value.code == 2 and "NAME received 'nonesuch'; allowed: forward" in capsys.readouterr().err


def test_paired_rounds_time_every_contender_in_rotating_order():
    import torch

    calls = []
    times = bench.paired_rounds({n: (lambda n=n: calls.append(n)) for n in "abc"}, torch.device("cpu"),
                                rounds=3, warmup=1)
    assert calls[:3] == list("abc")                                   # warm-up, once each
    assert calls[3:] == list("abc") + list("bca") + list("cab")
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(x >= 0 for t in times.values() for x in t)
    assert bench.ratio_summary([4.0, 6.0, 9.0], [2.0, 2.0, 3.0]) == "3.00x (2.00-3.00)"


def test_terminal_table_explains_its_columns(tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--shapes", "1,128,1,32", "--ratios", "0.5", "--repeats", "1",
                     "--no-plot", "--out", str(tmp_path), *NO_COMPILE])
    assert rc == 0
    out = capsys.readouterr().out
    table, legend = out.split("Columns:", 1)
    assert "(other op)" in table and "≥" in table              # what the legend has to explain
    flat = " ".join(legend.split())
    assert "(other op)\" on the dense row: dense attention is compared with the sparse operator" in flat
    assert "a leading ≥ marks CPU resident-set sampling, a lower bound" in flat
    for head in ("time ms", "plan ms", "vs dense", "peak MiB", "rel. L2", "kept"):
        assert f"\n  {head} " in legend, head
    md = (tmp_path / "bench.md").read_text()
    assert "- `peak MiB`: extra memory" in md                   # the same legend in bench.md


def test_timed_rounds_rotate_the_order():
    """Every contender leads once per cycle of rounds and each round holds every contender once."""
    from solattn.bench.runner import round_order
    names = ["dense", "triton", "sdpa", "comfy-kitchen"]
    orders = [round_order(names, r) for r in range(len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names
    assert round_order(names, len(names)) == names and round_order([], 3) == []


def test_plan_time_excludes_the_first_call(monkeypatch, tmp_path):
    """``plan ms`` is timed after an untimed call, as every contender is: a first call pays one-off
    costs (the fused plan's Triton kernels compile on it), which a median of the one or two timed
    plan calls of ``--repeats 1`` / ``--quick`` would otherwise report as the plan's time. The
    timing module reads a simulated clock that the first plan call moves by 300 ms and every later
    one by 1 ms (every other reading by 1 us), so the figure is exact, whatever the machine's load."""
    import types

    from solattn.bench import runner, timing
    clock, calls, real = [0.0], [], runner.plan_for

    def perf_counter():
        clock[0] += 1e-6
        return clock[0]

    def plan_for(backend, problem):
        calls.append(backend.name)
        clock[0] += 0.3 if len(calls) == 1 else 0.001      # a first call that compiles, then cheap ones
        return real(backend, problem)

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(runner, "plan_for", plan_for)
    rc = bench.main(["--device", "cpu", "--shapes", "1,128,1,32", "--ratios", "0.5", "--repeats", "1",
                     "--backends", "sdpa", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    (row,) = [r for r in _csv_rows(tmp_path / "bench.csv") if r["backend"] == "sdpa"]
    assert len(calls) >= 2
    assert 1.0 <= float(row["plan_ms"]) < 1.1, row["plan_ms"]


def test_default_out_is_per_user_never_the_working_directory(monkeypatch, tmp_path):
    """Without ``--out`` results go under ``$SOLATTN_BENCH_DIR`` or ``~/solattn-bench``, one
    folder per run named by device and time, whatever directory the command runs in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOLATTN_BENCH_DIR", str(tmp_path / "mine"))
    cfg = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu"]))
    assert Path(cfg.out).parent == tmp_path / "mine" and Path(cfg.out).name.startswith("cpu-")
    monkeypatch.delenv("SOLATTN_BENCH_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("USERPROFILE", str(tmp_path / "home"))
    cfg = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu"]))
    assert Path(cfg.out).parent == tmp_path / "home" / "solattn-bench"


def test_run_prints_where_results_went(tmp_path, capsys):
    out = tmp_path / "where"
    assert bench.main(["--quick", "--device", "cpu", "--no-plot", "--shapes", "1,128,1,16", "--ratios", "0.5",
                       "--out", str(out), *NO_COMPILE]) == 0
    captured = capsys.readouterr()
    assert f"results go to {out.resolve()}" in captured.err
    assert str((out / "bench.md").resolve()) in captured.out and (out / "bench.md").stat().st_size > 0
