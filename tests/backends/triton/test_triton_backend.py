"""The ``triton`` backend's kernel, run by Triton's CPU interpreter, against the reference.

The interpreter runs the very kernel source the GPU compiles (one difference: for bf16
inputs ``launch`` hands the interpreter fp32 copies of q, k and v, because the
interpreter's ``tl.dot`` multiplies bf16 bit patterns as integers; the output stays
bf16). Problems are tiny (T <= 300, H <= 2, D = 64) so the whole file runs in seconds.

Selection: inputs are solattn.testing.make_qkv (well separated blocks), whose routing scores
sit far (>> fp32 rounding) from every threshold; ``_assert_selection_clear`` checks that
before comparing, so the plan and the reference select the same blocks. The kernel through
``sol_attn`` (every feature, dtype refusals) is in the generated matrix in test_backends.py.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    # Triton's interpreter changed between releases (3.6's fails on the reductions used here);
    # on GPU machines the compiled kernel is tested by tests/backends/test_backends.py instead.
    pytest.skip(f"interpreter tests need triton >= 3.9 (found {triton.__version__})", allow_module_level=True)

from solattn.routing import build_plan  # noqa: E402
from solattn.validation import validate  # noqa: E402
from solattn.backends.reference import reference_forward  # noqa: E402
from solattn.backends.triton import KernelConfig, TritonBackend, launch  # noqa: E402
from solattn.testing import assert_selection_clear, make_qkv, rel_l2, tolerance  # noqa: E402

BACKEND = TritonBackend()
TOL = tolerance(torch.bfloat16)  # the kernel takes bf16 and fp16 only; both have the same tolerance


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Run the kernel in Triton's interpreter (only inside this module's tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)




def _check(problem, tol=TOL, config=None):
    """Triton vs reference on ``problem``, with a poisoned output buffer."""
    assert_selection_clear(problem, margin=1e-6)
    plan = build_plan(problem)
    out = torch.full(problem.q.shape, float("nan"), dtype=problem.v.dtype)
    got = launch(problem, plan, config=config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.dtype == problem.v.dtype and got.shape == problem.q.shape and got.is_contiguous()
    assert torch.isfinite(got).all(), "kernel left elements unwritten (NaN poison) or produced inf/NaN"
    ref = reference_forward(problem)
    err = rel_l2(got, ref)
    assert err < tol, f"relative L2 {err:.3e} >= {tol} ({problem.describe()})"
    return got, ref


# ----------------------------------------------------------------------------- modes and tail

@pytest.mark.parametrize("mode, tail", [pytest.param("topk", False),           # the default run's case
                                        pytest.param("topk", True, marks=pytest.mark.slow),
                                        pytest.param("tau", False, marks=pytest.mark.slow),
                                        pytest.param("tau", True, marks=pytest.mark.slow)])
def test_modes_and_tail(mode, tail):
    q, k, v = make_qkv(1, 300, 2, 64, dtype=torch.bfloat16, seed=10)
    kw = dict(topk_ratio=0.3) if mode == "topk" else dict(tau=0.5)
    _check(validate(q, k, v, tail=tail, **kw))


@pytest.mark.slow
def test_fp16_and_b2():
    q, k, v = make_qkv(2, 200, 2, 64, dtype=torch.float16, seed=20)
    _check(validate(q, k, v, topk_ratio=0.25, tail=True))


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 30, 65, 200])
def test_ragged_T(T):
    q, k, v = make_qkv(1, T, 1, 64, dtype=torch.bfloat16, seed=30 + T)
    _check(validate(q, k, v, topk_ratio=0.4, tail=True))


@pytest.mark.slow
@pytest.mark.parametrize("scale", [-0.2, 0.0, 0.3])
def test_any_finite_scale(scale):
    """A positive scale is folded into the softmax's multiply-add (the row max is taken on the raw
    logits, then scaled); a negative scale would turn that max into a min, so it keeps the
    scale-first path, as does zero. All three match the reference (at zero every routing score
    ties, which the plan and the reference both resolve by keeping every tied block)."""
    q, k, v = make_qkv(1, 200, 2, 64, dtype=torch.bfloat16, seed=12)
    problem = validate(q, k, v, topk_ratio=0.4, tail=True, scale=scale)
    if scale:
        _check(problem)
    else:
        got = launch(problem, build_plan(problem))
        assert rel_l2(got, reference_forward(problem)) < TOL


# ----------------------------------------------------------------------------- key_bias

@pytest.mark.slow
def test_key_bias_float_b2():
    B, T = 2, 200
    q, k, v = make_qkv(B, T, 2, 64, dtype=torch.bfloat16, seed=40)
    bias = _rand((B, T), torch.float32, 45) * 2.0
    bias[0, 70:100] = -math.inf
    bias[1, 0:64] = -math.inf
    _check(validate(q, k, v, topk_ratio=0.3, tail=True, key_bias=bias))


@pytest.mark.slow
def test_key_bias_bool_all_masked_tail_off_is_zero():
    q, k, v = make_qkv(1, 130, 2, 64, dtype=torch.bfloat16, seed=50)
    keep = torch.zeros(130, dtype=torch.bool)
    got, ref = _check(validate(q, k, v, topk_ratio=0.5, tail=False, key_bias=keep))
    assert (got == 0).all() and (ref == 0).all()


@pytest.mark.slow
def test_key_bias_all_masked_tail_on_gives_tail():
    q, k, v = make_qkv(1, 130, 2, 64, dtype=torch.bfloat16, seed=55)
    bias = torch.full((1, 1, 1, 130), -math.inf)
    _check(validate(q, k, v, tau=0.5, tail=True, key_bias=bias))


@pytest.mark.slow
def test_key_bias_some_query_blocks_fully_masked():
    # tau very high: only the forced neighbours are exact; masking blocks 0..2 leaves
    # query blocks 0 and 1 with every exact key masked -> 0 rows (tail off)
    T = 300
    q, k, v = make_qkv(1, T, 2, 64, dtype=torch.bfloat16, seed=60)
    bias = torch.zeros(T)
    bias[: 3 * 64] = -math.inf
    got, ref = _check(validate(q, k, v, tau=50.0, tail=False, key_bias=bias))
    assert (got[:, :128] == 0).all()
    assert (got[:, 192:].abs().sum(-1) > 0).all()


# ----------------------------------------------------------------------------- block_len

@pytest.mark.slow
def test_block_len_dead_rows():
    T = 200  # n = 4, last block has 8 rows
    q, k, v = make_qkv(1, T, 2, 64, dtype=torch.bfloat16, seed=70)
    block_len = torch.tensor([64, 40, 1, 30], dtype=torch.int32)
    got, ref = _check(validate(q, k, v, topk_ratio=0.5, tail=True, block_len=block_len))
    assert torch.isfinite(got).all()


@pytest.mark.slow
def test_block_len_with_bias_and_coarse():
    T = 256
    q, k, v = make_qkv(1, T, 1, 64, dtype=torch.bfloat16, seed=75)
    gate = _rand((1, T, 1, 64), torch.bfloat16, 79)
    block_len = torch.tensor([17, 64, 64, 33], dtype=torch.int32)
    bias = _rand((T,), torch.float32, 78)
    _check(validate(q, k, v, tau=0.3, tail=True, block_len=block_len, key_bias=bias, coarse_gate=gate))


# ----------------------------------------------------------------------------- sinks, coarse

@pytest.mark.slow
def test_sinks_and_sink_q():
    q, k, v = make_qkv(1, 300, 2, 64, dtype=torch.bfloat16, seed=80)
    _check(validate(q, k, v, topk_ratio=0.2, tail=True, sink_blocks=(0, 1), sink_q=(2, 3)))


@pytest.mark.slow
def test_sinks_at_the_edge_tau():
    q, k, v = make_qkv(1, 300, 1, 64, dtype=torch.bfloat16, seed=85)
    _check(validate(q, k, v, tau=1.0, tail=True, sink_blocks=(4, 9), sink_q=(0, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("tail", [False, True])
def test_coarse_gate(tail):
    q, k, v = make_qkv(2, 200, 2, 64, dtype=torch.bfloat16, seed=90)
    gate = _rand(q.shape, torch.bfloat16, 95)
    _check(validate(q, k, v, topk_ratio=0.3, tail=tail, coarse_gate=gate))


@pytest.mark.slow
@pytest.mark.parametrize("block_len", [False, True])
def test_tma_descriptor_loads(block_len):
    # B=2 and a ragged T: rows past T come back zero-filled from the descriptor and are masked;
    # with block_len the launcher must fall back to pointer loads (dead rows inside T)
    B, T = 2, 200
    q, k, v = make_qkv(B, T, 2, 64, dtype=torch.bfloat16, seed=150)
    bias = _rand((B, T), torch.float32, 151)
    gate = _rand(q.shape, torch.bfloat16, 152)
    kw = dict(block_len=torch.tensor([64, 30, 64, 8], dtype=torch.int32)) if block_len else {}
    problem = validate(q, k, v, topk_ratio=0.3, tail=True, key_bias=bias, coarse_gate=gate, **kw)
    got, _ = _check(problem, config=KernelConfig(4, 3, tma=True))
    pointer = launch(problem, build_plan(problem), config=KernelConfig(4, 3, tma=False))
    assert torch.equal(got, pointer), "TMA and pointer loads disagree"


# ----------------------------------------------------------------------------- configurations

@pytest.mark.parametrize("field,value", [
    ("num_warps", 3), ("num_warps", 16),
    ("num_stages", 0), ("num_stages", 7), ("tma", 2), ("tma", 4),
])
def test_kernel_config_rejects_values_that_do_not_ship(field, value):
    with pytest.raises(ValueError) as err:
        KernelConfig(**{field: value})
    msg = str(err.value)
    assert f"'{field}'" in msg and repr(value) in msg and "allowed" in msg, msg


@pytest.mark.parametrize("field,value", [("num_warps", 4.0), ("num_warps", "4"), ("num_stages", True),
                                         ("tma", "yes")])
def test_kernel_config_rejects_wrong_types(field, value):
    with pytest.raises(TypeError, match=f"'{field}'"):
        KernelConfig(**{field: value})


def test_kernel_config_accepts_what_ships():
    from solattn.backends.triton import DEFAULT_CONFIGS
    assert KernelConfig(tma=1) == KernelConfig(tma=True)
    for cfg in DEFAULT_CONFIGS.values():
        assert KernelConfig(cfg.num_warps, cfg.num_stages, cfg.tma) == cfg


def test_launch_refuses_configs_that_do_not_ship():
    """Diagnostic and losing variants are not reachable through ``launch``: a config that names
    one is refused before the kernel runs (the poisoned output stays untouched)."""
    import dataclasses
    import types
    q, k, v = make_qkv(1, 130, 1, 64, dtype=torch.bfloat16, seed=160)
    problem = validate(q, k, v, topk_ratio=0.5)
    plan = build_plan(problem)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    with pytest.raises(TypeError, match="diag"):
        KernelConfig(4, 3, diag=1)
    with pytest.raises(ValueError, match="num_stages"):
        launch(problem, plan, config=dataclasses.replace(KernelConfig(), num_stages=1), out=out)
    duck = types.SimpleNamespace(num_warps=4, num_stages=3, tma=False, diag=1)
    with pytest.raises(TypeError, match="'config'"):
        launch(problem, plan, config=duck, out=out)
    assert out.isnan().all()


def test_interpreter_run_leaves_triton_unpatched():
    """An interpreted launch swaps Triton's @jit library functions (tl.sum, tl.max) and the
    kernel's pieces for interpreted twins only while it runs: afterwards they are the compiled
    functions again, so a later GPU launch in the same process still compiles them."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from solattn.backends.triton import kernel
    before = (tl.sum, tl.max, kernel.softmax_update, kernel.sol_attn_fwd)
    q, k, v = make_qkv(1, 70, 1, 64, dtype=torch.bfloat16, seed=170)
    _check(validate(q, k, v, topk_ratio=0.5, tail=True))
    after = (tl.sum, tl.max, kernel.softmax_update, kernel.sol_attn_fwd)
    assert all(a is b for a, b in zip(before, after))
    assert isinstance(kernel.softmax_update, JITFunction) and isinstance(kernel.sol_attn_fwd, JITFunction)


