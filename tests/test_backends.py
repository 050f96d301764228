"""Every backend that can run x every device present x every feature, against the reference.

Backends are discovered from the registry, so a new backend is tested the day it is
registered. Inputs carry well-separated block structure (conftest.make_qkv), so the
routing is unambiguous at every dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn.routing import build_plan
from solattn.validation import validate
from solattn import dispatch
from conftest import DEVICES, TOL, make_qkv, rel_l2

BLOCK = 64


def runnable(device):
    """(backend, device) pairs to test: every registered backend other than the oracle that is
    available on the device."""
    out = []
    for info in solattn.list_backends(device):
        if info["name"] != "reference" and info["available"]:
            out.append(info["name"])
    return out


PAIRS = [(b, d) for d in DEVICES for b in runnable(d)]
PAIR_IDS = [f"{b}-{d}" for b, d in PAIRS]


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


def _live_rows(T, bl):
    live = torch.zeros(T, dtype=torch.bool)
    L = bl.cpu().clamp(1, BLOCK)
    for j in range(L.shape[0]):
        live[j * BLOCK:j * BLOCK + int(L[j])] = True
    return live


def supported(backend, device, dtype):
    b = dispatch.get_backend(backend)
    return dtype in b.dtypes


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_backend_matches_reference(backend, device, feature, dtype):
    if not supported(backend, device, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    B, T, H, D = 2, 5 * BLOCK - 17, 2, 32
    q, k, v = make_qkv(B, T, H, D, dtype=dtype, device=device, seed=FEATURES.index(feature))
    feats, bl = _features(B, T, H, D, device, dtype, seed=len(feature))
    kw = feats[feature]
    got = solattn.sol_attn(q, k, v, backend=backend, **kw)
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    live = _live_rows(T, bl) if "block_len" in kw else torch.ones(T, dtype=torch.bool)
    assert rel_l2(got.cpu()[:, live], want.cpu()[:, live]) < TOL[dtype]
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("T", [1, 30, 64, 65, 129])
def test_small_and_ragged_lengths(backend, device, T):
    dtype = torch.float32 if supported(backend, device, torch.float32) else torch.bfloat16
    q, k, v = make_qkv(1, T, 2, 64, dtype=dtype, device=device, seed=T)
    for kw in (dict(topk_ratio=0.5), dict(tau=0.2), dict(tau=-1e9, tail=False)):
        got = solattn.sol_attn(q, k, v, backend=backend, **kw)
        want = solattn.sol_attn(q, k, v, backend="reference", **kw)
        assert rel_l2(got, want) < TOL[dtype]


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_all_blocks_exact_equals_dense(backend, device):
    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 300, 2, 64, dtype=dtype, device=device)
    for tail in (True, False):
        got = solattn.sol_attn(q, k, v, tau=-1e9, tail=tail, backend=backend)
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
        assert rel_l2(got, want) < 1e-2


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_ties_kk_zero_and_sinks_at_both_edges(backend, device):
    dtype = torch.float32 if supported(backend, device, torch.float32) else torch.bfloat16
    T, D = 10 * BLOCK, 64
    q = torch.zeros(1, T, 1, D)
    k = torch.zeros(1, T, 1, D)
    q[..., 0] = 1.0
    for j, lv in enumerate([0.0, 0.1, 0.2, 5.0, 5.0, 5.0, 5.0, 0.3, 0.4, 0.5]):
        k[0, j * BLOCK:(j + 1) * BLOCK, 0, 0] = lv      # blocks 3..6 tie exactly
    v = torch.randn(1, T, 1, D, generator=torch.Generator().manual_seed(0))
    q, k, v = (x.to(dtype).to(device) for x in (q, k, v))
    for kw in (dict(topk_ratio=0.2, tail=False), dict(topk_ratio=0.2),
               dict(topk_ratio=0.9, sink_blocks=(0, 9), tail=False),        # n_eff = 1 -> kk = 0
               dict(topk_ratio=0.2, sink_blocks=(0, 1), sink_q=(9, 10)),
               dict(topk_ratio=0.2, sink_blocks=(9, 10), sink_q=(0, 1))):
        got = solattn.sol_attn(q, k, v, backend=backend, **kw)
        want = solattn.sol_attn(q, k, v, backend="reference", **kw)
        assert rel_l2(got, want) < TOL[dtype], kw


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_strided_permuted_sliced(backend, device):
    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 200, 3, 64, dtype=dtype, device=device, seed=5)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.4, backend=backend)
    perm = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    sliced = [torch.cat([x, torch.randn_like(x)], dim=-1)[..., :64] for x in (q, k, v)]
    every_other = [torch.stack([x, torch.randn_like(x)], 1).flatten(0, 1)[::2] for x in (q, k, v)]
    for args in (perm, sliced, every_other):
        assert not args[0].is_contiguous()
        assert torch.equal(solattn.sol_attn(*args, topk_ratio=0.4, backend=backend), want)


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_batch_equals_each_alone_and_repeat_calls_bit_identical(backend, device):
    dtype = torch.bfloat16
    q, k, v = make_qkv(3, 150, 2, 64, dtype=dtype, device=device, seed=6)
    full = solattn.sol_attn(q, k, v, topk_ratio=0.4, backend=backend)
    again = solattn.sol_attn(q, k, v, topk_ratio=0.4, backend=backend)
    assert torch.equal(full, again)
    for b in range(3):
        alone = solattn.sol_attn(q[b:b + 1], k[b:b + 1], v[b:b + 1], topk_ratio=0.4, backend=backend)
        assert rel_l2(full[b:b + 1], alone) < 1e-2


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_all_masked_rows_are_zero_not_nan(backend, device):
    dtype = torch.bfloat16
    q, k, v = make_qkv(1, 200, 2, 64, dtype=dtype, device=device)
    none = torch.zeros(200, dtype=torch.bool, device=device)
    out = solattn.sol_attn(q, k, v, tau=0.0, tail=False, key_bias=none, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend,device", PAIRS, ids=PAIR_IDS)
def test_dead_rows_leave_live_outputs_bit_identical(backend, device):
    dtype = torch.bfloat16
    T = 3 * BLOCK
    q, k, v = make_qkv(1, T, 2, 64, dtype=dtype, device=device, seed=7)
    bl = torch.tensor([20, 64, 5], dtype=torch.int32, device=device)
    live = _live_rows(T, bl).to(device)
    base = solattn.sol_attn(q, k, v, topk_ratio=0.5, block_len=bl, backend=backend)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, ~live] = (torch.randn_like(x[:, ~live].float()) * 100).to(dtype)
    other = solattn.sol_attn(q2, k2, v2, topk_ratio=0.5, block_len=bl, backend=backend)
    assert torch.equal(base[:, live], other[:, live])
    assert torch.isfinite(other).all()


# --- the portable backend specifically -------------------------------------------------------

SDPA_DEVICES = [d for d in DEVICES if "sdpa" in runnable(d)]


@pytest.mark.parametrize("device", SDPA_DEVICES)
@pytest.mark.parametrize("kw", [dict(topk_ratio=0.3), dict(tau=0.3, key_bias="bias", block_len="bl"),
                                dict(topk_ratio=0.3, tail=False, coarse_gate="gate")],
                         ids=["topk-tail", "tau-bias-blocklen", "notail-gate"])
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



@pytest.mark.parametrize("feature", ["topk", "tau", "key_bias", "bool_bias", "block_len", "everything"])
def test_sdpa_masks_in_input_dtype_as_on_gpus(feature, monkeypatch):
    """The mask-dtype branch taken on CUDA/XPU/MPS (mask in q's dtype), forced on the CPU: results
    match the reference, and the tail stays as precise as with fp32 masks."""
    from solattn.backends import sdpa as sdpamod
    B, T, H, D = 2, 700, 2, 64
    q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, seed=11)
    feats, bl = _features(B, T, H, D, "cpu", torch.bfloat16, seed=3)
    kw = feats[feature]
    want = solattn.sol_attn(q, k, v, backend="reference", **kw)
    fp32 = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    monkeypatch.setattr(sdpamod.masks, "FP32_MASK_DEVICES", frozenset())
    got = solattn.sol_attn(q, k, v, backend="sdpa", **kw)
    live = _live_rows(T, bl) if "block_len" in kw else torch.ones(T, dtype=torch.bool)
    err, err32 = rel_l2(got[:, live], want[:, live]), rel_l2(fp32[:, live], want[:, live])
    assert err < 1e-2 and err < 1.5 * err32 + 1e-4, (err, err32)


# --- robustness: shifted keys, huge finite biases, NaN in dead rows ----------------------------

def _interp_pairs():
    """PAIRS plus the Triton kernel in its interpreter on the CPU (triton >= 3.9), so these cases
    also run in CI without a GPU."""
    pairs = list(PAIRS)
    try:
        import triton
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9) and ("triton", "cpu") not in pairs:
            pairs.append(("triton", "cpu"))
    except ImportError:
        pass
    return pairs


ROBUST = _interp_pairs()


def _run(backend, device, monkeypatch, *args, **kw):
    if backend == "triton" and device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return solattn.sol_attn(*args, backend=backend, **kw)


@pytest.mark.parametrize("backend,device", ROBUST, ids=[f"{b}-{d}" for b, d in ROBUST])
def test_common_key_offset_keeps_bf16_precision(backend, device, monkeypatch):
    """SPEC.md centres the keys: adding one vector to every key leaves the output unchanged. In
    bf16 the error against the reference must not grow with that offset (it does if the centroid
    itself is rounded to bf16)."""
    q, k, v = make_qkv(1, 640, 2, 128, dtype=torch.bfloat16, device=device, seed=21, key_offset=0.0)
    k_off = (k.float() + 64.0).to(torch.bfloat16)
    for tail in (True, False):
        got = _run(backend, device, monkeypatch, q, k_off, v, topk_ratio=0.2, tail=tail)
        want = solattn.sol_attn(q, k_off, v, topk_ratio=0.2, tail=tail, backend="reference")
        assert rel_l2(got, want) < 1e-2, tail


@pytest.mark.parametrize("backend,device", ROBUST, ids=[f"{b}-{d}" for b, d in ROBUST])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_finite_biases_stay_finite(backend, device, dtype, monkeypatch, fp32_min=True):
    """A finite bias is a finite term: finfo(fp32).min or -1e5 on every key (tail off) is not an
    all -inf row, and +7e4 on one key makes that key dominate; nothing overflows to inf or 0."""
    T = 300
    q, k, v = make_qkv(1, T, 2, 64, dtype=dtype, device=device, seed=22)
    one = torch.zeros(T, device=device)
    one[70] = 7e4
    biases = [torch.full((T,), -1e5, device=device), one]
    if fp32_min:
        biases.append(torch.full((T,), torch.finfo(torch.float32).min, device=device))
    for bias in biases:
        got = _run(backend, device, monkeypatch, q, k, v, tau=0.3, tail=False, key_bias=bias)
        want = solattn.sol_attn(q, k, v, tau=0.3, tail=False, key_bias=bias, backend="reference")
        if bias[0] < -65504 and _fp16_mask(backend, device, dtype):
            # documented: an fp16 mask holds the bias as -65504 on every key, a constant shift, so
            # the row is the unbiased softmax (the fp32 reference rounds logit + bias to bias and
            # averages uniformly instead)
            want = solattn.sol_attn(q, k, v, tau=0.3, tail=False, backend="reference")
        assert torch.isfinite(got).all()
        assert rel_l2(got, want) < 1e-2


def _fp16_mask(backend, device, dtype):
    from solattn.backends import sdpa as sdpamod
    return backend == "sdpa" and sdpamod.masks.mask_dtype(torch.device(device), dtype) == torch.float16


@pytest.mark.parametrize("backend,device", ROBUST, ids=[f"{b}-{d}" for b, d in ROBUST])
def test_nan_in_dead_rows_never_reaches_an_output(backend, device, monkeypatch):
    T = 3 * BLOCK
    q, k, v = make_qkv(1, T, 2, 64, dtype=torch.bfloat16, device=device, seed=23)
    bl = torch.tensor([20, 64, 5], dtype=torch.int32, device=device)
    live = _live_rows(T, bl).to(device)
    gate = torch.randn_like(q)
    for kw in (dict(topk_ratio=0.5), dict(tau=0.2, coarse_gate=gate)):
        base = _run(backend, device, monkeypatch, q, k, v, block_len=bl, **kw)
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, ~live] = float("nan")
        got = _run(backend, device, monkeypatch, q2, k2, v2, block_len=bl, **kw)
        assert torch.isfinite(got).all()
        assert torch.equal(got[:, live], base[:, live])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_finite_biases_with_masks_in_input_dtype(dtype, monkeypatch):
    """The GPU mask branch (mask in q's dtype) forced on the CPU: a finite bias beyond the
    dtype's range is clamped into it, not turned into -inf (which zeroed rows on an H200)."""
    from solattn.backends import sdpa as sdpamod
    monkeypatch.setattr(sdpamod.masks, "FP32_MASK_DEVICES", frozenset())
    test_huge_finite_biases_stay_finite("sdpa", "cpu", dtype, monkeypatch)


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


@pytest.mark.parametrize("gpu_masks", [False, True], ids=["fp32-mask", "input-dtype-mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_huge_finite_bias_survives_log2_prescaling_kernels(dtype, gpu_masks, monkeypatch):
    """Every finite mask entry times log2(e) stays finite in fp32: a bias of finfo(fp32).min on
    every key ran as all-zero rows on an H200 when the bf16 mask held -3.39e38."""
    from solattn.backends import sdpa as sdpamod
    if gpu_masks:
        monkeypatch.setattr(sdpamod.masks, "FP32_MASK_DEVICES", frozenset())
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


@pytest.mark.parametrize("gpu_masks", [False, True], ids=["cpu-fp32-mask", "gpu-bf16-mask"])
def test_sdpa_bf16_tail_error_does_not_grow_with_logits(gpu_masks, monkeypatch):
    """bf16 inputs are exact; the tail must not make the error grow with |logit| (it did when the
    keys were centred in fp32 and rounded back to bf16). With the tail the error stays at the level
    of the same call without it, up to max |logit| ~ 2000, with the mask in fp32 and in bf16."""
    from solattn.backends import sdpa as sdpamod
    if gpu_masks:
        monkeypatch.setattr(sdpamod.masks, "FP32_MASK_DEVICES", frozenset())
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


@pytest.mark.parametrize("device", SDPA_DEVICES)
@pytest.mark.parametrize("bias_shape", ["T", "BT", "B11T"])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "notail"])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_gathers_whole_blocks_from_layouts_when_they_fit(monkeypatch, dtype):
    """Keys and values come from contiguous block layouts whenever one pair's layouts fit in the
    budget (row gathers straight from the inputs ran ~3x slower on an H200); the row-gather
    fallback of tiny budgets gives the same output (tail, dead rows, key_bias, ragged T)."""
    from solattn.backends.sdpa import forward, layout, memory
    names = []
    real = layout.RowTable.gather
    monkeypatch.setattr(layout.RowTable, "gather",
                        lambda self, rows, work, name: names.append(name) or real(self, rows, work, name))
    T, D = 600, 32
    q, k, v = make_qkv(2, T, 3, D, dtype=dtype, seed=11)
    k[0, 84, 1] = float("nan")                                 # a dead row: never reaches an output
    bl = torch.full(((T + 63) // 64,), 64, dtype=torch.int32)
    bl[1], bl[-1] = 10, T - 64 * (bl.numel() - 1)
    p = validate(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=torch.randn(2, T))
    plan = build_plan(p)
    blocks = forward.sdpa_forward(p, plan)
    assert set(names) == {"q"}
    names.clear()
    n, elt = p.n, q.element_size()
    tiny = forward.sdpa_forward(p, plan, nbytes=memory.layout_bytes(1, n, D, elt))
    assert {"k", "v"} <= set(names)
    assert torch.isfinite(blocks).all()
    assert rel_l2(blocks, tiny) < (1e-6 if dtype == torch.float32 else 1e-2)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.3, block_len=bl, key_bias=p.key_bias,
                            backend="reference")
    assert rel_l2(blocks, want) < TOL[dtype]
