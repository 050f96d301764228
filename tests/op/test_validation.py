"""Every bad argument is rejected before any work, with a message naming it, the value and what is allowed."""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn.backends import reference as refmod
from solattn.validation import validate


def qkv(B=1, T=100, H=2, D=8, dtype=torch.float32):
    return tuple(torch.randn(B, T, H, D, dtype=dtype) for _ in range(3))


Q, K, V = qkv()
N = 2  # ceil(100 / 64)

BAD = [
    # (kwargs overriding the call, exception type, argument named in the message)
    (dict(q=torch.randn(100, 2, 8)), ValueError, "'q'"),
    (dict(q=[1.0]), TypeError, "'q'"),
    (dict(k=torch.randn(1, 99, 2, 8)), ValueError, "'k'"),
    (dict(v=torch.randn(1, 100, 2, 8, dtype=torch.float64)), TypeError, "'v'"),
    (dict(q=Q.half(), k=K.half(), v=V.float()), ValueError, "'v'"),
    (dict(q=Q.to(torch.int32), k=K.to(torch.int32), v=V.to(torch.int32)), TypeError, "'q'"),
    (dict(q=torch.randn(1, 0, 2, 8), k=torch.randn(1, 0, 2, 8), v=torch.randn(1, 0, 2, 8)), ValueError, "T = 0"),
    (dict(scale=math.nan), ValueError, "'scale'"),
    (dict(scale=math.inf), ValueError, "'scale'"),
    (dict(scale="0.1"), TypeError, "'scale'"),
    (dict(scale=1e39), ValueError, "'scale'"),          # finite in float64, inf in fp32
    (dict(scale=-4e38), ValueError, "'scale'"),
    (dict(q=Q.to("meta")), ValueError, "'q'"),          # q's device is the odd one out, not k's
    (dict(tau=math.inf), ValueError, "'tau'"),
    (dict(tau=None), TypeError, "'tau'"),
    (dict(sink_blocks=(2, 1)), ValueError, "'sink_blocks'"),
    (dict(sink_blocks=(-1, 1)), ValueError, "'sink_blocks'"),
    (dict(sink_blocks=(1,)), TypeError, "'sink_blocks'"),
    (dict(sink_blocks=(0.5, 1)), TypeError, "'sink_blocks'"),
    (dict(sink_q=(3, 2)), ValueError, "'sink_q'"),
    (dict(sink_q=5), TypeError, "'sink_q'"),
    (dict(topk_ratio=1.0), ValueError, "'topk_ratio'"),
    (dict(topk_ratio=-0.1), ValueError, "'topk_ratio'"),
    (dict(topk_ratio=math.nan), ValueError, "'topk_ratio'"),
    (dict(topk_ratio="0.1"), TypeError, "'topk_ratio'"),
    (dict(block_len=torch.ones(N, dtype=torch.int64)), TypeError, "'block_len'"),
    (dict(block_len=torch.ones(N + 1, dtype=torch.int32)), ValueError, "'block_len'"),
    (dict(block_len=torch.ones(1, N, dtype=torch.int32)), ValueError, "'block_len'"),
    (dict(block_len=torch.ones(N, dtype=torch.int32, device="meta")), ValueError, "'block_len'"),
    (dict(block_len=[64, 64]), TypeError, "'block_len'"),
    (dict(coarse_gate=torch.randn(1, 100, 2, 4)), ValueError, "'coarse_gate'"),
    (dict(coarse_gate=torch.randn(1, 100, 2, 8, device="meta")), ValueError, "'coarse_gate'"),
    (dict(coarse_gate=torch.randn(1, 100, 2, 8, dtype=torch.float64)), TypeError, "'coarse_gate'"),
    (dict(key_bias=torch.zeros(99)), ValueError, "'key_bias'"),
    (dict(key_bias=torch.zeros(1, 2, 1, 100)), ValueError, "'key_bias'"),        # varies over heads
    (dict(key_bias=torch.zeros(1, 1, 100, 100)), ValueError, "'key_bias'"),      # varies over queries
    (dict(key_bias=torch.zeros(3, 100)), ValueError, "'key_bias'"),
    (dict(key_bias=torch.zeros(100, dtype=torch.int64)), TypeError, "'key_bias'"),
    (dict(key_bias=torch.zeros(100, device="meta")), ValueError, "'key_bias'"),
    (dict(token_aug=32), ValueError, "'token_aug'"),
    (dict(token_aug=512), ValueError, "'token_aug'"),
    (dict(token_aug=64.0), TypeError, "'token_aug'"),
]


