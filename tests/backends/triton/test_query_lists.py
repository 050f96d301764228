"""The transposed selection of an n-wide plan (``Plan.query_lists``) from its Triton kernel
(:mod:`solattn.routing.list_kernels`, Triton's interpreter on the CPU) against the torch path,
bit for bit, and which of the two a plan takes."""

from __future__ import annotations

import pytest
import torch

from solattn.testing import triton_interpretable

if not triton_interpretable():
    pytest.skip("needs Triton >= 3.9 for its CPU interpreter", allow_module_level=True)

from solattn.routing import Plan  # noqa: E402
from tests.backends.triton.test_vsa_backward import OpCounts, counted_launches  # noqa: E402,F401
from tests.support.marks import gpu_marked  # noqa: E402


def selection(B, H, n, seed, kept=None, prefix=0, exempt=0, empty_rows=0):
    """Random ascending lists ``(kv_num_blocks, kv_indices)``, n wide: query blocks below ``prefix``
    list every block; the others list the ``exempt`` first blocks plus ``kept`` more (a random
    count from 0 to n when None), except ``empty_rows`` random ones that list nothing."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(B, H, n, dtype=torch.int32)
    idx = torch.zeros(B, H, n, n, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            empty = set(torch.randperm(n, generator=g)[:empty_rows].tolist())
            for i in range(n):
                if i < prefix:
                    picked = torch.arange(n)
                elif i in empty:
                    picked = torch.arange(0)
                else:
                    c = int(torch.randint(0, n - exempt + 1, (1,), generator=g)) if kept is None else kept
                    rest = exempt + torch.randperm(n - exempt, generator=g)[:c]
                    picked = torch.cat([torch.arange(exempt), rest]).sort().values
                counts[b, h, i] = len(picked)
                idx[b, h, i, :len(picked)] = picked.int()
    return counts, idx


def plan_of(counts, idx):
    (B, H, n), dev = counts.shape, counts.device
    return Plan(kv_num_blocks=counts, kv_indices=idx, block_len=torch.full((n,), 64, dtype=torch.int32, device=dev),
                touches_dead=torch.zeros(B, H, n, dtype=torch.bool, device=dev), seq_len=n * 64)


def both_paths(monkeypatch, counts, idx, device="cpu"):
    """``query_lists`` of the same lists by the torch path (CPU, no interpreter) and by the kernel
    (CPU under ``TRITON_INTERPRET=1``, or compiled on a CUDA ``device``), each on a plan of its own."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    want = plan_of(counts.cpu(), idx.cpu()).query_lists()
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = plan_of(counts.to(device), idx.to(device)).query_lists()
    return want, got


def assert_same(want, got):
    for a, b in zip(want, got):
        assert b.dtype == torch.int32 and b.is_contiguous() and b.shape == a.shape
        assert torch.equal(a, b.cpu()), (a != b.cpu()).nonzero()[:8].tolist()


CASES = {
    # name: (B, H, n, selection's keyword arguments)
    "random-counts-B2-H3": (2, 3, 37, dict(empty_rows=5)),
    "one-block": (3, 2, 1, dict()),
    "tile-edges-65": (1, 2, 65, dict(kept=9, prefix=2, empty_rows=3)),
    "prefix-rows-13-kept": (1, 2, 130, dict(kept=13, prefix=3, exempt=3, empty_rows=1)),
    "nothing-selected": (2, 1, 20, dict(kept=0)),
    "everything-selected": (1, 1, 33, dict(prefix=33)),
    "H3-583-blocks": (1, 1, 583, dict(kept=65, prefix=7, exempt=7)),
    "2048-blocks": (1, 1, 2048, dict(kept=40, prefix=2, exempt=2)),
}
SLOW = {"H3-583-blocks", "2048-blocks"}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", gpu_marked(DEVICES))
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_kernel_lists_equal_the_torch_path(case, device, monkeypatch):
    B, H, n, kw = CASES[case]
    counts, idx = selection(B, H, n, seed=list(CASES).index(case), **kw)
    want, got = both_paths(monkeypatch, counts, idx, device)
    assert_same(want, got)
    mask = torch.zeros(B, H, n, n, dtype=torch.bool)       # the counts against the definition too
    for b, h, i in ((b, h, i) for b in range(B) for h in range(H) for i in range(n)):
        mask[b, h, i, idx[b, h, i, :counts[b, h, i]].long()] = True
    assert torch.equal(got[0].cpu(), mask.sum(dim=2, dtype=torch.int32))


@pytest.mark.parametrize("device", gpu_marked(DEVICES))
def test_kernel_reads_only_the_counted_entries_at_any_strides(device, monkeypatch):
    """Lists that are a view into wider rows, with junk after each count: the kernel reads the
    counted entries through the strides, as the torch path reads them through the dense mask."""
    B, H, n = 2, 2, 50
    counts, idx = selection(B, H, n, seed=4, prefix=1, empty_rows=4)
    g = torch.Generator().manual_seed(5)
    wide = torch.randint(0, n, (B, H, n, n + 7), generator=g, dtype=torch.int32)
    wide[..., :n] = torch.where(torch.arange(n) < counts[..., None], idx, wide[..., :n])
    view = wide.to(device)[..., :n]
    assert not view.is_contiguous()
    want, got = both_paths(monkeypatch, counts, view, device)
    assert_same(want, got)
    assert_same(want, both_paths(monkeypatch, counts, idx, device)[1])


def test_n_wide_plan_takes_the_kernel_and_others_the_torch_path(monkeypatch, counted_launches):
    """Where Triton runs, an n-wide plan's lists are one launch and their two outputs, nothing else;
    a plan whose lists are narrower than n (one host sync for the width) and the CPU without the
    interpreter keep the torch path."""
    counts, idx = selection(2, 2, 24, seed=3, kept=5, empty_rows=2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    wide = plan_of(counts, idx)
    with OpCounts(1) as ops:
        counted_launches.append(ops)
        wide.query_lists()
    assert dict(ops.ops) == {"empty": 2, "kernel:query_lists_kernel": 1}, ops.ops

    narrow = plan_of(counts, idx[..., :int(counts.max())].contiguous())
    with OpCounts(1) as ops:
        counted_launches.append(ops)
        narrow.query_lists()
    assert "kernel:query_lists_kernel" not in ops.ops and ops.ops["scatter_"] == 2, ops.ops

    monkeypatch.delenv("TRITON_INTERPRET")
    on_cpu = plan_of(counts, idx)
    with OpCounts(1) as ops:
        counted_launches.append(ops)
        on_cpu.query_lists()
    assert "kernel:query_lists_kernel" not in ops.ops and ops.ops["scatter_"] == 2, ops.ops


@pytest.mark.parametrize("device", gpu_marked(DEVICES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16])
def test_lists_of_another_integer_dtype_give_the_same_int32_lists(dtype, device, monkeypatch):
    """A plan whose counts and lists are another integer dtype (one a caller built) transposes as
    its int32 form does: the compiled kernel's search bounds stay int32 (a loop variable whose type
    changed would not compile; the interpreter does not check)."""
    counts, idx = selection(2, 2, 40, seed=9, prefix=1, empty_rows=3)
    want, got = both_paths(monkeypatch, counts.to(dtype), idx.to(dtype), device)
    assert_same(want, got)
    assert_same(want, both_paths(monkeypatch, counts, idx, device)[1])
