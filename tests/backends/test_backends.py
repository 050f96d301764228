"""Every registered backend x every device it runs on x every feature, against the reference.

The matrix is generated from the registry (solattn.testing.backend_cases: each backend's
``devices``, ``dtypes``, ``features``, ``head_dims``), so a new backend is tested the day it
is registered; a backend that runs on the CPU only through Triton's interpreter joins with
small problems. Inputs are solattn.testing.make_qkv (well separated blocks), so the selection
is unambiguous at every dtype.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import solattn
from solattn import BLOCK, devices, dispatch
from solattn.routing import build_plan
from solattn.testing import TOLERANCE as TOL
from solattn.testing import (BackendCase, backend_cases, dense_attention, dense_gradient_error, make_qkv,
                             rel_l2, tolerance)
from solattn.testing import live_rows as _live_rows
from solattn.validation import validate

from tests.support.marks import gpu_marked, on_gpu

#: every backend on every device it runs on, the Triton kernel through its CPU interpreter included
CASES = backend_cases()
#: the same without interpreted cases, for the longer property tests
COMPILED = [c for c in CASES if not c.interpreted]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _costly(case: BackendCase) -> bool:
    """A case whose calls take seconds on a CPU: the flex backend (a compile per shape) or the
    Triton kernel in the CPU interpreter."""
    return case.backend == "flex" or case.interpreted


def _cases(cases, cpu_slow: bool = False):
    """``cases`` as parameters, the costly ones marked slow, and with ``cpu_slow`` those on the CPU."""
    return [pytest.param(c, id=c.id, marks=pytest.mark.slow if _costly(c) or (cpu_slow and c.device == "cpu") else ())
            for c in cases]


def _features(B, T, H, D, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.ceil(T / BLOCK)
    bl = torch.randint(1, BLOCK + 1, (n,), generator=g, dtype=torch.int32).to(device)
    bias = (torch.randn(B, T, generator=g) * 2).to(device)
    keep = (torch.rand(T, generator=g) > 0.2).to(device)
    gate = torch.randn(B, T, H, D, generator=g).to(dtype).to(device)
    return {
        "topk": dict(topk_ratio=0.3),
        "topk-notail": dict(topk_ratio=0.3, tail=False),
        "tau": dict(tau=0.5),
        "tau-notail": dict(tau=0.5, tail=False),
        "key_bias": dict(topk_ratio=0.3, key_bias=bias),
        "bool_bias": dict(tau=0.3, key_bias=keep),
        "block_len": dict(topk_ratio=0.3, block_len=bl),
        "sinks": dict(topk_ratio=0.25, sink_blocks=(0, 1), sink_q=(n - 1, n)),
        "coarse_gate": dict(topk_ratio=0.3, coarse_gate=gate),
        "everything": dict(topk_ratio=0.3, key_bias=bias, block_len=bl, coarse_gate=gate,
                           sink_blocks=(1, 2), sink_q=(0, 1), scale=0.2),
    }, bl


FEATURES = ["topk", "topk-notail", "tau", "tau-notail", "key_bias", "bool_bias", "block_len",
            "sinks", "coarse_gate", "everything"]


def _matrix():
    """(case, dtype, feature) for every dtype the backend declares; interpreted cases take
    every feature in bf16 and only ``everything`` in the other dtypes (the interpreter is slow).
    A costly case is slow but for its bf16 ``everything``, which the default run keeps."""
    out = []
    for case in CASES:
        for dtype in DTYPES:
            if dtype not in case.declared.dtypes:
                continue
            for feature in FEATURES:
                if case.interpreted and dtype != torch.bfloat16 and feature != "everything":
                    continue
                slow = _costly(case) and not (case.interpreted and dtype == torch.bfloat16 and feature == "everything")
                out.append(pytest.param(case, dtype, feature, id=f"{case.id}-{str(dtype)[6:]}-{feature}",
                                        marks=pytest.mark.slow if slow else ()))
    return out


@pytest.mark.parametrize("case,dtype,feature", _matrix())
def test_backend_matches_reference(case, dtype, feature):
    """The output equals the reference's within the dtype's tolerance, in v's dtype and q's shape;
    a backend not declaring a feature the call uses refuses it, naming the feature."""
    B, T, H, D = 2, 5 * BLOCK - 17, 2, case.head_dim(32)
    q, k, v = make_qkv(B, T, H, D, dtype=dtype, device=case.device, seed=FEATURES.index(feature))
    feats, bl = _features(B, T, H, D, case.device, dtype, seed=len(feature))
    kw = feats[feature]
    missing = validate(q, k, v, **kw).features - case.declared.features
    if missing:
        with pytest.raises(solattn.BackendError, match="feature"):
            case.run(q, k, v, **kw)
        return
    got = case.run(q, k, v, **kw)
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    live = _live_rows(T, bl) if "block_len" in kw else torch.ones(T, dtype=torch.bool)
    assert torch.isfinite(got).all()
    assert rel_l2(got.cpu()[:, live], want.cpu()[:, live]) < TOL[dtype]


@pytest.mark.parametrize("case", _cases(CASES))
def test_backend_refuses_what_it_does_not_declare(case):
    """Dtypes, head dims and features outside a backend's declaration are refused before any
    work, with the reason; asking for the backend by name never silently runs another one."""
    refused = [(dt, 64, {}, "dtype") for dt in DTYPES if dt not in case.declared.dtypes]
    dims = case.declared.head_dims
    if dims is not None:
        odd = next(d for d in range(8, 512, 8) if d not in dims)
        refused.append((sorted(case.declared.dtypes, key=str)[0], odd, {}, "head dim"))
    if "coarse_gate" not in case.declared.features:
        refused.append((sorted(case.declared.dtypes, key=str)[0], 64, {"coarse_gate": True}, "feature"))
    for dtype, D, extra, reason in refused:
        q, k, v = make_qkv(1, 70, 1, D, dtype=dtype, device=case.device)
        kw = {"coarse_gate": q} if extra else {}
        with pytest.raises(solattn.BackendError, match=reason):
            case.run(q, k, v, topk_ratio=0.5, **kw)


@pytest.mark.parametrize("case", _cases(CASES))
def test_gradients_match_reference(case):
    """Gradients of a call on the backend (its own backward, or the recompute on a
    differentiable backend when it is forward-only) equal the reference's."""
    dtype = torch.float32 if torch.float32 in case.declared.dtypes else torch.bfloat16
    B, T, H, D = 1, 2 * BLOCK + 9, 2, case.head_dim(16)
    q, k, v = make_qkv(B, T, H, D, dtype=dtype, device=case.device, seed=12)
    w = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(1)).to(case.device)
    grads = {}
    for name in ("mine", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        if name == "mine":
            out = case.run(*leaves, topk_ratio=0.5)
        else:
            out = solattn.sol_attn(*leaves, topk_ratio=0.5, backend="reference")
        (out.float() * w).sum().backward()
        grads[name] = [x.grad for x in leaves]
    # A backward in bf16 rounds more than a forward does: dense SDPA's own bf16 gradients, against
    # its fp32 ones on the same inputs, set the level a sparse backward has to stay within.
    level = tolerance(dtype)
    if dtype != torch.float32:
        level = max(level, 2 * dense_gradient_error(q, k, v, w))
    for x, a, b in zip("qkv", grads["mine"], grads["reference"]):
        assert a is not None and rel_l2(a, b) < max(level, 1e-4), (x, rel_l2(a, b), level)




@pytest.mark.parametrize("case", _cases(COMPILED))
@pytest.mark.parametrize("T", [1, 30, 64, 65, 129])
def test_small_and_ragged_lengths(case, T):
    dtype = torch.float32 if torch.float32 in case.declared.dtypes else torch.bfloat16
    q, k, v = make_qkv(1, T, 2, case.head_dim(64), dtype=dtype, device=case.device, seed=T)
    for kw in (dict(topk_ratio=0.5), dict(tau=0.2), dict(tau=-1e9, tail=False)):
        got = case.run(q, k, v, **kw)
        want = solattn.sol_attn(q, k, v, backend="reference", **kw)
        assert rel_l2(got, want) < TOL[dtype]


@pytest.mark.parametrize("case", _cases(COMPILED))
def test_all_blocks_exact_equals_dense(case):
    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 300, 2, case.head_dim(64), dtype=dtype, device=case.device)
    for tail in (True, False):
        got = case.run(q, k, v, tau=-1e9, tail=tail)
        assert rel_l2(got, dense_attention(q, k, v)) < tolerance(dtype)


