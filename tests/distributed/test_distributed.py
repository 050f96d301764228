"""solattn.distributed on the CPU: 2 Gloo processes against single-process results.

The module-scoped fixture starts this file as a script in 2 processes (a file:// rendezvous,
a time limit on the whole run); each runs every case of ``CASES`` on its shard and saves its
output shard, gradient shards, errors and the number of collectives it issued. The tests
rebuild the whole inputs from the same seeds, run the single-device function in this process
and compare.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # worker: import this checkout's package
    sys.path.insert(0, str(ROOT))

import solattn  # noqa: E402
import solattn.distributed as sd  # noqa: E402
from solattn.distributed.exchange import head_groups  # noqa: E402
from solattn.distributed.pipeline import DEFAULT_HEAD_GROUPS  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2, tolerance  # noqa: E402

WORLD = 2
RUN_TIMEOUT_S = 240  # both processes, every case; a healthy run takes ~15 s on a busy 2-core machine

# name -> case. kind: "sol" (solattn.sol_attn) or "vsa" (video_sparse_attn). lens: per-rank shard
# lengths (default: shard_lengths); pass_lens: also give them as shard_lens=; head_groups: passed
# on (default: the module's default).
CASES = {
    "topk": dict(kind="sol", B=1, T=300, H=4, D=16, head_groups=1, kwargs=dict(topk_ratio=0.25, tail=True)),
    "tau_tail_ragged": dict(kind="sol", B=1, T=333, H=4, D=16, key_bias="float1d",
                            kwargs=dict(tau=0.5, tail=True)),
    "bf16_topk_no_tail": dict(kind="sol", B=1, T=256, H=2, D=32, dtype=torch.bfloat16,
                              kwargs=dict(topk_ratio=0.3, tail=False)),
    "gate_bias_block_len": dict(kind="sol", B=2, T=260, H=4, D=16, gate=True, key_bias="bool2d",
                                block_len=True, kwargs=dict(topk_ratio=0.3, sink_blocks=(0, 1))),
    "uneven_lens_given": dict(kind="sol", B=1, T=200, H=2, D=16, lens=[37, 163], pass_lens=True,
                              gate=True, kwargs=dict(topk_ratio=0.4)),
    "gate_fp32_q_bf16": dict(kind="sol", B=1, T=200, H=2, D=32, dtype=torch.bfloat16, gate=True,
                             gate_dtype=torch.float32, kwargs=dict(topk_ratio=0.25)),
    "empty_shard": dict(kind="sol", B=1, T=50, H=2, D=16, lens=[50, 0], kwargs=dict(tau=0.0)),
    "grad_sol": dict(kind="sol", B=1, T=200, H=4, D=16, lens=[130, 70], gate=True,
                     key_bias="bool2d", grad=True, kwargs=dict(topk_ratio=0.25)),
    "vsa_prefix_gate": dict(kind="vsa", B=1, T=127, H=2, D=16, gate=True,
                            kwargs=dict(grid=(3, 6, 5), prefix_len=37, topk=2)),
    "vsa_prefix_cut": dict(kind="vsa", B=1, T=127, H=4, D=16, lens=[20, 107],
                           kwargs=dict(grid=(3, 6, 5), prefix_len=37, sparsity=0.5)),
    "grad_vsa": dict(kind="vsa", B=1, T=127, H=2, D=16, gate=True, grad=True, lens=[90, 37],
                     kwargs=dict(grid=(3, 6, 5), prefix_len=37, topk=2)),
    "err_heads": dict(kind="sol", B=1, T=128, H=3, D=16, kwargs=dict(topk_ratio=0.25)),
    "err_mismatch": dict(kind="sol", B=1, T=128, H=2, D=16, D_rank1=8, kwargs=dict(topk_ratio=0.25)),
    "err_key_bias_sharded": dict(kind="sol", B=1, T=128, H=2, D=16, key_bias="sharded",
                                 kwargs=dict(topk_ratio=0.25)),
    "err_shard_lens": dict(kind="sol", B=1, T=128, H=2, D=16, bad_shard_lens=[60, 68],
                           kwargs=dict(topk_ratio=0.25)),
    "err_vsa_grid": dict(kind="vsa", B=1, T=127, H=2, D=16, kwargs=dict(grid=(3, 6, 6), prefix_len=37, topk=2)),
    # a float key_bias requiring grad: every rank must get the whole gradient
    "grad_key_bias": dict(kind="sol", B=2, T=200, H=6, D=16, key_bias="float2d", grad=True, gate=True,
                          head_groups=2, kwargs=dict(topk_ratio=0.3, tail=True)),
    # one rank's arguments refused or different from its peers' ("rank1": what rank 1 passes instead)
    "err_heads_one_rank": dict(kind="sol", B=1, T=128, H=2, D=16, rank1=dict(H=3), kwargs=dict(topk_ratio=0.25)),
    "err_tau_nan_one_rank": dict(kind="sol", B=1, T=128, H=2, D=16, rank1=dict(kwargs=dict(tau=float("nan"))),
                                 kwargs=dict(tau=1.0)),
    "err_tau_nan": dict(kind="sol", B=1, T=128, H=2, D=16, kwargs=dict(tau=float("nan"))),
    "err_topk_differs": dict(kind="sol", B=1, T=128, H=2, D=16, rank1=dict(kwargs=dict(topk_ratio=0.6)),
                             kwargs=dict(topk_ratio=0.3)),
    "err_key_bias_one_rank": dict(kind="sol", B=1, T=128, H=2, D=16, key_bias="float1d",
                                  rank1=dict(key_bias="sharded"), kwargs=dict(topk_ratio=0.25)),
    "err_key_bias_values": dict(kind="sol", B=1, T=128, H=2, D=16, key_bias="float1d",
                                rank1=dict(key_bias="float1d_other"), kwargs=dict(topk_ratio=0.25)),
    "err_prefix_differs": dict(kind="vsa", B=1, T=130, H=2, D=16,
                               rank1=dict(kwargs=dict(grid=(3, 6, 5), prefix_len=[20, 20], topk=2)),
                               kwargs=dict(grid=(3, 6, 5), prefix_len=40, topk=2)),
    "err_shard_lens_disagree": dict(kind="sol", B=1, T=128, H=2, D=16, lens=[60, 68], pass_lens=True,
                                    rank1=dict(shard_lens=[50, 68]), kwargs=dict(topk_ratio=0.25)),
    "err_head_groups_differ": dict(kind="sol", B=1, T=128, H=4, D=16, head_groups=2, rank1=dict(head_groups=1),
                                   kwargs=dict(topk_ratio=0.25)),
    "err_autograd_differs": dict(kind="sol", B=1, T=128, H=2, D=16, rank1=dict(grad=True),
                                 kwargs=dict(topk_ratio=0.25)),
}
ERROR_BOUND_S = 15   # every rank raises within this (the worker's process-group timeout is longer)
PG_TIMEOUT_S = 45


def case_lens(case):
    return case.get("lens") or sd.shard_lengths(case["T"], WORLD)


def case_inputs(case, D=None):
    """The whole inputs of a case: q, k, v, gate, key_bias, block_len, loss weight."""
    B, T, H = case["B"], case["T"], case["H"]
    D = D or case["D"]
    dtype = case.get("dtype", torch.float32)
    q, k, v = block_structured_qkv(B, T, H, D, dtype, seed=sum(map(ord, str(sorted(case)))) % 1000,
                                   spread=3.0, key_offset=4.0, normalise=True)
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(B, T, H, D, generator=g).to(case.get("gate_dtype", dtype)) if case.get("gate") else None
    kb = None
    if case.get("key_bias") == "float1d":
        kb = torch.randn(T, generator=g)
    elif case.get("key_bias") == "float1d_other":
        kb = torch.randn(T, generator=g) + 1.0
    elif case.get("key_bias") == "float2d":
        kb = torch.randn(B, T, generator=g)
    elif case.get("key_bias") == "bool2d":
        kb = torch.rand(B, T, generator=g) > 0.2
        kb[:, :64] = True                        # every row keeps at least its own first block
    block_len = None
    if case.get("block_len"):
        n = -(-T // 64)
        block_len = torch.randint(20, 65, (n,), generator=g, dtype=torch.int32)
    w = torch.randn(B, T, H, D, generator=g)
    return q, k, v, gate, kb, block_len, w


def call(mod, case, q, k, v, gate, kb, block_len, **extra):
    kw = dict(case["kwargs"])
    if case["kind"] == "sol":
        return mod.sol_attn(q, k, v, key_bias=kb, block_len=block_len, coarse_gate=gate, **kw, **extra)
    grid = kw.pop("grid")
    return mod.video_sparse_attn(q, k, v, grid, gate=gate, **kw, **extra)


# ---------------------------------------------------------------------------------- the workers

def run_case(case, rank, counts):
    import time

    import torch.distributed as dist

    D = case.get("D_rank1") if rank == 1 and case.get("D_rank1") else None
    if rank == 1 and "rank1" in case:
        case = dict(case, **case["rank1"])
    q, k, v, gate, kb, block_len, w = case_inputs(case, D)
    if case.get("grad") and kb is not None and kb.dtype.is_floating_point:
        kb.requires_grad_(True)
    lens = case_lens(case)
    sl = slice(sum(lens[:rank]), sum(lens[:rank + 1]))
    if case.get("key_bias") == "sharded":
        kb = torch.ones(q.shape[1], dtype=torch.bool)[sl]
    shards = [None if x is None else x[:, sl].clone().requires_grad_(bool(case.get("grad")))
              for x in (q, k, v, gate)]
    extra = {"shard_lens": case.get("shard_lens", lens)} if case.get("pass_lens") else {}
    if case.get("head_groups"):
        extra["head_groups"] = case["head_groups"]
    if case.get("bad_shard_lens"):
        extra["shard_lens"] = case["bad_shard_lens"]
    counts.clear()
    res = {}
    t0 = time.perf_counter()
    try:
        out = call(sd, case, *shards, kb, block_len, **extra)
    except Exception as err:  # noqa: BLE001 - recorded for the test to inspect
        res["elapsed"] = time.perf_counter() - t0
        res["error"] = (type(err).__name__, str(err))
        res["collectives"] = dict(counts)
        alive = torch.ones(1)
        dist.all_reduce(alive)   # both ranks must still be in step after the error
        res["alive"] = alive.item()
        return res
    res["collectives"] = dict(counts)
    res["out"] = out.detach()
    if case.get("grad"):
        (out.float() * w[:, sl]).sum().backward()
        res["grads"] = [None if x is None else x.grad for x in shards]
        if kb is not None and kb.requires_grad:
            res["key_bias_grad"] = kb.grad
    return res


def worker(rank, init_file, outdir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("SOLATTN_TEST_AMX") == "1":
        # the workers run as on a CPU with AMX and the automatic CPU rule left alone (where flex
        # comes first for compiled shapes); the single-device runs they are compared with run
        # in the test process, without: the same results on both kinds of CPU
        torch.cpu._is_amx_tile_supported = lambda: True
        os.environ.pop("SOLATTN_FLEX_CPU", None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    counts = {}
    for name in ("all_gather", "all_to_all_single"):       # count the collectives each call issues
        def counted(*a, _f=getattr(dist, name), _n=name, **kw):
            counts[_n] = counts.get(_n, 0) + 1
            return _f(*a, **kw)
        setattr(dist, name, counted)
    for name, case in CASES.items():
        torch.save(run_case(case, rank, counts), os.path.join(outdir, f"{name}.{rank}.pt"))
    # a group whose backend has no Gloo (NCCL, XCCL): the agreement runs on a Gloo group of its ranks
    from solattn.distributed import agree
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        res = run_case(CASES["topk"], rank, counts)
    finally:
        dist.get_backend = real
    res["host_group"] = [g is not None and g is not dist.group.WORLD for _, g in agree._HOST_GROUPS]
    torch.save(res, os.path.join(outdir, f"side_group.{rank}.pt"))
    # not barrier + destroy_process_group + a normal exit: Gloo's threads can then abort the
    # finished process at interpreter shutdown (SIGABRT, seen in CI); see destroy_and_exit
    from solattn import distributed as sd
    sd.destroy_and_exit(0)


# ---------------------------------------------------------------------------------- the tests

def _launch(script_args, timeout, cwd=ROOT, world=WORLD, check=True):
    """Start ``world`` processes (``script_args(rank)``) and wait for all of them, at most
    ``timeout`` seconds in all (then kill them and fail). Returns each one's (return code,
    stdout, stderr); with ``check`` every one must exit with status 0."""
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, *script_args(rank)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append((p,) + p.communicate(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        tails = []
        for rank, p in enumerate(procs):
            p.kill()
            o, e = p.communicate()
            tails.append(f"rank {rank} (rc {p.returncode}): {(o + e)[-1500:]}")
        raise AssertionError(f"distributed workers did not finish within {timeout} s:\n" + "\n".join(tails)) from None
    if check:
        for p, o, e in outs:
            assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{o}\n{e}"
    return [(p.returncode, o, e) for p, o, e in outs]



@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SOLATTN_TEST_AMX", "1")
            _launch(lambda r: [__file__, "--worker", str(r), init_file, tmp], RUN_TIMEOUT_S)
        yield {name: [torch.load(os.path.join(tmp, f"{name}.{r}.pt")) for r in range(WORLD)]
               for name in list(CASES) + ["side_group"]}


def group_slices(H, world, G):
    """The head slices the distributed call attends separately with ``head_groups=G``: each
    rank's head groups."""
    hp = H // world
    return [slice(j * hp + a, j * hp + b) for j in range(world) for a, b in head_groups(hp, G)]


