"""The coarse branch's block gradients in Triton kernels
(:mod:`solattn.backends.triton.coarse_kernels`) against a float64 computation of their definition,
beside the torch path's own error.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` per test), on a CUDA
machine compiled (tf32x3 products on NVIDIA). Errors are measured in units of the size of what
each gradient sums before its terms cancel (``|a_ij| (|dp_ij| + |delta_i|)`` against the other
side's block means, ``a_ij |dcoarse_i|`` for ``dvm``), the scale at which fp32 sums err: there
the torch path's error is 1e-7 to 2e-6 on these inputs, and the kernels must stay within four
times it (or 1e-6, about eight fp32 ulps, where both are near zero: one block).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from solattn.routing.coarse_grad import coarse_block_grads, per_rows  # noqa: E402
from solattn.testing import triton_interpretable  # noqa: E402

from tests.support.marks import gpu_marked  # noqa: E402

DEVICES = (["cpu"] if triton_interpretable() else []) + (["cuda"] if torch.cuda.is_available() else [])
if not DEVICES:
    pytest.skip("no CUDA device, and the interpreter needs triton >= 3.9", allow_module_level=True)


@pytest.fixture(params=gpu_marked(DEVICES))
def device(request, monkeypatch):
    """Each case on the CPU, its kernels in Triton's interpreter, and compiled on a CUDA device."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def float64_grads(means, dco, L, scale):
    """``(dqm / L, dkm / L, dvm / L)`` in float64 from the definition (softmax weights, then the
    softmax backward), and the size of each one's summed terms (see the module docstring)."""
    q, k, v = (t.double() for t in means)
    d, lens = dco.double(), L.double()[:, None]
    a = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1)
    dp = d @ v.transpose(-1, -2)
    delta = (a * dp).sum(-1, keepdim=True)
    ds = a * (dp - delta)
    want = (scale * ds @ k / lens, scale * ds.transpose(-1, -2) @ q / lens, a.transpose(-1, -2) @ d / lens)
    terms = a * (dp.abs() + delta.abs())
    size = (abs(scale) * terms @ k.abs() / lens, abs(scale) * terms.transpose(-1, -2) @ q.abs() / lens,
            a.transpose(-1, -2) @ d.abs() / lens)
    return want, [s.max().item() for s in size]