@pytest.mark.parametrize("case", _cases(COMPILED, cpu_slow=True))
def test_ties_kk_zero_and_sinks_at_both_edges(case):
    dtype = torch.float32 if torch.float32 in case.declared.dtypes else torch.bfloat16
    T, D = 10 * BLOCK, case.head_dim(64)
    q = torch.zeros(1, T, 1, D)
    k = torch.zeros(1, T, 1, D)
    q[..., 0] = 1.0
    for j, lv in enumerate([0.0, 0.1, 0.2, 5.0, 5.0, 5.0, 5.0, 0.3, 0.4, 0.5]):
        k[0, j * BLOCK:(j + 1) * BLOCK, 0, 0] = lv      # blocks 3..6 tie exactly
    v = torch.randn(1, T, 1, D, generator=torch.Generator().manual_seed(0))
    q, k, v = (x.to(dtype).to(case.device) for x in (q, k, v))
    for kw in (dict(topk_ratio=0.2, tail=False), dict(topk_ratio=0.2),
               dict(topk_ratio=0.9, sink_blocks=(0, 9), tail=False),        # n_eff = 1 -> kk = 0
               dict(topk_ratio=0.2, sink_blocks=(0, 1), sink_q=(9, 10)),
               dict(topk_ratio=0.2, sink_blocks=(9, 10), sink_q=(0, 1))):
        got = case.run(q, k, v, **kw)
        want = solattn.sol_attn(q, k, v, backend="reference", **kw)
        assert rel_l2(got, want) < TOL[dtype], kw


@pytest.mark.parametrize("case", _cases(COMPILED, cpu_slow=True))
def test_strided_permuted_sliced(case):
    dtype, D = torch.bfloat16, case.head_dim(64)
    q, k, v = make_qkv(2, 200, 3, D, dtype=dtype, device=case.device, seed=5)
    want = case.run(q, k, v, topk_ratio=0.4)
    perm = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    sliced = [torch.cat([x, torch.randn_like(x)], dim=-1)[..., :D] for x in (q, k, v)]
    every_other = [torch.stack([x, torch.randn_like(x)], 1).flatten(0, 1)[::2] for x in (q, k, v)]
    for args in (perm, sliced, every_other):
        assert not args[0].is_contiguous()
        assert torch.equal(case.run(*args, topk_ratio=0.4), want)