def single(case, gate_rows=None, slices=(slice(None),)):
    """The one-device output and gradients (q, k, v, gate, key_bias) of a case: all heads in one
    call, or each head slice of ``slices`` in a call of its own; ``gate_rows``: keep only these
    rows of the gate (the others zeroed)."""
    q, k, v, gate, kb, block_len, w = case_inputs(case)
    if gate_rows is not None:
        kept = torch.zeros_like(gate)
        kept[:, gate_rows] = gate[:, gate_rows]
        gate = kept
    grad = bool(case.get("grad"))
    if grad and kb is not None and kb.dtype.is_floating_point:
        kb.requires_grad_(True)
    out = None
    grads = [None if x is None else torch.zeros_like(x) for x in (q, k, v, gate)]
    for s in slices:
        leaves = [None if x is None else x[:, :, s].clone().requires_grad_(grad) for x in (q, k, v, gate)]
        y = call(solattn, case, *leaves, kb, block_len)
        out = torch.empty(q.shape[:2] + v.shape[2:], dtype=y.dtype) if out is None else out
        out[:, :, s] = y.detach()
        if grad:
            (y.float() * w[:, :, s]).sum().backward()
            for gr, leaf in zip(grads, leaves):
                if leaf is not None:
                    gr[:, :, s] = leaf.grad
    if not grad:
        return out, None
    return out, grads + [None if kb is None or not kb.requires_grad else kb.grad]


