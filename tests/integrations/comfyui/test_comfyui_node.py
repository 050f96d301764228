"""The ComfyUI node "Model Sparse Attention (solattn)" against a stand-in of ComfyUI's interfaces.

tests/support/comfyui_standin/ reproduces what the node touches (attention override hook, MiniMax-H3
block replacement and layout, ModelPatcher). These tests cover what the real-ComfyUI tests
(tests/integrations/comfyui/test_comfyui_host.py) cannot reach with a MiniMax-H3 checkpoint: a model that is not
MiniMax-H3 (cross-attention, masks, block families), inputs solattn refuses, the per-run log
memory, argument checks and the sigma cache. Every sparse output is compared with a direct solattn
computation on the same projections; every fallback with the unpatched model.
"""

import importlib
import logging
import os
import sys

import pytest
import torch

import solattn
from solattn.integrations import comfyui as node

STANDIN = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "support", "comfyui_standin")
LOGGER = "solattn.comfyui"


@pytest.fixture(scope="module")
def comfy():
    """The stand-in ``comfy`` package on sys.path for this module only."""
    assert "comfy" not in sys.modules, "a real or stand-in 'comfy' package is already imported"
    sys.path.insert(0, STANDIN)
    try:
        mods = {name: importlib.import_module(f"comfy.{name}")
                for name in ("model_patcher", "patcher_extension", "ldm.minimax.model", "ldm.generic")}
        yield mods
    finally:
        sys.path.remove(STANDIN)
        for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
            del sys.modules[name]


# ---------------------------------------------------------------------------------------------
# MiniMax-H3 with vsa
TEXT, AUDIO_T, LATENT = 70, 9, (5, 12, 14)     # video grid (5, 6, 7): 8 cubes, two partial axes


def h3_setup(comfy, seed=0, gate=True, layers=2, dtype=torch.float32):
    torch.manual_seed(seed)
    mm = comfy["ldm.minimax.model"]
    model = mm.MiniMaxH3Model(hidden=64, heads=2, head_dim=32, layers=layers, gate_compress=gate).to(dtype)
    with torch.no_grad():
        for block in model.blocks:        # distinct q/k block structure, so cube scores separate
            block.attn.qkv_proj.weight.mul_(3.0)
            if gate:
                block.attn.to_gate_compress.weight.mul_(4.0)
    layout = mm.PackedLayout(TEXT, *LATENT, AUDIO_T)
    h = torch.randn(layout.seq_len, 64, dtype=dtype)
    return comfy["model_patcher"].ModelPatcher(model), layout, h


def node_lines(caplog, text):
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


@pytest.mark.parametrize("case", ["schedule_early", "schedule_late", "min_tokens"])
@torch.no_grad()
def test_h3_vsa_fallbacks_are_dense(comfy, caplog, case):
    patcher, layout, h = h3_setup(comfy)
    kwargs = dict(method="vsa", keep_percent=10.0, start_percent=0.2, end_percent=0.8, min_tokens=0)
    sigma = {"schedule_early": 0.9, "schedule_late": 0.1, "min_tokens": 0.5}[case]
    if case == "min_tokens":
        kwargs["min_tokens"] = layout.seq_len + 1
    patched = node.apply(patcher, **kwargs)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(2):                       # two calls, still one line
        out = patched.apply_model(h, layout, sigma=sigma)
    torch.testing.assert_close(out, patcher.apply_model(h, layout, sigma=sigma), rtol=0, atol=0)
    text = "outside the start/end window" if case != "min_tokens" else "tokens < min_tokens"
    assert len(node_lines(caplog, text)) == 1
    assert not node_lines(caplog, "vsa on")
    patched.cleanup()                        # a new sampling run logs again
    patched.apply_model(h, layout, sigma=sigma)
    assert len(node_lines(caplog, text)) == 2