@pytest.mark.parametrize("kw,exc,name", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_rejected_before_work(kw, exc, name, monkeypatch):
    calls = []
    monkeypatch.setattr(refmod, "reference_forward", lambda p: calls.append(p))
    args = dict(q=Q, k=K, v=V)
    args.update(kw)
    with pytest.raises(exc) as ei:
        solattn.sol_attn(args.pop("q"), args.pop("k"), args.pop("v"), backend="reference", **args)
    msg = str(ei.value)
    assert name in msg, msg
    assert "allowed" in msg or "T = 0" in msg, msg
    assert not calls, "work was done on a rejected call"


def test_messages_show_the_received_value():
    with pytest.raises(ValueError, match=r"received 1\.5"):
        solattn.sol_attn(Q, K, V, topk_ratio=1.5)
    with pytest.raises(ValueError, match=r"shape \(1, 99, 2, 8\)"):
        solattn.sol_attn(Q, torch.randn(1, 99, 2, 8), V)
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        solattn.sol_attn(Q, K, V, sink_blocks=(2, 1))


def test_gate_dtype_message_names_the_dtypes_allowed():
    """A float64 gate is a float tensor: the message must say which float dtypes are allowed."""
    with pytest.raises(TypeError, match=r"'coarse_gate' received .*dtype torch\.float64.*allowed: .*"
                                        r"torch\.bfloat16, torch\.float16 or torch\.float32"):
        solattn.sol_attn(Q, K, V, coarse_gate=torch.randn(1, 100, 2, 8, dtype=torch.float64))


def test_floats_beyond_fp32_are_refused_and_its_largest_is_accepted():
    with pytest.raises(ValueError, match=r"'scale' received 1e\+39; allowed: a finite float .*3\.4028"):
        solattn.sol_attn(Q, K, V, scale=1e39)
    assert torch.isfinite(solattn.sol_attn(Q, K, V, scale=1e-30, backend="reference")).all()
    assert validate(Q, K, V, scale=torch.finfo(torch.float32).max).scale == torch.finfo(torch.float32).max


def test_a_meta_q_is_blamed_on_q():
    with pytest.raises(ValueError, match=r"sol_attn: argument 'q' received a tensor .*device meta.*allowed: .*cpu"):
        solattn.sol_attn(Q.to("meta"), K, V)
    with pytest.raises(ValueError, match=r"argument 'k' received .*device meta"):
        solattn.sol_attn(Q, K.to("meta"), V)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="'backend'.*allowed.*reference"):
        solattn.sol_attn(Q, K, V, backend="cudnn")


def test_valid_edge_values_are_accepted():
    out = solattn.sol_attn(Q, K, V, sink_blocks=(5, 9), sink_q=(0, 0), token_aug=256, scale=-0.2,
                           key_bias=torch.zeros(1, 1, 1, 100), topk_ratio=0.999)
    assert torch.isfinite(out).all()
    p = validate(Q, K, V, sink_blocks=(1, 9))
    assert p.sink_blocks == (1, 2)          # clipped to n
    assert validate(Q, K, V, sink_blocks=(4, 9)).sink_blocks is None


def test_sdpa_layout_warns_once(monkeypatch):
    """(B, H, T, D) passed where (B, T, H, D) is expected: hundreds of 'heads', fewer 'tokens'."""
    import warnings

    from solattn import validation
    monkeypatch.setattr(validation, "_layout_warned", False)
    B, H, T, D = 1, 2, 300, 8                                  # SDPA layout of a 2-head, 300-token call
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    with pytest.warns(UserWarning, match=r"\(B, H, T, D\)") as rec:
        out = solattn.sol_attn(q, k, v, topk_ratio=0.5)
    msg = str(rec[0].message)
    assert "(1, 2, 300, 8)" in msg and "T=2" in msg and "H=300" in msg and "transpose(1, 2)" in msg
    assert rec[0].filename == __file__                         # points at the caller's line
    assert out.shape == q.shape                                # a warning, not an error: it still runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # once per process
        solattn.sol_attn(q, k, v, topk_ratio=0.5)


@pytest.mark.parametrize("shape", [(1, 400, 300, 8),            # H > 256 but T >= H: a long sequence
                                   (1, 2, 256, 8),              # H <= 256
                                   (2, 64, 24, 8)])             # ordinary
def test_plausible_layouts_do_not_warn(shape, monkeypatch):
    import warnings

    from solattn import validation
    monkeypatch.setattr(validation, "_layout_warned", False)
    q = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(q, q, q)


def test_sdpa_layout_warning_under_torch_compile(monkeypatch):
    """fullgraph compilation still works (no warning while tracing); the op warns when it runs."""
    from solattn import validation
    monkeypatch.setattr(validation, "_layout_warned", False)
    q = torch.randn(1, 2, 300, 8)
    attend = torch.compile(lambda q: solattn.sol_attn(q, q, q, topk_ratio=0.5), fullgraph=True)
    with pytest.warns(UserWarning, match="H=300"):
        out = attend(q)
    assert torch.allclose(out, solattn.sol_attn(q, q, q, topk_ratio=0.5, backend="reference"), atol=1e-5)