def check_exact(case, per_rank, world, G):
    """A distributed result (output and gradient shards of every rank, ``head_groups=G``) equals
    one device: bit for bit the single-device function on the same head slices (the same
    computation; the exchange only moves data), and within the dtype's tolerance the
    single-device call on all heads at once (which may block the work differently). Gradients
    are bit for bit when B = 1: with B > 1 the backward's reductions follow the memory layout of
    the inputs (the exchange's buffer interleaves the batch), so they agree within rounding. The
    key_bias gradient, summed over head groups and ranks, is compared on every rank."""
    tol = tolerance(case.get("dtype", torch.float32))
    want_all, grads_all = single(case)
    want, want_grads = single(case, slices=group_slices(case["H"], world, G))
    got = torch.cat([res["out"] for res in per_rank], dim=1)
    assert got.shape == want_all.shape and got.dtype == want_all.dtype
    assert torch.equal(got, want), f"head_groups={G}: not bit-identical to one device on the same heads"
    assert rel_l2(got, want_all) < tol, f"head_groups={G}"
    if not case.get("grad"):
        return
    for i, arg in enumerate(("q", "k", "v", "gate")):
        if want_grads[i] is not None:
            got_g = torch.cat([res["grads"][i] for res in per_rank], dim=1)
            if case["B"] == 1:    # with B > 1 the backward's sums follow the inputs' memory layout
                assert torch.equal(got_g, want_grads[i]), f"head_groups={G}: {arg} gradient"
            assert rel_l2(got_g, grads_all[i]) < tol, f"head_groups={G}: {arg} gradient"
    if want_grads[4] is not None and want_grads[4].dtype.is_floating_point:
        for r, res in enumerate(per_rank):   # the whole key_bias gradient on every rank
            assert rel_l2(res["key_bias_grad"], grads_all[4]) < 1e-5, f"head_groups={G}: key_bias, rank {r}"


