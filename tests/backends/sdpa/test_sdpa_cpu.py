"""The ``sdpa`` backend's inference path: block layouts (queries in the chunks' order, the output
gathered once per run) and which of its passes run on the caller's threads on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn.config import tuning
from solattn.routing import build_plan
from solattn.testing import TOLERANCE as TOL
from solattn.testing import make_qkv, rel_l2
from solattn.validation import validate


def _tail_call_with_threads(threads: int, tune, seed: int):
    """``(sol_attn on sdpa with the tail under tuning tune with the caller at threads threads,
    the caller's thread count after it, the reference's output)``, bf16, B=1 T=320 H=2 D=32."""
    q, k, v = make_qkv(1, 320, 2, 32, dtype=torch.bfloat16, seed=seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tuning(tune):
            out = solattn.sol_attn(q, k, v, topk_ratio=0.25, tail=True, backend="sdpa")
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return out, after, solattn.sol_attn(q, k, v, topk_ratio=0.25, tail=True, backend="reference")


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("pairs", [2, 6])
def test_sdpa_queries_are_sliced_and_output_gathered_per_run(monkeypatch, tail, pairs):
    """In inference a chunk's queries are a slice of the run's query blocks (laid out once, in the
    order the chunks take them) and its output overwrites them; each run's output reaches the
    (B, T, H, D) tensor in one gather per batch. Runs of 2 pairs with H=3 split a batch between
    runs (the output goes through the spent key layout there); 6 pairs are whole batches (gathered
    straight into the output). Ragged T, dead rows (one holding NaN in q, one in k), key_bias and
    a poisoned output and workspace: the result is the reference's on every live row."""
    from solattn.backends.sdpa import forward, layout
    taken = []
    real_take = layout.BlockTable.take
    monkeypatch.setattr(layout.BlockTable, "take",
                        lambda self, idx, count, extra, work, name: taken.append(name)
                        or real_take(self, idx, count, extra, work, name))
    monkeypatch.setattr(forward, "pairs_per_layout", lambda *args: pairs)
    monkeypatch.setattr(forward, "new_output",
                        lambda shape, dtype, dev: torch.full(shape, math.nan, dtype=dtype, device=dev))
    real_empty = layout.Workspace.empty
    monkeypatch.setattr(layout.Workspace, "empty",
                        lambda self, *a, **kw: real_empty(self, *a, **kw).fill_(math.nan))
    B, T, H, D = 2, 333, 3, 32
    q, k, v = make_qkv(B, T, H, D, dtype=torch.float32, seed=21)
    bl = torch.full(((T + 63) // 64,), 64, dtype=torch.int32)
    bl[2], bl[-1] = 7, T - 64 * (bl.numel() - 1)
    k[1, 2 * 64 + 30, 2] = float("nan")                       # dead rows: never reach an output
    q[0, 2 * 64 + 40, 1] = float("nan")
    bias = torch.randn(B, T)
    p = validate(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=bias, tail=tail)
    out = forward.sdpa_forward(p, build_plan(p))
    assert taken and set(taken) <= {"gk", "gv"}               # no query block is gathered per chunk
    assert torch.isfinite(out).all()
    want = solattn.sol_attn(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=bias, tail=tail, backend="reference")
    live = torch.cat([torch.arange(64) < int(x) for x in bl])[:T]      # dead rows' outputs: unspecified
    assert rel_l2(out[:, live], want[:, live]) < TOL[torch.float32]


@pytest.mark.parametrize("parallel_bytes", [0, 1 << 40])
def test_sdpa_tail_residual_pass_takes_the_callers_threads_when_large(monkeypatch, parallel_bytes):
    """The tail's rounding-residual pass (fp32 copies of q, one batched dot per step of tokens) runs
    with the caller's threads when a step is at least SdpaTuning.parallel_bytes, else on the
    forward's one thread, like the backend's other large ops; the output is the reference's."""
    from solattn.backends.sdpa import SdpaTuning
    seen = []
    real = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda *a, **kw: seen.append(torch.get_num_threads()) or real(*a, **kw))
    out, after, want = _tail_call_with_threads(3, SdpaTuning(parallel_bytes=parallel_bytes), seed=5)
    assert after == 3
    assert seen and set(seen) == ({3} if parallel_bytes == 0 else {1})
    assert rel_l2(out, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("pairs", [2, 6])
def test_sdpa_heads_first_keys_and_values_are_read_in_place(monkeypatch, tail, pairs):
    """Keys and values whose heads are contiguous (T, D) rows ((B, H, T, D) memory passed as
    (B, T, H, D)), with T a multiple of 64 and no dead rows, are gathered from in place: no layout
    copy; the caller's tensors are left untouched (the tail slots, zeroed in the gathered copy,
    and a run splitting a batch, whose output goes through scratch memory of its own). The output
    is the one of the same values in (B, T, H, D) memory and the reference's."""
    from solattn.backends.sdpa import forward, layout
    in_place = []
    real_init = layout.BlockTable.__init__

    def spy(self, x, *args):
        real_init(self, x, *args)
        in_place.append(self.flat.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())
    monkeypatch.setattr(layout.BlockTable, "__init__", spy)
    monkeypatch.setattr(forward, "pairs_per_layout", lambda *args: pairs)
    B, T, H, D = 2, 256, 3, 32
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, seed=23)
    heads_first = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    before = [x.clone() for x in heads_first]
    bias = torch.randn(B, T)
    kw = dict(topk_ratio=0.3, key_bias=bias, tail=tail)
    out = solattn.sol_attn(*heads_first, backend="sdpa", **kw)
    assert in_place and all(in_place)
    assert all(torch.equal(x, y) for x, y in zip(heads_first, before))
    in_place.clear()
    copied = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    assert in_place and not any(in_place)
    assert rel_l2(out, copied) < 1e-6
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    assert rel_l2(out, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("chunk_threads", [4, 5])
def test_sdpa_per_chunk_passes_take_the_callers_threads_from_chunk_threads(monkeypatch, chunk_threads):
    """A chunk's output copy and its mask (here the tail's) run with the caller's threads where it
    has SdpaTuning.chunk_threads or more (4 by default; the caller here has 4), else on the
    forward's one thread; the output is the reference's either way."""
    from solattn.backends.sdpa import SdpaTuning, forward, layout
    seen = {"put": [], "mask": []}
    real_put, real_tail = layout.QueryBlocks.put, forward.append_tail
    monkeypatch.setattr(layout.QueryBlocks, "put",
                        lambda self, *a: seen["put"].append(torch.get_num_threads()) or real_put(self, *a))
    monkeypatch.setattr(forward, "append_tail",
                        lambda *a, **kw: seen["mask"].append(torch.get_num_threads()) or real_tail(*a, **kw))
    out, after, want = _tail_call_with_threads(4, SdpaTuning(chunk_threads=chunk_threads), seed=6)
    assert after == 4
    for name in ("put", "mask"):
        assert seen[name] and set(seen[name]) == ({4} if chunk_threads == 4 else {1}), name
    assert rel_l2(out, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,rows,grad", [(200, 64, False), (130, 64, True), (256, 1000, False), (64, 10, False)])
def test_coarse_add_is_the_definition_bit_for_bit(T, rows, grad, dtype):
    """The coarse branch's add (shared by the sdpa and flex backends), chunked and broadcast per
    block, equals SPEC.md's cast(fine) + cast(gate * coarse[block of t]) computed whole, to the
    bit: ragged last block, chunks smaller than T, a gate in another memory layout or broadcast
    from a constant, autograd's
    out-of-place path."""
    from solattn.backends.base import add_coarse
    B, H, D = 2, 3, 8
    g = torch.Generator().manual_seed(T)
    out, gate = (torch.randn(B, T, H, D, generator=g).to(dtype) for _ in range(2))
    coarse = torch.randn(B, H, -(-T // 64), D, generator=g)
    constant = torch.tensor(0.7).to(dtype).expand(B, T, H, D)         # a constant gate, as broadcast
    for gt in (gate, gate.transpose(1, 2).contiguous().transpose(1, 2), constant):
        want = out + (gt.float() * coarse[:, :, torch.arange(T) // 64].transpose(1, 2)).to(out.dtype)
        got = add_coarse(out.clone(), gt, coarse, rows, grad)
        assert got.shape == want.shape and torch.equal(got, want)