def random_means(G, n, D, device, seed, key_offset=0.0, sharp=1.0):
    """Block means ``(3, G, n, D)``, ``dcoarse`` ``(G, n, D)`` (fp32) and live lengths of every size
    1..64 (int32 ``(n,)``); ``key_offset`` moves every key mean by one vector, ``sharp`` scales
    the query means (a peakier softmax)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(3, G, n, D, generator=g)
    means[0] *= sharp
    means[1] += key_offset * torch.randn(D, generator=g)
    dco = torch.randn(G, n, D, generator=g)
    L = torch.randint(1, 65, (n,), generator=g, dtype=torch.int32)
    L[: min(n, 2)] = torch.tensor([64, 1][: min(n, 2)], dtype=torch.int32)
    return means.to(device), dco.to(device), L.to(device)


CASES = [                     # G, n, D, key offset, query sharpness
    pytest.param(2, 37, 64, 0.0, 1.0, id="G2-n37-D64"),
    pytest.param(3, 70, 128, 0.0, 1.0, id="G3-n70-D128", marks=pytest.mark.slow),
    pytest.param(2, 1, 64, 0.0, 1.0, id="G2-n1-D64"),
    pytest.param(2, 1, 128, 0.0, 1.0, id="G2-n1-D128"),
    pytest.param(2, 37, 128, 4.0, 1.0, id="G2-n37-D128-key-offset"),
    pytest.param(2, 70, 64, 0.0, 4.0, id="G2-n70-D64-sharp"),
    pytest.param(1, 583, 128, 0.0, 1.0, id="G1-n583-D128", marks=pytest.mark.slow),
    pytest.param(2, 2048, 128, 0.0, 1.0, id="G2-n2048-D128", marks=pytest.mark.slow),     # GPU only
]


@pytest.mark.parametrize("G,n,D,key_offset,sharp", CASES)
def test_kernels_match_float64_within_the_torch_paths_error(device, G, n, D, key_offset, sharp):
    from solattn.backends.triton.coarse_kernels import fused_coarse_row_grads
    if device == "cpu" and n > 1024:
        pytest.skip("the interpreter takes minutes over n = 2048 blocks")
    means, dco, L = random_means(G, n, D, device, seed=n + D, key_offset=key_offset, sharp=sharp)
    scale = D ** -0.5 * 2
    got = fused_coarse_row_grads(means, dco, L, scale)
    torch_path = per_rows(coarse_block_grads(means[0], means[1], means[2], dco, scale), L)
    want, sizes = float64_grads(means.cpu(), dco.cpu(), L.cpu(), scale)
    for name, mine, theirs, ref, size in zip(("dq", "dk", "dv"), got, torch_path, want, sizes):
        assert mine.shape == (G, n, D) and mine.dtype == torch.float32 and mine.is_contiguous(), name
        err = (mine.cpu().double() - ref).abs().max().item() / size
        base = (theirs.cpu().double() - ref).abs().max().item() / size
        assert err <= max(4 * base, 1e-6), (name, err, base)


@pytest.mark.slow
def test_tiles_and_chunks_of_any_size_give_the_same_gradients(device):
    """Tiles and chunks that do not divide n (n = 40 against 16 and 32), a tile or a chunk wider
    than n: the same sums up to fp32 rounding."""
    from solattn.backends.triton.coarse_kernels import fused_coarse_row_grads
    means, dco, L = random_means(2, 40, 32, device, seed=5)
    first = fused_coarse_row_grads(means, dco, L, 0.25)
    for tile, chunk in ((64, 16), (32, 64)):
        for a, b in zip(fused_coarse_row_grads(means, dco, L, 0.25, tile=tile, chunk=chunk), first):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backward_takes_the_kernels_where_they_run_else_the_torch_path(device, monkeypatch):
    """The triton backward's ``coarse_row_grads``: the kernels for fp32 means of a power-of-two
    head dim, the torch products for means the kernels do not take (D = 24, float64) and for more
    blocks than the kernels pay for (``MAX_BLOCKS``, lowered here), with the same results."""
    import solattn.backends.triton.backward as bw
    import solattn.backends.triton.coarse_kernels as ck
    launches = []
    real = ck.fused_coarse_row_grads
    monkeypatch.setattr(bw, "fused_coarse_row_grads", lambda *a, **k: launches.append(1) or real(*a, **k))
    for D, dtype, most, fused in ((32, torch.float32, 256, True), (24, torch.float32, 256, False),
                                  (32, torch.float64, 256, False), (32, torch.float32, 36, False)):
        means, dco, L = random_means(2, 37, D, device, seed=11)
        means, dco = means.to(dtype), dco.to(dtype)
        assert ck.coarse_kernels_usable(means) == (dtype == torch.float32 and D == 32)
        monkeypatch.setattr(ck, "MAX_BLOCKS", most)
        before = len(launches)
        got = bw.coarse_row_grads(SimpleNamespace(scale=0.3), SimpleNamespace(block_len=L), means, dco)
        assert len(launches) == before + fused
        want = per_rows(coarse_block_grads(means[0], means[1], means[2], dco, 0.3), L)
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and a.shape == (2, 37, D)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mismatched_shapes_are_refused_before_any_launch():
    from solattn.backends.triton.coarse_kernels import fused_coarse_row_grads
    means, dco, L = random_means(2, 5, 16, "cpu", seed=1)
    with pytest.raises(ValueError, match=r"received means \(3, 2, 5, 16\), dcoarse \(2, 4, 16\)"):
        fused_coarse_row_grads(means, dco[:, :4], L, 0.5)
    with pytest.raises(ValueError, match=r"dcoarse torch.float64 \(contiguous: True\); allowed: fp32 contiguous"):
        fused_coarse_row_grads(means, dco.double(), L, 0.5)
    with pytest.raises(ValueError, match=r"received means torch.float64 \(contiguous: True\)"):
        fused_coarse_row_grads(means.double(), dco, L, 0.5)
    with pytest.raises(ValueError, match=r"dcoarse torch.float32 \(contiguous: False\)"):
        fused_coarse_row_grads(means, dco.transpose(1, 2).contiguous().transpose(1, 2), L, 0.5)
