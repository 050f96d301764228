"""FastWan in diffusers (solattn.integrations.diffusers.enable_vsa on WanTransformer3DModel): a tiny
random FastWan-shaped Wan saved in FastWan's own key layout (tests/support/fastwan_tiny.py), loaded by
diffusers, each block's self-attention against FastVideo's VSA definition computed in float64."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'solattn[diffusers]')")
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel  # noqa: E402

from tests.support.fastwan_tiny import SHAPE, dense_reference, fastwan_state_dict, rel, vsa_reference, write_fastwan  # noqa: E402

from solattn.integrations import diffusers as integration  # noqa: E402
from solattn.integrations import fastwan  # noqa: E402

SPARSITY = 0.75          # 12 cubes -> top-k 3
DIM = SHAPE["heads"] * SHAPE["head_dim"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_fastwan(str(tmp_path_factory.mktemp("fastwan") / "transformer"))


def load(folder):
    model, info = WanTransformer3DModel.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == [], info                       # the layout is diffusers' Wan ...
    assert sorted(info["unexpected_keys"]) == sorted(              # ... plus FastWan's gates
        f"blocks.{i}.to_gate_compress.{p}" for i in range(SHAPE["blocks"]) for p in ("weight", "bias"))
    return model.eval()


def inputs(frames, height, width, seed=3, timestep=500.0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, frames, height, width, generator=g),
                timestep=torch.tensor([timestep]),
                encoder_hidden_states=torch.randn(1, 8, SHAPE["text_dim"], generator=g), return_dict=False)


class Capture:
    """Each block's self-attention input, rotary embedding and output."""

    def __init__(self, model):
        self.calls = {}
        self.handles = [blk.attn1.register_forward_hook(self._hook(i), with_kwargs=True)
                        for i, blk in enumerate(model.blocks)]

    def _hook(self, index):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            rotary = args[3] if len(args) > 3 else kwargs.get("rotary_emb")
            self.calls[index] = (module, x.detach().clone(), rotary, output.detach().clone())
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def attn1_reference(attn, x, rotary, gate_weights, grid, sparsity, mode="vsa"):
    """A Wan self-attention module's output in float64 from its weights: projections, RMSNorm across
    heads, Wan's interleaved RoPE, then VSA (``mode`` "vsa"; "zero_gate": the gate zeroed; "dense")."""
    x = x.double()

    def linear(lin, t):
        return t @ lin.weight.double().T + lin.bias.double()

    def rms(norm, t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()

    q, k, v = rms(attn.norm_q, linear(attn.to_q, x)), rms(attn.norm_k, linear(attn.to_k, x)), linear(attn.to_v, x)
    q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
    cos, sin = (f.double()[..., 0::2] for f in rotary)               # one angle per channel pair

    def rope(t):
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    q, k = rope(q), rope(k)
    gate = (x @ gate_weights["weight"].double().T + gate_weights["bias"].double()).unflatten(-1, (attn.heads, -1))
    if mode == "dense":
        out = dense_reference(q, k, v)
    else:
        out = vsa_reference(q, k, v, gate * (mode == "vsa"), grid, sparsity)
    return linear(attn.to_out[0], out.flatten(2))


def gates_of(index):
    sd = fastwan_state_dict(**SHAPE)
    return {p: sd[f"blocks.{index}.to_gate_compress.{p}"] for p in ("weight", "bias")}


def check_blocks(calls, grid, sparsity=SPARSITY):
    errors = {}
    for i, (attn, x, rotary, out) in sorted(calls.items()):
        err = rel(out, attn1_reference(attn, x, rotary, gates_of(i), grid, sparsity))
        zero = rel(out, attn1_reference(attn, x, rotary, gates_of(i), grid, sparsity, "zero_gate"))
        dense = rel(out, attn1_reference(attn, x, rotary, gates_of(i), grid, sparsity, "dense"))
        print(f"block {i} grid {grid}: rel err vs float64 VSA {err:.2e}; vs gate zeroed {zero:.2e}; "
              f"vs dense {dense:.2e}")
        assert err <= 1e-5, (i, err)
        assert zero > 1e-3 and dense > 1e-3, (i, zero, dense)       # the check can fail
        errors[i] = err
    return errors


@pytest.mark.parametrize("latent, grid", [((5, 12, 20), (5, 6, 10)),
                                          pytest.param((4, 8, 16), (4, 4, 8), marks=pytest.mark.slow)],
                         ids=["grid-5x6x10-partial-cubes", "grid-4x4x8"])
def test_block_attention_equals_float64_definition(folder, latent, grid, caplog):
    model = load(folder)
    integration.enable_vsa(model, folder, sparsity=SPARSITY)
    capture = Capture(model)
    with caplog.at_level(logging.INFO, "solattn.diffusers"), torch.no_grad():
        model(**inputs(*latent))
    capture.remove()
    assert len(capture.calls) == SHAPE["blocks"]
    check_blocks(capture.calls, grid)
    assert f"vsa: grid {grid}" in caplog.text


def test_pipeline_step_runs_vsa_with_the_gates(folder, caplog):
    model = load(folder)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=model,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=8.0))
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 8, SHAPE["text_dim"], generator=g)
    call = dict(prompt_embeds=embeds, negative_prompt_embeds=embeds, guidance_scale=1.0, height=96, width=160,
                num_frames=17, num_inference_steps=2, output_type="latent", return_dict=False)
    dense = pipe(**call, generator=torch.Generator().manual_seed(1))[0]
    integration.enable_vsa(pipe.transformer, folder, sparsity=SPARSITY)
    capture = Capture(pipe.transformer)
    with caplog.at_level(logging.INFO, "solattn.diffusers"):
        sparse = pipe(**call, generator=torch.Generator().manual_seed(1))[0]
    capture.remove()
    assert "vsa: grid (5, 6, 10)" in caplog.text
    check_blocks(capture.calls, (5, 6, 10))                           # the last step's attention
    assert torch.isfinite(sparse).all() and rel(sparse, dense) > 1e-4
    integration.disable(pipe.transformer)
    again = pipe(**call, generator=torch.Generator().manual_seed(1))[0]
    assert torch.equal(again, dense)