@torch.no_grad()
def test_h3_vsa_refused_input_is_dense(comfy, caplog):
    """float64 is outside solattn's dtypes: the attention that was there runs, one line says why."""
    patcher, layout, h = h3_setup(comfy, dtype=torch.float64)
    patched = node.apply(patcher, method="vsa", keep_percent=10.0, start_percent=0.0, min_tokens=0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    out = patched.apply_model(h, layout)
    torch.testing.assert_close(out, patcher.apply_model(h, layout), rtol=0, atol=0)
    lines = node_lines(caplog, "solattn refuses")
    assert len(lines) == 1 and "float64" in lines[0].getMessage()


@torch.no_grad()
def test_h3_vsa_keeps_an_earlier_override_for_dense_calls(comfy):
    """A block outside the window runs whatever override another node installed before."""
    patcher, layout, h = h3_setup(comfy)
    calls = []

    def earlier(func, *args, **kwargs):
        calls.append(args[0].shape)
        return func(*args, **kwargs)

    patcher.model_options["transformer_options"]["optimized_attention_override"] = earlier
    patched = node.apply(patcher, method="vsa", keep_percent=10.0, start_percent=0.5, min_tokens=0)
    patched.apply_model(h, layout, sigma=0.9)
    assert len(calls) == 2
    calls.clear()
    patched.apply_model(h, layout, sigma=0.3)
    assert calls == []


def test_vsa_needs_h3(comfy):
    patcher = comfy["model_patcher"].ModelPatcher(comfy["ldm.generic"].TinyDiT())
    with pytest.raises(ValueError, match="'method' received 'vsa'"):
        node.apply(patcher, method="vsa")


# ---------------------------------------------------------------------------------------------
# sol-attn / sla through the attention override
def generic_setup(comfy, tokens=320, seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    model = comfy["ldm.generic"].TinyDiT(dim=128, heads=2, context_dim=48).to(dtype)
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.to_q.weight.mul_(4.0)
            block.attn1.to_k.weight.mul_(4.0)
    x = torch.randn(1, tokens, 128, dtype=dtype) + torch.randn(1, tokens // 64, 1, 128, dtype=dtype).repeat_interleave(64, 1).flatten(1, 2)[:, :tokens]
    context = torch.randn(1, 7, 48, dtype=dtype)
    return comfy["model_patcher"].ModelPatcher(model), x, context


def generic_direct(model, x, context, **sol):
    for block in model.blocks:
        a = block.attn1
        n = block.norm1(x)
        q, k, v = (p(n).unflatten(-1, (2, 64)) for p in (a.to_q, a.to_k, a.to_v))
        x = x + a.to_out(solattn.sol_attn(q, k, v, **sol).flatten(-2))
        x = x + block.attn2(block.norm2(x), context=context)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("method,sol", [("sol-attn", dict(tau=1.3)), ("sla", dict(topk_ratio=0.25))])
@torch.no_grad()
def test_generic_override_equals_direct_sol_attn(comfy, caplog, method, sol):
    patcher, x, context = generic_setup(comfy)
    patched = node.apply(patcher, method=method, tau=1.3, keep_percent=25.0, start_percent=0.0, min_tokens=0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    out = patched.apply_model(x, context)
    torch.testing.assert_close(out, generic_direct(patcher.diffusion_model, x, context, **sol),
                               rtol=1e-6, atol=1e-6)
    dense = patcher.apply_model(x, context)
    assert (out - dense).norm() > 1e-3 * dense.norm()
    assert len(node_lines(caplog, f"{method} on (1, 320, 2, 64)")) == 1
    # the cross-attention calls (q 320 rows, k 7 rows) stayed dense, with one line
    assert len(node_lines(caplog, "dense: cross-attention")) == 1


@torch.no_grad()
def test_generic_masked_call_is_dense(comfy, caplog):
    patcher, x, context = generic_setup(comfy)
    patched = node.apply(patcher, method="sol-attn", start_percent=0.0, min_tokens=0)
    mask = torch.zeros(320, 320)
    mask[:, 300:] = -1e4
    caplog.set_level(logging.INFO, logger=LOGGER)
    out = patched.apply_model(x, context, mask=mask)
    torch.testing.assert_close(out, patcher.apply_model(x, context, mask=mask), rtol=0, atol=0)
    assert len(node_lines(caplog, "dense: masked attention call")) == 1


@pytest.mark.parametrize("case", ["schedule", "min_tokens", "dense_blocks"])
@torch.no_grad()
def test_generic_fallbacks_are_dense(comfy, caplog, case):
    patcher, x, context = generic_setup(comfy)
    kwargs = dict(method="sol-attn", start_percent=0.0, end_percent=1.0, min_tokens=0)
    sigma = 0.5
    if case == "schedule":
        kwargs["start_percent"], sigma = 0.6, 0.9
    elif case == "min_tokens":
        kwargs["min_tokens"] = 321
    else:
        kwargs["dense_blocks"] = "0-1"
    patched = node.apply(patcher, **kwargs)
    caplog.set_level(logging.INFO, logger=LOGGER)
    out = patched.apply_model(x, context, sigma=sigma)
    torch.testing.assert_close(out, patcher.apply_model(x, context, sigma=sigma), rtol=0, atol=0)
    text = {"schedule": "outside the start/end window", "min_tokens": "320 tokens < min_tokens 321",
            "dense_blocks": "is in dense_blocks"}[case]
    # one line per reason; dense_blocks "0-1": one per listed block
    assert [r.getMessage().split(": ", 1)[1] for r in node_lines(caplog, text)] == (
        [f"dense: block {i} is in dense_blocks" for i in (0, 1)] if case == "dense_blocks" else
        [r.getMessage().split(": ", 1)[1] for r in node_lines(caplog, text)][:1])
    assert not node_lines(caplog, "sol-attn on")


@torch.no_grad()
def test_dense_blocks_without_block_index_is_reported(comfy, caplog):
    """A model whose attention calls carry no block_index (MiniMax-H3 in ComfyUI releases before
    the layout / block_index were published) cannot honour dense_blocks: one line says so."""
    attention = importlib.import_module("comfy.ldm.modules.attention")
    state = node.SparseAttention(node.Settings(min_tokens=0, dense_blocks=frozenset({0, 1})))
    override = node.make_override(state, None)
    torch.manual_seed(0)
    q, k, v = (3 * torch.randn(1, 2, 256, 64) for _ in range(3))
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(2):
        out = override(attention.attention_pytorch, q, k, v, 2, skip_reshape=True, skip_output_reshape=True,
                       transformer_options={"sigmas": torch.tensor([0.5])})
    ref = solattn.sol_attn(*(t.transpose(1, 2) for t in (q, k, v)), tau=1.3).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(node_lines(caplog, "dense_blocks has no effect")) == 1
    # with the index, the listed block is dense and nothing is reported about missing indices
    caplog.clear()
    state.reset()
    out = override(attention.attention_pytorch, q, k, v, 2, skip_reshape=True, skip_output_reshape=True,
                   transformer_options={"sigmas": torch.tensor([0.5]), "block_index": 1})
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, dense)
    assert not node_lines(caplog, "dense_blocks has no effect")
    assert len(node_lines(caplog, "dense: block 1 is in dense_blocks")) == 1


# ---------------------------------------------------------------------------------------------
# node surface and argument checks
def test_classic_node_surface():
    """Without ComfyUI's node API v3 the classic node is registered, with the built-in node's value
    names as flat inputs and auto first (the default)."""
    assert node.SolAttnModelSparseAttention is node.ClassicNode      # no comfy_api here
    spec = node.ClassicNode.INPUT_TYPES()
    assert spec["required"]["method"][0] == ["auto", "sol-attn", "sla", "vsa"]
    assert spec["required"]["method"][1]["default"] == "auto"
    assert node.NODE_DISPLAY_NAME_MAPPINGS[node.NODE_ID] == "Model Sparse Attention (solattn)"
    assert set(spec["required"]) | set(spec["optional"]) == {
        "model", "method", "tau", "keep_percent", "start_percent", "end_percent", "dense_blocks",
        "min_tokens", "extra_tokens", "sink_conditioning", "vsa_prefix", "verbose", "vsa_gates"}
    assert spec["optional"]["vsa_gates"][0][:2] == ["from_model_file", "none"]


def test_parse_block_list():
    assert node.parse_block_list("0, 1, 47-49") == {(None, i) for i in (0, 1, 47, 48, 49)}
    assert node.parse_block_list(" 3 5 - 6 ") == {(None, 3), (None, 5), (None, 6)}
    assert node.parse_block_list("double:0-1, Single : 5 7") == {("double", 0), ("double", 1), ("single", 5),
                                                                 (None, 7)}
    assert node.parse_block_list("") == frozenset()
    for bad in ("1, x", "single:", "a:b:1", "1-"):
        with pytest.raises(ValueError, match=f"'dense_blocks' received '{bad}'"):
            node.parse_block_list(bad)


def test_dense_blocks_by_block_type(caplog):
    """Flux-like models number their double and single blocks from 0 each and say which family a
    call is in (transformer_options['block_type']): 'single:1' is dense in single block 1 only, a
    bare index in both families; typed entries on a model without block_type are reported once."""
    state = node.SparseAttention(node.Settings(min_tokens=0, dense_blocks=node.parse_block_list("single:1, 3")))

    def reason(**opts):
        r = state.dense_reason(opts, 1 << 16, opts.pop("block_index"))
        return None if r is None else r[1]

    assert reason(block_index=1, block_type="single") == "dense: block single:1 is in dense_blocks"
    assert reason(block_index=1, block_type="double") is None
    assert reason(block_index=3, block_type="double") == "dense: block double:3 is in dense_blocks"
    assert reason(block_index=3) == "dense: block 3 is in dense_blocks"
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert reason(block_index=1) is None and reason(block_index=2) is None
    assert len(node_lines(caplog, "entries with a block type have no effect")) == 1
    # plain ints still mean "any family"
    assert node.Settings(dense_blocks=frozenset({2})).dense_blocks == {(None, 2)}
    # typed entries given directly compare like parsed ones (lower-case family)
    assert node.Settings(dense_blocks=frozenset({("Single", 1)})).dense_blocks == {("single", 1)}


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="dense"), "'method' received 'dense'"),
    (dict(method="sla", keep_percent=0.0), "'keep_percent' received 0.0"),
    (dict(method="sol-attn", min_tokens=-1), "'min_tokens' received -1"),
    (dict(method="sol-attn", start_percent=1.5), "'start_percent' received 1.5"),
    (dict(method="sol-attn", sink_conditioning="all"), "'sink_conditioning' received 'all'"),
    (dict(method="sol-attn", vsa_prefix="mixed"), "'vsa_prefix' received 'mixed'"),
])
def test_bad_arguments(comfy, kwargs, match):
    patcher = comfy["model_patcher"].ModelPatcher(comfy["ldm.generic"].TinyDiT())
    with pytest.raises(ValueError, match=match):
        node.apply(patcher, **kwargs)


