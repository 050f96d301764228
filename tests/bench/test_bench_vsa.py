"""``python -m solattn bench --shapes vsa``: the video_sparse_attn preset, FastVideo's op as a peer
(its adapter checked against a stand-in that computes the VSA definition in torch), and a CPU run."""

from __future__ import annotations

import csv
import os
import sys
import types
from pathlib import Path

import pytest
import torch

import solattn
from solattn import bench
from solattn.bench import parsing, peers
from solattn.routing import vsa_topk_from_sparsity
from solattn.testing import rel_l2


def _resolve(*argv):
    return parsing.resolve(parsing.build_parser().parse_args(["--device", "cpu", *argv]))


def test_vsa_preset_is_the_video_model_at_10_and_20_percent():
    cfg = _resolve("--shapes", "vsa", "--backward")
    assert cfg.vsa == parsing.VSA_PRESETS["vsa"] and cfg.backward and cfg.shapes == []
    assert [(p.H, p.D, p.B) for p in cfg.vsa] == [(56, 128, 1)] * 5
    full = [p for p in cfg.vsa if not p.prefix]
    assert [(p.grid, p.cubes, p.topk, p.gate) for p in full] == [
        ((16, 48, 48), 576, vsa_topk_from_sparsity(0.9, 576), True),
        ((16, 48, 48), 576, vsa_topk_from_sparsity(0.8, 576), True),
        ((8, 32, 32), 128, vsa_topk_from_sparsity(0.9, 128), True)]
    assert [(p.topk, p.T) for p in full] == [(58, 36864), (116, 36864), (13, 8192)]
    h3 = [p for p in cfg.vsa if p.prefix]
    assert [(p.prefix, p.T, p.topk, p.gate) for p in h3] == [(432, 37296, 58, True), (432, 37296, 58, False)]
    assert h3[0].label == "432 + 16x48x48, 58 of 576, gate"
    assert cfg.with_dense and cfg.backends == ["solattn"] and cfg.peers == list(peers.VSA_PEERS)
    only = _resolve("--shapes", "vsa", "--backends", "solattn", "fastvideo-triton")
    assert not only.with_dense and only.backends == ["solattn"] and only.peers == ["fastvideo-triton"]
    assert not only.backward


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "vsa", "h3"], "--shapes received 'vsa'"),
    (["--shapes", "h3", "--backward"], "--backward received without a video_sparse_attn preset"),
    (["--shapes", "vsa", "--ratios", "0.1"], "--ratios received with video_sparse_attn problems"),
    (["--shapes", "vsa", "--backends", "triton"], "--backends received triton with video_sparse_attn"),
    (["--shapes", "vsa-quick", "--quick"], "--quick received with --shapes vsa-quick"),
])
def test_vsa_options_refused_with_the_option_named(argv, message):
    with pytest.raises(parsing.UsageError) as err:
        _resolve(*argv)
    assert message in str(err.value)


def test_fastvideo_absent_or_off_cuda_is_a_reason_not_an_error(monkeypatch):
    calls, missing = peers.vsa_peer_calls(torch.device("cpu"), torch.bfloat16)
    assert calls == {} and missing == [f"{n}: FastVideo's VSA kernels run on CUDA only" for n in peers.VSA_PEERS]
    monkeypatch.setitem(sys.modules, "fastvideo_kernel", None)          # import refused
    module, why = peers.load_fastvideo()
    assert module is None and "fastvideo_kernel not importable" in why
    calls, missing = peers.vsa_peer_calls(torch.device("cuda"), torch.bfloat16)   # no GPU work is done
    assert calls == {} and [m.split(":")[0] for m in missing] == list(peers.VSA_PEERS)
    assert all("fastvideo_kernel not importable" in m for m in missing)
    calls, missing = peers.vsa_peer_calls(torch.device("cuda"), torch.float32)
    assert calls == {} and all("bf16/fp16 only" in m for m in missing)


@pytest.mark.parametrize("capability, ops, rows, reason", [
    ((9, 0), dict(block_sparse_fwd=print, block_sparse_bwd=print), list(peers.VSA_PEERS), None),
    ((9, 0), dict(block_sparse_fwd=print), ["fastvideo-triton"], "has no block-sparse VSA kernel"),
    ((9, 0), None, ["fastvideo-triton"], "its compiled extension did not load: ModuleNotFoundError"),
    ((8, 9), dict(block_sparse_fwd=print, block_sparse_bwd=print), ["fastvideo-triton"], "this GPU is sm_89"),
])
def test_fastvideo_rows_follow_its_kernels(monkeypatch, capability, ops, rows, reason):
    """The Triton row whenever fastvideo_kernel imports on a CUDA GPU; the sm_90 row only on an
    sm_90 GPU whose compiled extension loads with its block-sparse kernels (nothing runs here)."""
    monkeypatch.setitem(sys.modules, "fastvideo_kernel", types.ModuleType("fastvideo_kernel"))
    monkeypatch.setitem(sys.modules, "fastvideo_kernel._C", types.ModuleType("fastvideo_kernel._C"))
    monkeypatch.setitem(sys.modules, "fastvideo_kernel._C.fastvideo_kernel_ops",
                        None if ops is None else types.SimpleNamespace(**ops))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    calls, missing = peers.vsa_peer_calls(torch.device("cuda"), torch.bfloat16)
    assert list(calls) == rows
    assert [c.triton for c in calls.values()] == [name == "fastvideo-triton" for name in rows]
    if reason is None:
        assert missing == []
    else:
        assert len(missing) == 1 and missing[0].startswith("fastvideo-sm90: ") and reason in missing[0]