@pytest.mark.slow
def test_window_dense_fallback_is_logged_and_disable_restores(folder, caplog):
    model = load(folder)
    x = inputs(5, 12, 20, timestep=999.0)
    with torch.no_grad():
        before = model(**x)[0]
    integration.enable_vsa(model, folder, sparsity=SPARSITY, start_percent=0.5, shift=8.0)
    with caplog.at_level(logging.INFO, "solattn.diffusers"), torch.no_grad():
        outside = model(**x)[0]                                       # sigma 0.999 > the window's start
        inside = model(**inputs(5, 12, 20, timestep=100.0))[0]
    assert torch.equal(outside, before)
    assert "dense: sigma 0.999" in caplog.text and "vsa: grid (5, 6, 10)" in caplog.text
    assert torch.isfinite(inside).all()
    integration.disable(model)
    assert not hasattr(model.blocks[0].attn1, "to_gate_compress")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], before)


@pytest.mark.slow
def test_dense_blocks_run_the_previous_processor(folder):
    model = load(folder)
    integration.enable_vsa(model, folder, sparsity=SPARSITY, dense_blocks=[1])
    capture = Capture(model)
    with torch.no_grad():
        model(**inputs(5, 12, 20))
    attn, x, rotary, out = capture.calls[1]
    dense = attn1_reference(attn, x, rotary, gates_of(1), (5, 6, 10), SPARSITY, "dense")
    assert rel(out, dense) < 1e-5
    attn, x, rotary, out = capture.calls[0]
    assert rel(out, attn1_reference(attn, x, rotary, gates_of(0), (5, 6, 10), SPARSITY)) < 1e-5