def test_sigma_read_once_per_sigmas_tensor():
    """The schedule's sigma is read from the device once per sigmas tensor (one model step), not
    once per attention call: a GPU tensor's read waits for the device. An in-place change and a
    new tensor are read again; reset() and new_step() forget the cache."""
    state = node.SparseAttention(node.Settings())
    reads = []

    class Counting(torch.Tensor):
        def __float__(self):
            reads.append(1)
            return super().__float__()

    sigmas = torch.tensor([0.7, 0.3]).as_subclass(Counting)
    assert [state.first_sigma(sigmas) for _ in range(5)] == [pytest.approx(0.7)] * 5
    assert len(reads) == 1
    sigmas.mul_(0.5)                                   # in place: the version moves
    assert state.first_sigma(sigmas) == pytest.approx(0.35) and len(reads) == 2
    other = torch.tensor([0.2]).as_subclass(Counting)
    assert state.first_sigma(other) == pytest.approx(0.2) and len(reads) == 3
    state.reset()
    assert state.first_sigma(other) == pytest.approx(0.2) and len(reads) == 4
    assert state.first_sigma([0.9, 0.1]) == pytest.approx(0.9)
    # ComfyUI samples under inference mode, whose tensors have no version counter: read once per
    # tensor there too, and again after new_step (ComfyUI's per-step ON_PREPARE_STATE)
    with torch.inference_mode():
        frozen = torch.tensor([0.6]).as_subclass(Counting)
        assert [state.first_sigma(frozen) for _ in range(3)] == [pytest.approx(0.6)] * 3
        assert len(reads) == 5
        frozen.mul_(0.5)
        state.new_step()
        assert state.first_sigma(frozen) == pytest.approx(0.3) and len(reads) == 6


def test_cross_attention_and_grouped_keys_are_each_reported(comfy, caplog):
    """A cross-attention call and a grouped-key call stay dense for different reasons: both are logged."""
    attention = importlib.import_module("comfy.ldm.modules.attention")
    override = node.make_override(node.SparseAttention(node.Settings(min_tokens=0)), None)
    torch.manual_seed(0)
    q = torch.randn(1, 2, 128, 64)
    kv = torch.randn(1, 2, 77, 64)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with torch.no_grad():
        cross = override(attention.attention_pytorch, q, kv, kv, 2, skip_reshape=True, transformer_options={})
        grouped = override(attention.attention_pytorch, q, q[:, :1], q[:, :1], 2, skip_reshape=True,
                           enable_gqa=True, transformer_options={})
    assert cross.shape == grouped.shape == (1, 128, 128)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2
    assert "dense: cross-attention (q (1, 2, 128, 64), k (1, 2, 77, 64)" in lines[0]
    assert "dense: grouped keys (q (1, 2, 128, 64), k (1, 1, 128, 64): enable_gqa)" in lines[1]