OK_CASES = [n for n in CASES if not n.startswith("err_")]
#: the cases whose checks take a second or more (all cases run in the workers either way)
SLOW_CASES = ("topk", "grad_sol", "grad_key_bias")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in OK_CASES])
def test_matches_single_process(results, name):
    case = CASES[name]
    per_rank = results[name]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["out"].shape[1] == case_lens(case)[r]            # sharded like q
        assert res["out"].is_contiguous()
    groups = case.get("head_groups") or DEFAULT_HEAD_GROUPS
    check_exact(case, per_rank, WORLD, groups)
    # one all-gather (the argument agreement); per head group, one all-to-all in per dtype among
    # q, k, v, gate and one out
    calls = per_rank[0]["collectives"]
    n_groups = len(head_groups(case["H"] // WORLD, groups))
    assert calls.get("all_to_all_single") == n_groups * (3 if "gate_dtype" in case else 2)
    assert calls.get("all_gather", 0) == 1


ERRORS = {   # case -> (exception type, pattern every rank's identical message matches)
    "err_heads": ("ValueError", r"argument 'q'.*H=3.*divisible by the group size 2"),
    "err_heads_one_rank": ("ValueError", r"argument 'q'.*H=3.*divisible by the group size 2.*"
                                         r"refused on rank 1 of the group's 2"),
    "err_shard_lens": ("ValueError", r"argument 'shard_lens' received \[60, 68\]; allowed: .*"
                                     r"which is \[64, 64\]"),
    "err_shard_lens_disagree": ("ValueError", r"argument 'shard_lens' differs across ranks "
                                              r"\(rank 0: l\[60, 68\], rank 1: l\[50, 68\]\)"),
    "err_mismatch": ("ValueError", r"argument 'q' received shards whose D differ across ranks "
                                   r"\(rank 0: 16, rank 1: 8\)"),
    "err_key_bias_sharded": ("ValueError", r"argument 'key_bias' received a tensor of shape \(\d+,\).*T=128"),
    "err_key_bias_one_rank": ("ValueError", r"argument 'key_bias' differs across ranks \(rank 0: tensor\(128,\) "
                                            r"float32 on q's device, rank 1: tensor\(64,\) bool"),
    "err_key_bias_values": ("ValueError", r"argument 'key_bias' holds different values across ranks"),
    "err_vsa_grid": ("ValueError", r"solattn.distributed.video_sparse_attn: argument 'q'.*T=127 tokens in shards"),
    "err_tau_nan": ("ValueError", r"solattn.distributed.sol_attn: argument 'tau' received nan"),
    "err_tau_nan_one_rank": ("ValueError", r"argument 'tau' differs across ranks \(rank 0: 1.0, rank 1: nan\)"),
    "err_topk_differs": ("ValueError", r"argument 'topk_ratio' differs across ranks \(rank 0: 0.3, rank 1: 0.6\)"),
    "err_head_groups_differ": ("ValueError", r"argument 'head_groups' differs across ranks \(rank 0: 2, rank 1: 1\)"),
    "err_autograd_differs": ("ValueError", r"argument 'grad mode, requires_grad of q, k, v, coarse_gate' differs "
                                           r"across ranks \(rank 0: l\[True, False, False, False, False\], "
                                           r"rank 1: l\[True, True, True, True, False\]\)"),
    "err_prefix_differs": ("ValueError", r"argument 'prefix_len' differs across ranks \(rank 0: 40, "
                                         r"rank 1: l\[20, 20\]\)"),
}


def test_every_error_case_is_checked():
    assert sorted(ERRORS) == sorted(n for n in CASES if n.startswith("err_"))


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_rank_raises_the_same_error_before_the_exchange(results, name):
    """One rank's refused argument, or arguments that differ between ranks, raise the same
    error on every rank, promptly, before q, k, v leave any rank; the ranks stay in step."""
    kind, pattern = ERRORS[name]
    errs = [res.get("error") for res in results[name]]
    assert errs[0] is not None and errs[0] == errs[1], errs      # the same text on every rank
    assert errs[0][0] == kind and re.search(pattern, errs[0][1]), errs[0]
    for res in results[name]:
        assert res["collectives"] == {"all_gather": 1}            # the agreement; nothing else sent
        assert res["elapsed"] < ERROR_BOUND_S
        assert res["alive"] == 2.0


def test_agreement_of_a_group_without_gloo_runs_on_a_gloo_group(results):
    for plain, side in zip(results["topk"], results["side_group"]):
        assert side["host_group"] == [True]           # one Gloo group, not the default group
        assert torch.equal(side["out"], plain["out"])
        assert side["collectives"]["all_gather"] == 1


def test_vsa_gate_prefix_rows_are_used(results):
    """The prefix rows of a q-shaped gate weigh the coarse branch on the prefix rows, on one
    device and distributed alike."""
    case = CASES["vsa_prefix_gate"]
    prefix = case["kwargs"]["prefix_len"]
    full, _ = single(case)
    video_only, _ = single(case, gate_rows=slice(prefix, None))
    assert torch.equal(full[:, prefix:], video_only[:, prefix:])
    assert rel_l2(video_only[:, :prefix], full[:, :prefix]) > 0.05     # the prefix rows' gate counts
    got = torch.cat([res["out"] for res in results["vsa_prefix_gate"]], dim=1)
    assert rel_l2(got, full) < 1e-5 and rel_l2(got[:, :prefix], video_only[:, :prefix]) > 0.05


def _torchrun(script, *args, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={WORLD}", str(ROOT / script), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.slow
def test_example_under_torchrun():
    out = _torchrun("examples/distributed_sol_attn.py", "--device", "cpu")
    lines = re.findall(r"^(sol_attn|video_sparse_attn).*rel. L2 vs one device (\S+) -> (\w+)$", out, re.M)
    assert [name for name, _, _ in lines] == ["sol_attn", "video_sparse_attn"], out
    assert all(status == "OK" and float(err) < 1e-5 for _, err, status in lines), out


@pytest.mark.slow
def test_benchmark_tiny_under_torchrun(tmp_path):
    path = tmp_path / "bench.md"
    _torchrun("benchmarks/bench_distributed.py", "--device", "cpu", "--tiny", "--out", str(path))
    text = path.read_text()
    assert "gloo backend" in text            # init_from_env("cpu")
    parts, end_to_end = text.split("## End to end")
    rows = [line.split("|")[1:-1] for line in parts.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [1000, 2000]
    for r in rows:
        assert r[1].strip() == f"{int(r[0]) // 2}/{int(r[0]) // 2}"     # shard_lengths
        assert all(float(r[i]) > 0 for i in (3, 4, 5, 6, 7, 9, 10))      # every time was measured
        a, c_in, c_out = float(r[4]), float(r[5]), float(r[6])
        # every figure is printed with 2 decimals: each is off by up to 0.005, a sum of three and
        # the printed total by up to 0.02 together
        assert float(r[9]) == pytest.approx(max(a, c_in + c_out), abs=0.0151)
        assert float(r[10]) == pytest.approx(a + c_in + c_out, abs=0.0201)
    rows = [line.split("|")[1:-1] for line in end_to_end.splitlines() if re.match(r"\| \d", line)]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1000, 1), (1000, 2), (2000, 1), (2000, 2)]
    for r in rows:
        assert float(r[-1]) < 1e-5                    # distributed output equals the one-device output
        assert float(r[2]) > 0 and float(r[5]) > 0 and float(r[6]) > 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker RANK INIT_FILE OUTDIR (started by pytest)")