@pytest.mark.parametrize("case", _cases(COMPILED))
def test_batch_equals_each_alone_and_repeat_calls_bit_identical(case):
    dtype = torch.bfloat16
    q, k, v = make_qkv(3, 150, 2, case.head_dim(64), dtype=dtype, device=case.device, seed=6)
    full = case.run(q, k, v, topk_ratio=0.4)
    again = case.run(q, k, v, topk_ratio=0.4)
    assert torch.equal(full, again)
    for b in range(3):
        alone = case.run(q[b:b + 1], k[b:b + 1], v[b:b + 1], topk_ratio=0.4)
        assert rel_l2(full[b:b + 1], alone) < tolerance(dtype)


@pytest.mark.parametrize("case", _cases(CASES))
def test_all_masked_rows_are_zero_not_nan(case):
    dtype = torch.bfloat16
    q, k, v = make_qkv(1, 200, 2, case.head_dim(64), dtype=dtype, device=case.device)
    none = torch.zeros(200, dtype=torch.bool, device=case.device)
    out = case.run(q, k, v, tau=0.0, tail=False, key_bias=none)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("case", _cases(COMPILED))
def test_dead_rows_leave_live_outputs_bit_identical(case):
    dtype = torch.bfloat16
    T = 3 * BLOCK
    q, k, v = make_qkv(1, T, 2, case.head_dim(64), dtype=dtype, device=case.device, seed=7)
    bl = torch.tensor([20, 64, 5], dtype=torch.int32, device=case.device)
    live = _live_rows(T, bl).to(case.device)
    base = case.run(q, k, v, topk_ratio=0.5, block_len=bl)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, ~live] = (torch.randn_like(x[:, ~live].float()) * 100).to(dtype)
    other = case.run(q2, k2, v2, topk_ratio=0.5, block_len=bl)
    assert torch.equal(base[:, live], other[:, live])
    assert torch.isfinite(other).all()


# --- the portable backend specifically -------------------------------------------------------

SDPA_DEVICE_NAMES = [c.device for c in COMPILED if c.backend == "sdpa"]
SDPA_DEVICES = gpu_marked(SDPA_DEVICE_NAMES)


@pytest.mark.parametrize("kw,device", [
    pytest.param(kw, device, id=f"{name}-{device}", marks=pytest.mark.gpu if on_gpu(device)
                 else pytest.mark.slow if name == "tau-bias-blocklen" else ())
    for device in SDPA_DEVICE_NAMES
    for name, kw in [("topk-tail", dict(topk_ratio=0.3)), ("tau-bias-blocklen", dict(tau=0.3, key_bias="bias", block_len="bl")),
                     ("notail-gate", dict(topk_ratio=0.3, tail=False, coarse_gate="gate"))]])
def test_sdpa_gradients_match_reference(device, kw):
    B, T, H, D = 1, 3 * BLOCK - 10, 2, 16
    q, k, v = make_qkv(B, T, H, D, device=device, seed=3)
    gate = torch.randn(B, T, H, D, device=device)
    extra = {"bias": torch.randn(B, T, device=device),
             "bl": torch.tensor([64, 30, 40], dtype=torch.int32, device=device), "gate": gate}
    kw = {key: (extra[val] if isinstance(val, str) else val) for key, val in kw.items()}
    grads = {}
    for backend in ("sdpa", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gate)]
        kwb = dict(kw)
        if "coarse_gate" in kwb:
            kwb["coarse_gate"] = leaves[3]
        out = solattn.sol_attn(*leaves[:3], backend=backend, **kwb)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(device)
        (out * w).sum().backward()
        grads[backend] = [x.grad for x in leaves]
    names = ["q", "k", "v", "gate"]
    for name, a, b in zip(names, grads["sdpa"], grads["reference"]):
        if name == "gate" and "coarse_gate" not in kw:
            assert a is None and b is None
            continue
        assert a is not None and b is not None, name
        assert rel_l2(a, b) < 1e-4, name