@pytest.mark.slow
def test_no_gates_runs_the_fine_stage_only(folder, caplog):
    model = load(folder)
    with caplog.at_level(logging.WARNING, "solattn.diffusers"):
        integration.enable_vsa(model, None, sparsity=SPARSITY)
    assert "no gate projections" in caplog.text
    capture = Capture(model)
    with torch.no_grad():
        model(**inputs(5, 12, 20))
    attn, x, rotary, out = capture.calls[0]
    assert rel(out, attn1_reference(attn, x, rotary, gates_of(0), (5, 6, 10), SPARSITY, "zero_gate")) < 1e-5


def _bad(sd, key, value=None):
    sd = dict(sd)
    if value is None:
        del sd[key]
    else:
        sd[key] = value
    return sd


@pytest.mark.parametrize("case", ["missing", "misshapen", "ltx-per-head", "bias-missing"])
def test_bad_gates_are_refused_naming_the_key_and_nothing_changes(folder, case):
    sd = fastwan_state_dict(**SHAPE)
    key = "blocks.1.to_gate_compress.weight"
    bad, words = {
        "missing": (_bad(sd, key), [key, "missing keys"]),
        "misshapen": (_bad(sd, key, torch.randn(DIM, DIM // 2)), [repr(key), f"({DIM}, {DIM // 2})"]),
        "ltx-per-head": (_bad(sd, key, torch.randn(SHAPE["heads"], SHAPE["head_dim"])),
                         [repr(key), "per-head gate", "LTX"]),
        "bias-missing": (_bad(sd, "blocks.0.to_gate_compress.bias"), ["blocks.0.to_gate_compress.bias"]),
    }[case]
    model = load(folder)
    processors = [blk.attn1.processor for blk in model.blocks]
    with pytest.raises(ValueError) as err:
        integration.enable_vsa(model, bad)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert [blk.attn1.processor for blk in model.blocks] == processors
    assert not hasattr(model.blocks[0].attn1, "to_gate_compress") and not hasattr(model, integration.STATE_ATTR)


@pytest.mark.slow
def test_converted_comfyui_file_gates_and_keys(folder, tmp_path):
    out = tmp_path / "fastwan_comfy.safetensors"
    counts = fastwan.convert_to_comfyui(folder, out)
    from safetensors.torch import load_file
    sd = load_file(str(out))
    assert counts == {"tensors": len(sd), "gates": 2 * SHAPE["blocks"]}
    assert {"head.modulation", "head.head.weight", "blocks.0.modulation", "blocks.0.self_attn.q.weight",
            "blocks.0.cross_attn.o.bias", "blocks.0.norm3.weight", "blocks.0.ffn.0.weight", "time_embedding.0.weight",
            "time_projection.1.weight", "text_embedding.2.bias", "blocks.1.self_attn.to_gate_compress.bias"} <= set(sd)
    assert not any("attn1" in k or "scale_shift_table" in k for k in sd)
    # the converted file's gates (ComfyUI naming) serve diffusers too
    model = load(folder)
    integration.enable_vsa(model, str(out), sparsity=SPARSITY)
    assert torch.equal(model.blocks[1].attn1.to_gate_compress.bias, gates_of(1)["bias"])
    with pytest.raises(ValueError, match="already in ComfyUI's Wan naming"):
        fastwan.convert_to_comfyui(str(out), tmp_path / "again.safetensors")


def test_enabling_twice_is_refused_and_the_old_entry_point_stays(folder):
    model = load(folder)
    integration.enable_vsa(model, folder)
    with pytest.raises(RuntimeError, match="already enabled"):
        integration.enable_vsa(model, folder)
    assert integration.enable_fasth3 is not None and callable(integration.enable_fasth3)
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        integration.enable_vsa(torch.nn.Linear(2, 2), None)


def test_group_offloading_enabled_first_is_refused_naming_enable_vsa(folder):
    model = load(folder)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1)
    with pytest.raises(RuntimeError) as err:
        integration.enable_vsa(model, folder)
    assert "enable_vsa: diffusers group offloading is active" in str(err.value), str(err.value)
    assert "call enable_vsa before enable_group_offload" in str(err.value), str(err.value)
    assert "fasth3" not in str(err.value)