# ----------------------------------------------------------------------------- layouts

@pytest.mark.slow
def test_strided_and_permuted_inputs():
    B, T, H, D = 2, 200, 2, 64
    q = _rand((B, H, T, D), torch.bfloat16, 100).permute(0, 2, 1, 3)        # (B, T, H, D) view
    k = _rand((B, T, H, 2 * D), torch.bfloat16, 101)[..., ::2]              # inner stride 2
    v = _rand((T, B, H, D), torch.bfloat16, 102).transpose(0, 1)            # batch-inner layout
    gate = _rand((B, T, D, H), torch.bfloat16, 103).transpose(2, 3)          # stride(-1) != 1
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or gate.is_contiguous())
    problem = validate(q, k, v, topk_ratio=0.3, tail=True, coarse_gate=gate)
    got, _ = _check(problem)
    contiguous = validate(q.contiguous(), k.contiguous(), v.contiguous(), topk_ratio=0.3, tail=True,
                          coarse_gate=gate.contiguous())
    same = launch(contiguous, build_plan(contiguous))
    assert torch.equal(got, same), "strides changed the result"


@pytest.mark.slow
def test_centring_is_shift_invariant():
    q, k, v = make_qkv(1, 200, 1, 64, dtype=torch.float16, seed=110)
    shift = _rand((64,), torch.float32, 111) * 4
    a = validate(q, k, v, topk_ratio=0.3, tail=True)
    b = validate(q, (k.float() + shift).half(), v, topk_ratio=0.3, tail=True)
    # both agree with the reference of their own inputs, and with each other
    got_a, _ = _check(a)
    got_b, _ = _check(b)
    assert rel_l2(got_b, got_a) < 2e-2