@pytest.mark.parametrize("device", SDPA_DEVICES)
def test_sdpa_tail_gradients_match_reference_in_fp32(device):
    """fp32 gradients through the pooled tail equal the reference's to 1e-5, with query blocks
    whose tail is one key block (its total weight is then exactly 1, on the bound of the empty
    tail's guard), blocks whose tail has several and a block whose tail is empty."""
    B, T, H, D = 1, 3 * BLOCK + 8, 1, 16
    q, k, v = make_qkv(B, T, H, D, device=device, seed=2)
    n = math.ceil(T / BLOCK)
    tail_blocks = n - solattn.plan(q, k, v, topk_ratio=0.25, backend="sdpa").kv_num_blocks
    assert all((tail_blocks == c).any() for c in (0, 1, 2)), tail_blocks
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device)
    grads = {}
    for backend in ("sdpa", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        (solattn.sol_attn(*leaves, topk_ratio=0.25, tail=True, backend=backend) * w).sum().backward()
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip("qkv", grads["sdpa"], grads["reference"]):
        assert rel_l2(a, b) <= 1e-5, (name, rel_l2(a, b))


@pytest.mark.parametrize("device", SDPA_DEVICES)
def test_sdpa_writes_every_output_element(device, monkeypatch):
    from solattn.backends import sdpa as sdpamod
    monkeypatch.setattr(sdpamod.forward, "new_output",
                        lambda shape, dtype, dev: torch.full(shape, math.nan, dtype=dtype, device=dev))
    real_empty = sdpamod.layout.Workspace.empty                   # reused scratch (gathered blocks)
    monkeypatch.setattr(sdpamod.layout.Workspace, "empty",
                        lambda self, *a, **kw: real_empty(self, *a, **kw).fill_(math.nan))
    for T, kw in ((1, {}), (200, dict(topk_ratio=0.3)), (257, dict(tau=0.4, tail=False)),
                  (128, dict(tau=0.0, key_bias=torch.zeros(128, dtype=torch.bool)))):
        q, k, v = make_qkv(2, T, 2, 32, dtype=torch.bfloat16, device=device)
        kw = {a: (b.to(device) if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
        out = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
        assert torch.isfinite(out).all()


def test_sdpa_small_budget_same_result():
    from solattn.backends import sdpa as sdpamod
    q, k, v = make_qkv(1, 600, 2, 32, dtype=torch.float32, seed=9)
    bias = torch.randn(1, 600)
    p = validate(q, k, v, topk_ratio=0.3, key_bias=bias)
    plan = build_plan(p)
    big = sdpamod.sdpa_forward(p, plan)
    tiny = sdpamod.sdpa_forward(p, plan, nbytes=1)          # one query block per SDPA call
    assert rel_l2(tiny, big) < 1e-6


def test_memory_budget_api():
    from solattn.backends import sdpa as sdpamod
    from solattn.backends import reference as refmod
    with pytest.raises(ValueError, match="'nbytes'"):
        solattn.set_memory_budget(-1)
    for wrong in (1.5, "1024", True):                       # a wrong type is a TypeError, as everywhere
        with pytest.raises(TypeError, match=r"'nbytes' received .* of type .*; allowed: a positive int"):
            solattn.set_memory_budget(wrong)
        with pytest.raises(TypeError, match="'nbytes'"):
            with solattn.memory_budget(wrong):
                pass
    with pytest.raises(ValueError, match="'backend'.*allowed"):
        solattn.set_memory_budget(1 << 20, backend="triton")
    solattn.set_memory_budget(123456)
    assert sdpamod.budget.bytes == 123456
    with solattn.memory_budget(4096):
        assert sdpamod.budget.bytes == 4096
        with solattn.memory_budget(1 << 20, backend="reference"):
            assert refmod.budget.bytes == 1 << 20
        assert refmod.budget.bytes == 4 << 30
    assert sdpamod.budget.bytes == 123456
    solattn.set_memory_budget(None)
    assert sdpamod.budget.bytes == 1 << 30


def test_scoped_reference_budget_makes_it_refuse():
    q, k, v = make_qkv(1, 1024, 2, 8)
    with solattn.memory_budget(1 << 20, backend="reference"):
        with pytest.raises(solattn.BackendError, match="budget"):
            solattn.sol_attn(q, k, v, backend="reference")
    assert torch.isfinite(solattn.sol_attn(q, k, v, backend="reference")).all()


def _masks_in_input_dtype(monkeypatch):
    """The CPU's sdpa masks in q's dtype, as on a GPU (its device entry's ``fp32_masks`` off)."""
    monkeypatch.setitem(devices.DEVICES, "cpu", dataclasses.replace(devices.DEVICES["cpu"], fp32_masks=False))


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["topk", "tau", "key_bias", "bool_bias", "block_len", "everything"])
def test_sdpa_masks_in_input_dtype_as_on_gpus(feature, monkeypatch):
    """The mask-dtype branch taken on CUDA/XPU/MPS (mask in q's dtype), forced on the CPU: results
    match the reference, and the tail stays as precise as with fp32 masks."""
    B, T, H, D = 2, 700, 2, 64
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, seed=11)
    feats, bl = _features(B, T, H, D, "cpu", torch.bfloat16, seed=3)
    kw = feats[feature]
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    fp32 = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    _masks_in_input_dtype(monkeypatch)
    got = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    live = _live_rows(T, bl) if "block_len" in kw else torch.ones(T, dtype=torch.bool)
    err, err32 = rel_l2(got[:, live], want[:, live]), rel_l2(fp32[:, live], want[:, live])
    assert err < 1e-2 and err < 1.5 * err32 + 1e-4, (err, err32)


# --- robustness: shifted keys, huge finite biases, NaN in dead rows ----------------------------

@pytest.mark.parametrize("case", _cases(CASES))
def test_common_key_offset_keeps_bf16_precision(case):
    """SPEC.md centres the keys: adding one vector to every key leaves the output unchanged. In
    bf16 the error against the reference must not grow with that offset (it does if the centroid
    itself is rounded to bf16)."""
    q, k, v = make_qkv(1, 640, 2, 128, dtype=torch.bfloat16, device=case.device, seed=21, key_offset=0.0)
    k_off = (k.float() + 64.0).to(torch.bfloat16)
    for tail in (True, False):
        got = case.run(q, k_off, v, topk_ratio=0.2, tail=tail)
        want = solattn.sol_attn(q, k_off, v, topk_ratio=0.2, tail=tail, backend="reference")
        assert rel_l2(got, want) < 1e-2, tail


@pytest.mark.parametrize("case", _cases(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_finite_biases_stay_finite(case, dtype, monkeypatch, fp32_min=True):
    """A finite bias is a finite term: finfo(fp32).min or -1e5 on every key (tail off) is not an
    all -inf row, and +7e4 on one key makes that key dominate; nothing overflows to inf or 0."""
    T = 300
    q, k, v = make_qkv(1, T, 2, 64, dtype=dtype, device=case.device, seed=22)
    one = torch.zeros(T, device=case.device)
    one[70] = 7e4
    biases = [torch.full((T,), -1e5, device=case.device), one]
    if fp32_min:
        biases.append(torch.full((T,), torch.finfo(torch.float32).min, device=case.device))
    for bias in biases:
        got = case.run(q, k, v, tau=0.3, tail=False, key_bias=bias)
        want = solattn.sol_attn(q, k, v, tau=0.3, tail=False, key_bias=bias, backend="reference")
        if bias[0] < -65504 and _fp16_mask(case.backend, case.device, dtype):
            # documented: an fp16 mask holds the bias as -65504 on every key, a constant shift, so
            # the row is the unbiased softmax (the fp32 reference rounds logit + bias to bias and
            # averages uniformly instead)
            want = solattn.sol_attn(q, k, v, tau=0.3, tail=False, backend="reference")
        assert torch.isfinite(got).all()
        assert rel_l2(got, want) < 1e-2


def _fp16_mask(backend, device, dtype):
    from solattn.backends import sdpa as sdpamod
    return backend == "sdpa" and sdpamod.masks.mask_dtype(torch.device(device), dtype) == torch.float16


@pytest.mark.parametrize("case", _cases(CASES))
def test_nan_in_dead_rows_never_reaches_an_output(case):
    T = 3 * BLOCK
    q, k, v = make_qkv(1, T, 2, 64, dtype=torch.bfloat16, device=case.device, seed=23)
    bl = torch.tensor([20, 64, 5], dtype=torch.int32, device=case.device)
    live = _live_rows(T, bl).to(case.device)
    gate = torch.randn_like(q)
    for kw in (dict(topk_ratio=0.5), dict(tau=0.2, coarse_gate=gate)):
        base = case.run(q, k, v, block_len=bl, **kw)
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, ~live] = float("nan")
        got = case.run(q2, k2, v2, block_len=bl, **kw)
        assert torch.isfinite(got).all()
        assert torch.equal(got[:, live], base[:, live])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_finite_biases_with_masks_in_input_dtype(dtype, monkeypatch):
    """The GPU mask branch (mask in q's dtype) forced on the CPU: a finite bias beyond the
    dtype's range is clamped into it, not turned into -inf (which zeroed rows on an H200)."""
    _masks_in_input_dtype(monkeypatch)
    test_huge_finite_biases_stay_finite(BackendCase("sdpa", "cpu"), dtype, monkeypatch)


def _log2_prescaling_sdpa(q, k, v, attn_mask=None, scale=None):
    """SDPA as fused GPU kernels compute it: (logit + mask) * log2(e) in fp32, then exp2. A row
    whose scaled terms are all -inf (including finite entries that overflowed) comes out 0."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if attn_mask is not None:
        s = s + attn_mask.float()
    z = s * math.log2(math.e)
    mx = z.amax(dim=-1, keepdim=True)
    w = torch.exp2(z - torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx))
    out = (w @ v.float()) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return out.to(v.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("gpu_masks", [False, True], ids=["fp32-mask", "input-dtype-mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_huge_finite_bias_survives_log2_prescaling_kernels(dtype, gpu_masks, monkeypatch):
    """Every finite mask entry times log2(e) stays finite in fp32: a bias of finfo(fp32).min on
    every key ran as all-zero rows on an H200 when the bf16 mask held -3.39e38."""
    if gpu_masks:
        _masks_in_input_dtype(monkeypatch)
    T = 300
    q, k, v = make_qkv(1, T, 2, 64, dtype=dtype, seed=22)
    for tail in (False, True):
        for bias in (torch.full((T,), torch.finfo(torch.float32).min), torch.full((T,), -1e35)):
            want = solattn.sol_attn(q, k, v, tau=0.3, tail=tail, key_bias=bias, backend="reference")
            if _fp16_mask("sdpa", "cpu", dtype) and not tail:
                want = solattn.sol_attn(q, k, v, tau=0.3, tail=tail, backend="reference")
            with monkeypatch.context() as m:
                m.setattr(torch.nn.functional, "scaled_dot_product_attention", _log2_prescaling_sdpa)
                got = solattn.sol_attn(q, k, v, tau=0.3, tail=tail, key_bias=bias, backend="sdpa")
            assert torch.isfinite(got).all() and (got != 0).any(), (tail, bias[0])
            assert rel_l2(got, want) < TOL[dtype] * 10, (tail, bias[0])


@pytest.mark.slow
@pytest.mark.parametrize("gpu_masks", [False, True], ids=["cpu-fp32-mask", "gpu-bf16-mask"])
def test_sdpa_bf16_tail_error_does_not_grow_with_logits(gpu_masks, monkeypatch):
    """bf16 inputs are exact; the tail must not make the error grow with |logit| (it did when the
    keys were centred in fp32 and rounded back to bf16). With the tail the error stays at the level
    of the same call without it, up to max |logit| ~ 2000, with the mask in fp32 and in bf16."""
    if gpu_masks:
        _masks_in_input_dtype(monkeypatch)
    B, T, H, D = 1, 1024, 2, 128
    q0, k, v = make_qkv(B, T, H, D, dtype=torch.float32, seed=31)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    for mult in (1, 16, 256):
        q = (q0 * mult).to(torch.bfloat16)
        logit = (D ** -0.5 * torch.einsum("bthd,bshd->bhts", q.float(), k.float())).abs().max().item()
        errs = {}
        for tail in (True, False):
            want = solattn.sol_attn(q.float(), k.float(), v.float(), topk_ratio=0.1, tail=tail,
                                    backend="reference")
            got = solattn.sol_attn(q, k, v, topk_ratio=0.1, tail=tail, backend="sdpa")
            errs[tail] = rel_l2(got, want)
        assert errs[True] < 1.5 * errs[False] + 2e-4, (mult, logit, errs)
    assert logit > 1000


@pytest.mark.slow
@pytest.mark.parametrize("gpu_masks", [False, True], ids=["cpu-fp32-mask", "gpu-bf16-mask"])
def test_sdpa_tail_mask_per_row_only_where_the_residual_varies(gpu_masks, monkeypatch):
    """The tail's rounding residual r_t = scale q_t . (m - round_bf16(m)) takes one mask row per
    query row only in query blocks where it spreads more than 2**-10 around its block mean; on
    ordinary inputs that is few blocks, with a large key centroid (keys + 300, bf16 ulp 2) all.
    Either way the output matches the reference at bf16 precision."""
    from solattn.backends import sdpa as sdpamod
    if gpu_masks:
        _masks_in_input_dtype(monkeypatch)
    groups = []
    real = sdpamod.forward.group_rows
    monkeypatch.setattr(sdpamod.forward, "group_rows", lambda *a: groups.append(real(*a)) or groups[-1])
    shapes = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy_sdpa(q, k, v, attn_mask=None, **kw):
        shapes.append(tuple(attn_mask.shape))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    B, T, H, D = 1, 1024, 2, 128
    n = T // BLOCK
    q, k0, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, seed=5)
    fractions = {}
    for offset in (0.0, 300.0):
        k = (k0.float() + offset).to(torch.bfloat16)
        groups.clear()
        shapes.clear()
        got = solattn.sol_attn(q, k, v, topk_ratio=0.1, backend="sdpa")
        want = solattn.sol_attn(q, k, v, topk_ratio=0.1, backend="reference")
        assert rel_l2(got, want) < TOL[torch.bfloat16], offset
        # the rule, from its definition
        m = build_plan(validate(q, k, v, topk_ratio=0.1)).key_mean[:, :, 0]
        r = D ** -0.5 * torch.einsum("bthd,bhd->bht", q.float(), m - m.to(torch.bfloat16).float())
        r = r.reshape(B * H * n, BLOCK)
        want_rows = ((r - r.mean(1, keepdim=True)).abs().amax(1) > 2.0 ** -10).nonzero()[:, 0]
        per_row = torch.cat([g.rows for g in groups[0] if g.row_mask] + [torch.zeros(0, dtype=torch.long)])
        assert torch.equal(per_row.sort().values, want_rows), offset
        fractions[offset] = per_row.numel() / (B * H * n)
        # each SDPA call (query blocks as heads): one mask row per query row on the per-row path,
        # one per block elsewhere
        assert {s[0] for s in shapes} == {1}, offset
        assert sum(s[1] for s in shapes if s[2] == BLOCK) == per_row.numel(), offset
        assert sum(s[1] for s in shapes if s[2] == 1) == B * H * n - per_row.numel(), offset
    assert fractions[0.0] < 0.25 and fractions[300.0] == 1.0, fractions


@pytest.mark.parametrize("tail,bias_shape,device", [
    pytest.param(tail, shape, device, id=f"{'tail' if tail else 'notail'}-{shape}-{device}",
                 marks=pytest.mark.gpu if on_gpu(device) else () if (tail, shape) == (False, "B11T") else pytest.mark.slow)
    for device in SDPA_DEVICE_NAMES for tail in (True, False) for shape in ("T", "BT", "B11T")])
def test_key_bias_gradient_matches_reference_autograd(device, bias_shape, tail):
    """A float key_bias that requires grad gets the gradient the reference's autograd gives
    (sdpa's mask, clamp included, is differentiable in the bias); q, k, v's still match too."""
    B, T, H, D = 2, 3 * BLOCK - 10, 2, 16
    q, k, v = make_qkv(B, T, H, D, device=device, seed=4)
    g = torch.Generator().manual_seed(5)
    shape = {"T": (T,), "BT": (B, T), "B11T": (B, 1, 1, T)}[bias_shape]
    bias = (torch.randn(shape, generator=g) * 2).to(device)
    bias[..., 7] = -math.inf                          # a masked key: its gradient is 0
    w = torch.randn(B, T, H, D, generator=g).to(device)
    grads = {}
    for backend in ("sdpa", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
        out = solattn.sol_attn(*leaves[:3], topk_ratio=0.4, tail=tail, key_bias=leaves[3],
                               backend=backend)
        (out * w).sum().backward()
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip("qkvb", grads["sdpa"], grads["reference"]):
        assert a is not None and b is not None and a.shape == b.shape, name
        assert rel_l2(a, b) < 1e-4, name
    assert grads["sdpa"][3].abs().sum() > 0


@pytest.mark.slow
def test_key_bias_gradient_bool_bias_has_none_and_bias_only_grad_works():
    q, k, v = make_qkv(1, 130, 2, 16, seed=6)
    keep = torch.ones(130, dtype=torch.bool)
    keep[3] = False
    out = solattn.sol_attn(q.requires_grad_(True), k, v, topk_ratio=0.5, key_bias=keep)
    out.sum().backward()                                   # bool bias: no gradient, no error
    bias = torch.randn(130, requires_grad=True)            # only the bias requires grad
    out = solattn.sol_attn(q.detach(), k, v, topk_ratio=0.5, key_bias=bias, backend="sdpa")
    out.sum().backward()
    want = torch.randn(130, requires_grad=True)
    with torch.no_grad():
        want.copy_(bias)
    solattn.sol_attn(q.detach(), k, v, topk_ratio=0.5, key_bias=want, backend="reference").sum().backward()
    assert rel_l2(bias.grad, want.grad) < 1e-4


def test_key_bias_gradient_from_a_backend_that_drops_it_is_an_error(monkeypatch):
    """A differentiable backend whose forward detaches key_bias must not yield a silent None."""
    from dataclasses import replace
    from solattn.backends.sdpa import SdpaBackend, sdpa_forward

    class Detaching(SdpaBackend):
        name = "detaching"

        def forward(self, problem, plan):
            kb = problem.key_bias
            return sdpa_forward(replace(problem, key_bias=None if kb is None else kb.detach()), plan)

    monkeypatch.setitem(dispatch._REGISTRY, "detaching", Detaching())
    q, k, v = make_qkv(1, 130, 2, 16, seed=6)
    bias = torch.randn(130, requires_grad=True)
    out = solattn.sol_attn(q.requires_grad_(True), k, v, topk_ratio=0.5, key_bias=bias,
                           backend="detaching")
    with pytest.raises(solattn.BackendError, match="'detaching' cannot differentiate argument 'key_bias'"):
        out.sum().backward()


def test_sdpa_grouping_splits_rows_by_count_mask_and_raggedness():
    from solattn.backends.sdpa.grouping import group_rows
    counts = torch.tensor([3, 1, 3, 3, 1, 2])
    masked = torch.tensor([False, True, True, False, True, False])
    ragged = torch.tensor([False, False, False, True, True, False])
    got = {(g.count, g.masked, g.ragged): g.rows.tolist() for g in group_rows(counts, masked, ragged)}
    assert got == {(1, True, False): [1], (1, True, True): [4], (2, False, False): [5],
                   (3, False, False): [0], (3, False, True): [3], (3, True, False): [2]}
    assert [(g.count, g.rows.tolist()) for g in group_rows(counts, None, None)] == \
        [(1, [1, 4]), (2, [5]), (3, [0, 2, 3])]
    row_mask = torch.tensor([True, False, False, True, False, False])
    got = {(g.count, g.row_mask, g.masked): g.rows.tolist() for g in group_rows(counts, masked, None, row_mask)}
    assert got == {(1, False, True): [1, 4], (2, False, False): [5], (3, True, False): [0, 3],
                   (3, False, True): [2]}


def test_plan_marks_query_blocks_touching_dead_keys():
    from solattn.backends.sdpa.grouping import needs_mask
    T = 6 * BLOCK
    q, k, v = make_qkv(2, T, 2, 16, seed=8)
    bl = torch.tensor([64, 10, 64, 64, 64, 64], dtype=torch.int32)
    plan = build_plan(validate(q, k, v, topk_ratio=0.2, block_len=bl, tail=False))
    got = plan.touches_dead
    B, H, n = plan.kv_num_blocks.shape
    for b in range(B):
        for h in range(H):
            for i in range(n):
                kept = plan.kv_indices[b, h, i, :plan.kv_num_blocks[b, h, i]].tolist()
                assert bool(got[b, h, i]) == (1 in kept), (b, h, i, kept)
    assert torch.equal(needs_mask(plan, any_bias=False, tail=False), got)
    assert needs_mask(plan, any_bias=True, tail=False).all()
    full = build_plan(validate(q, k, v, topk_ratio=0.2, tail=False))
    assert needs_mask(full, any_bias=False, tail=False) is None       # nothing to mask: no mask


def test_sdpa_memory_model_sizes_chunks_within_the_budget():
    from solattn.backends.sdpa.memory import ChunkShape, chunk_bytes, rows_per_chunk
    s = ChunkShape(q_rows=64, key_blocks=5, D=128, elt=2, mask_elt=2, tail=True)
    assert chunk_bytes(3, s) == 3 * chunk_bytes(1, s)
    assert chunk_bytes(1, s) > chunk_bytes(1, ChunkShape(64, 5, 128, 2, 0, False))
    cuda = torch.device("cuda")                                        # no cap off the CPU
    for budget in (1, 10 << 20, 1 << 30):
        rows = rows_per_chunk(budget, s, cuda)
        assert rows >= 1 and (rows == 1 or chunk_bytes(rows, s) <= budget)
        assert chunk_bytes(rows + 1, s) > budget
    assert chunk_bytes(rows_per_chunk(1 << 30, s, torch.device("cpu")), s) <= 32 << 20


@pytest.mark.parametrize("rows", [32, 16])
@pytest.mark.parametrize("tail", [False, True])
def test_sdpa_query_rows_split_gives_the_same_output_and_gradients(monkeypatch, rows, tail):
    """SdpaTuning(query_rows=r): each query block runs as 64 / r items sharing its keys (SDPA sees
    (64 / r, nr, r, D) queries: the blocks as heads, and stride-0 keys); output and gradients are
    the default's, whose calls take the blocks as heads of one batch, (1, nr, 64, D) (tail with
    one mask row per query row, key_bias, dead rows, a ragged last block)."""
    from solattn.backends.sdpa import SdpaTuning, forward
    from solattn.config import tuning
    shapes = []
    real = forward.F.scaled_dot_product_attention
    monkeypatch.setattr(forward.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: shapes.append(tuple(q.shape)) or real(q, *a, **kw))
    T = 600
    q, k, v = make_qkv(2, T, 2, 32, seed=5)
    bl = torch.full(((T + 63) // 64,), 64, dtype=torch.int32)
    bl[2] = 20
    kw = dict(topk_ratio=0.3, key_bias=torch.randn(2, T), block_len=bl, tail=tail)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with tuning(SdpaTuning(query_rows=rows)):
        split = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
        out = solattn.sol_attn(*leaves, backend="sdpa", **kw)
    assert (64 // rows, rows) in {(s[0], s[2]) for s in shapes}
    assert {s[2] for s in shapes} <= {rows, T - 64 * 9}                # the ragged block is not split
    shapes.clear()
    default = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    assert {s[0] for s in shapes} == {1} and {s[2] for s in shapes} == {64, T - 64 * 9}
    live = torch.cat([torch.arange(64) < int(x) for x in bl])[:T]
    assert rel_l2(split[:, live], default[:, live]) < 1e-6
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    assert rel_l2(split[:, live], want[:, live]) < TOL[torch.float32]
    w = torch.randn_like(out) * live[None, :, None, None]
    got = torch.autograd.grad(out, leaves, w)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = solattn.sol_attn(*ref_leaves, backend="reference", **kw)
    for a, b in zip(got, torch.autograd.grad(ref, ref_leaves, w)):
        assert rel_l2(a, b) < 1e-4


@pytest.mark.parametrize("kwargs, kind", [(dict(query_rows=24), ValueError), (dict(query_rows=0), ValueError),
                                          (dict(query_rows=32.0), TypeError), (dict(parallel_bytes=-1), ValueError),
                                          (dict(parallel_flops=True), TypeError), (dict(chunk_threads=0), ValueError),
                                          (dict(chunk_threads=2.0), TypeError)])
def test_sdpa_tuning_rejects_bad_values(kwargs, kind):
    from solattn.backends.sdpa import SdpaTuning
    name = next(iter(kwargs))
    with pytest.raises(kind, match=f"SdpaTuning: argument '{name}' received"):
        SdpaTuning(**kwargs)


@pytest.mark.parametrize("large", [False, True])
def test_sdpa_on_cpu_runs_small_ops_on_one_thread_and_large_ones_on_all(monkeypatch, large):
    """On the CPU the portable forward runs with one intra-op thread, and only the ops at or above
    its thresholds (here forced: every op) with the caller's thread count, which it restores; the
    output is the reference's either way."""
    from solattn.backends.sdpa import forward
    seen = []
    real = forward.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)
    monkeypatch.setattr(forward.F, "scaled_dot_product_attention", spy)
    from solattn.backends.sdpa import SdpaTuning
    from solattn.config import tuning
    q, k, v = make_qkv(1, 300, 2, 16, seed=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        p = validate(q, k, v, topk_ratio=0.3, key_bias=torch.randn(300))
        small_serial = SdpaTuning(parallel_bytes=16 << 20, parallel_flops=1 << 26)
        with tuning(SdpaTuning(parallel_flops=0) if large else small_serial):
            out = forward.sdpa_forward(p, build_plan(p))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert after == 3
    assert seen and set(seen) == ({3} if large else {1})
    want = solattn.sol_attn(q, k, v, topk_ratio=0.3, key_bias=p.key_bias, backend="reference")
    assert rel_l2(out, want) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [False, True])
def test_sdpa_gathers_whole_blocks_from_layouts_when_they_fit(monkeypatch, dtype, tail):
    """Keys and values come from contiguous block layouts whenever one pair's layouts fit in the
    budget (row gathers straight from the inputs ran ~3x slower on an H200), and in inference
    the queries and the output too (no row gather or row scatter at all); with autograd
    recording the query rows are gathered from q. The row-gather fallback of tiny budgets gives
    the same output (tail, dead rows in keys and queries, key_bias, ragged T)."""
    from solattn.backends.sdpa import forward, layout, memory
    names = []
    real = layout.RowTable.gather
    monkeypatch.setattr(layout.RowTable, "gather",
                        lambda self, rows, work, name: names.append(name) or real(self, rows, work, name))
    T, D = 600, 32
    q, k, v = make_qkv(2, T, 3, D, dtype=dtype, seed=11)
    k[0, 84, 1] = float("nan")                                 # a dead row: never reaches an output
    q[1, 90, 2] = float("nan")                                 # a dead query row: its output is finite
    bl = torch.full(((T + 63) // 64,), 64, dtype=torch.int32)
    bl[1], bl[-1] = 10, T - 64 * (bl.numel() - 1)
    p = validate(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=torch.randn(2, T), tail=tail)
    plan = build_plan(p)
    blocks = forward.sdpa_forward(p, plan)
    assert names == []
    n, elt = p.n, q.element_size()
    tiny = forward.sdpa_forward(p, plan, nbytes=memory.layout_bytes(1, n, D, elt))
    assert {"q", "k", "v"} <= set(names)
    names.clear()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    pg = validate(*leaves, topk_ratio=0.3, block_len=bl, key_bias=p.key_bias, tail=tail)
    recorded = forward.sdpa_forward(pg, build_plan(pg))
    assert set(names) == {"q"}
    assert torch.isfinite(blocks).all()
    for other in (tiny, recorded.detach()):
        assert rel_l2(blocks, other) < (1e-6 if dtype == torch.float32 else 1e-2)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=p.key_bias, tail=tail,
                            backend="reference")
    live = torch.cat([torch.arange(64) < int(x) for x in bl])[:T]      # dead rows' outputs: unspecified
    assert rel_l2(blocks[:, live], want[:, live]) < TOL[dtype]