def _standin_vsa(seen):
    """A stand-in for ``fastvideo_kernel.video_sparse_attn``: the VSA definition in torch on its
    ``(B, H, 64 n, D)`` layout (cube means over live rows, coarse softmax over all cubes, fine
    attention over the ``topk`` best cubes' live keys, ``coarse * gate + fine``); it records the
    kernel switch it saw."""
    def video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, gate):
        seen.append((os.environ.get("FASTVIDEO_VSA_TRITON"), os.environ.get("FASTVIDEO_KERNEL_VSA_FORCE_TRITON")))
        assert tuple(block_size) == (4, 4, 4) and torch.equal(variable_block_sizes, q_variable_block_sizes)
        B, H, S, D = q.shape
        n = S // 64
        lens = variable_block_sizes.to(q.dtype).view(1, 1, n, 1)
        qm, km, vm = (x.view(B, H, n, 64, D).sum(3) / lens for x in (q, k, v))
        s = qm @ km.transpose(-1, -2) / D ** 0.5
        coarse = (s.softmax(-1) @ vm).repeat_interleave(64, dim=2)
        keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(topk, dim=-1).indices, True)
        live = (torch.arange(64)[None, :] < variable_block_sizes[:, None]).reshape(-1)
        mask = keep.repeat_interleave(64, 2).repeat_interleave(64, 3) & live
        logits = (q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(~mask, float("-inf"))
        fine = logits.softmax(-1) @ v
        return fine + (coarse if gate is None else coarse * gate)
    return video_sparse_attn


def test_fastvideo_adapter_tiles_transposes_and_returns_raw_order(monkeypatch):
    grid = (5, 6, 7)                                     # partial cubes on every axis: dead rows
    T = 5 * 6 * 7
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 16, generator=g) for _ in range(3))
    gate = torch.rand(1, T, 2, 16, generator=g)
    tq, block_len = peers.to_fastvideo(q, grid)
    tiled, want_len = solattn.tile(q, grid)
    assert torch.equal(tq, tiled.transpose(1, 2)) and tq.is_contiguous() and torch.equal(block_len, want_len)
    assert torch.equal(peers.from_fastvideo(tq, grid), q)

    seen = []
    standin = types.ModuleType("fastvideo_kernel")
    standin.video_sparse_attn = _standin_vsa(seen)
    monkeypatch.setitem(sys.modules, "fastvideo_kernel", standin)
    module, why = peers.load_fastvideo()
    assert module is standin and why == ""
    monkeypatch.setenv("FASTVIDEO_VSA_TRITON", "keep")
    for triton, switch in ((True, ("1", None)), (False, ("0", "0"))):
        for topk, gated in ((3, True), (5, False)):
            got = peers.FastVideoVSA(module, triton=triton).raw(q, k, v, grid, topk, gate if gated else None)
            want = solattn.video_sparse_attn(q, k, v, grid, topk=topk, gate=gate if gated else 1.0, backend="sdpa")
            assert got.shape == q.shape and rel_l2(got, want) < 1e-5
            assert seen.pop() == switch
    assert os.environ["FASTVIDEO_VSA_TRITON"] == "keep" and "FASTVIDEO_KERNEL_VSA_FORCE_TRITON" not in os.environ


@pytest.mark.slow
def test_cpu_run_times_dense_and_solattn_forward_and_backward(tmp_path):
    rc = bench.main(["--shapes", "vsa-quick", "--device", "cpu", "--backward", "--repeats", "3",
                     "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = {(r["problem"], r["pass"], r["backend"]): r for r in rows}
    labels = [p.label for p in parsing.VSA_PRESETS["vsa-quick"]]
    assert set(got) == {(p, s, b) for p in labels for s in ("forward", "forward + backward")
                        for b in ("dense", "solattn")}
    for label in labels:
        for what, tol in (("forward", 1e-2), ("forward + backward", 2e-2)):
            mine, dense = float(got[label, what, "solattn"]["rel_l2"]), float(got[label, what, "dense"]["rel_l2"])
            assert mine < tol and dense > 5 * mine, (label, what, mine, dense)   # 2 of 8 cubes: not dense
            assert float(got[label, what, "solattn"]["time_ms"]) > 0
            # vs dense: the quotient of the two times beside it (medians over the same rounds)
            for b in ("dense", "solattn"):
                assert float(got[label, what, b]["speedup"]) == pytest.approx(
                    float(got[label, what, "dense"]["time_ms"]) / float(got[label, what, b]["time_ms"]), rel=1e-12)
    md = Path(tmp_path, "bench.md").read_text()
    assert "| 70 + 4x8x16, 2 of 8, gate | forward + backward | solattn |" in md
    assert "- fastvideo-sm90: FastVideo's VSA kernels run on CUDA only" in md