# ----------------------------------------------------------------------------- dispatch

def test_reasons(monkeypatch):
    q, k, v = make_qkv(1, 64, 1, 64, dtype=torch.bfloat16, seed=130)
    assert BACKEND.not_supported_reasons(validate(q, k, v)) == []
    f32 = validate(q.float(), k.float(), v.float())
    assert any("float32" in r for r in BACKEND.not_supported_reasons(f32))
    odd = validate(*(_rand((1, 64, 1, 48), torch.bfloat16, 131 + i) for i in range(3)))
    assert any("head dim 48" in r for r in BACKEND.not_supported_reasons(odd))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert any("TRITON_INTERPRET" in r for r in BACKEND.availability_reasons("cpu"))
    monkeypatch.delenv("SOLATTN_TRITON_XPU", raising=False)
    assert any("Intel" in r for r in BACKEND.availability_reasons("xpu"))
    assert BACKEND.availability_reasons("mps")
    with pytest.raises(ValueError, match="plan"):
        BACKEND.forward(validate(q, k, v), None)


def test_gpu_launches_ask_for_fused_multiply_adds():
    """A launch compiled for the GPU asks Triton for floating-point contraction explicitly (the
    kernels were measured with it; Triton 3.10 turns its default off), passing everything else
    through; the interpreter's launches are left alone."""
    from solattn.backends.triton import kernel as tk
    from solattn.triton_runtime import jit
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            seen["grid"] = grid
            return lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs)

    jit.compiled(False, Recorder())[(3, 4)](1, "x", num_warps=4, FLAG=True)
    assert seen == {"grid": (3, 4), "args": (1, "x"),
                    "kwargs": {"num_warps": 4, "FLAG": True, "enable_fp_fusion": True}}
    assert isinstance(jit.compiled(True, tk.sol_attn_fwd), jit.Interpreted)
