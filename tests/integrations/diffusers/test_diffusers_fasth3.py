"""FastH3 in diffusers (solattn.integrations.diffusers) on a tiny randomly initialised
MiniMaxH3Transformer3DModel built from diffusers' own class, against an independent float64
computation of the VSA-H3 definition (SPEC.md, "With a conditioning prefix")."""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'solattn[diffusers]')")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.before_denoise import (  # noqa: E402
    MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep)

from solattn.integrations import diffusers as fasth3  # noqa: E402
from solattn.testing import device_types  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, LAYERS = 64, 2, 128, 2
TEXT, LATENT_FRAMES, LATENT_HW, AUDIO_LATENTS = 40, 4, 32, 20
GRID = (LATENT_FRAMES, LATENT_HW // 2, LATENT_HW // 2)       # after the (1, 2, 2) patch: 16 cubes
SEGMENTS = (TEXT, GRID[1] * GRID[2], 2 * AUDIO_LATENTS)      # text | keyframe | audio, then the video


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=HIDDEN, num_layers=LAYERS,
        num_refiner_layers=1, ffn_dim=128, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2),
        text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32).eval()


def tiny_gates(seed=1, naming="transformer_blocks.{}.attn.to_gate_compress.weight"):
    g = torch.Generator().manual_seed(seed)
    return {naming.format(i): torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.125 for i in range(LAYERS)}


def tiny_inputs(video_timestep=0.5, seed=2):
    """One fl2va request (a first-frame keyframe), laid out by diffusers' own layout step."""
    tags = torch.ones(TEXT, dtype=torch.long)
    pos, tags, video, audio, text, cond_video, cond_audio = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, LATENT_FRAMES, LATENT_HW, LATENT_HW, AUDIO_LATENTS, (1, 2, 2), 2, 2, 0, ("first",))
    timestep, rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, cond_video, cond_audio, TEXT, video_timestep, video_timestep, 0.999, 1.0)
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, video.numel(), 16, generator=g),
                audio_hidden_states=torch.randn(1, audio.numel(), 8, generator=g),
                encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g), timestep=timestep,
                timestep_indices=rows, token_tags=tags, position_ids=pos, video_indices=video,
                audio_indices=audio, text_indices=text, return_dict=False)


def vsa_h3_float64(q, k, v, gate, grid, segments, sparsity, mode="exempt"):
    """SPEC.md's VSA-H3 definition, literally, in float64 and raw packed order (B, T, H, D)."""
    q, k, v = (x.double() for x in (q, k, v))
    B, T, H, D = q.shape
    scale = D ** -0.5
    tiles, row = [], 0
    for length in segments:                      # each prefix segment in its own 64-row tiles
        tiles += [list(range(row + s, row + min(s + 64, length))) for s in range(0, length, 64)]
        row += length
    n_prefix = len(tiles)
    t, h, w = grid
    for a0 in range(0, t, 4):                    # 4x4x4 cubes in t, h, w order, raster inside
        for b0 in range(0, h, 4):
            for c0 in range(0, w, 4):
                tiles.append([row + (a * h + b) * w + c for a in range(a0, min(a0 + 4, t))
                              for b in range(b0, min(b0 + 4, h)) for c in range(c0, min(c0 + 4, w))])
    assert row + t * h * w == T
    n = len(tiles)
    n_video = n - n_prefix
    k_vid = max(1, min(math.ceil((1 - sparsity) * n_video), n_video))
    idx = [torch.tensor(tile) for tile in tiles]
    qm, km, vm = (torch.stack([x[:, i].mean(1) for i in idx], 1) for x in (q, k, v))   # (B, n, H, D)
    S = torch.einsum("bihd,bjhd->bhij", qm, km) * scale
    out = torch.zeros_like(q)
    for b in range(B):
        for hh in range(H):
            for i in range(n):
                if k_vid == n_video or i < n_prefix:
                    keep = list(range(n))
                elif mode == "exempt":
                    keep = list(range(n_prefix)) + (n_prefix + S[b, hh, i, n_prefix:].topk(k_vid).indices).tolist()
                else:
                    keep = S[b, hh, i].topk(min(k_vid + n_prefix, n)).indices.tolist()
                keys = torch.cat([idx[j] for j in sorted(keep)])
                p = torch.softmax(q[b, idx[i], hh] @ k[b, keys, hh].T * scale, -1)
                out[b, idx[i], hh] = p @ v[b, keys, hh]
    if gate is not None:
        coarse = torch.einsum("bhij,bjhd->bihd", torch.softmax(S, -1), vm)
        for i in range(n):
            out[:, idx[i]] += gate[:, idx[i]].double() * coarse[:, i].unsqueeze(1)
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


class Float64Processor:
    """The reference model's attention: the block's own projections, the VSA-H3 definition in float64."""

    def __init__(self, gate_weight, sparsity, mode):
        self.gate_weight, self.sparsity, self.mode = gate_weight, sparsity, mode

    def __call__(self, attn, x, rotary_emb=None, attention_mask=None):
        q, k, v = (p(x).unflatten(-1, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = _apply_rotary_emb(attn.norm_q(q), *rotary_emb), _apply_rotary_emb(attn.norm_k(k), *rotary_emb)
        gate = (x @ self.gate_weight.T).unflatten(-1, (attn.heads, -1))
        out = vsa_h3_float64(q, k, v, gate, GRID, SEGMENTS, self.sparsity, self.mode).to(x.dtype)
        return attn.to_out[0](out.flatten(2))


@pytest.fixture(scope="module")
def dense_output():
    with torch.no_grad():
        return tiny_model()(**tiny_inputs())[0]


def test_layout_read_from_forward_arguments():
    kw = tiny_inputs()
    assert fasth3.packed_layout(kw["position_ids"], kw["video_indices"], kw["audio_indices"],
                                kw["text_indices"]) == (GRID, SEGMENTS)
    # a shuffled video grid is no raster grid: refused (dense), not guessed
    pos = kw["position_ids"].clone()
    pos[-5:] = pos[-5:].flip(0)
    reason = fasth3.packed_layout(pos, kw["video_indices"], kw["audio_indices"], kw["text_indices"])
    assert isinstance(reason, str) and "raster grid" in reason


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exempt", "compete"])
def test_block_attention_equals_float64_definition(mode):
    model = tiny_model()
    gates = tiny_gates()
    fasth3.enable_fasth3(model, gates, sparsity=0.9, prefix_mode=mode)
    attn = model.transformer_blocks[1].attn
    seen = {}
    attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], rope=args[1], out=out))
    with torch.no_grad():
        model(**tiny_inputs())
        x, rope = seen["x"], seen["rope"]
        q, k, v = (p(x).unflatten(-1, (HEADS, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = _apply_rotary_emb(attn.norm_q(q), *rope), _apply_rotary_emb(attn.norm_k(k), *rope)
        gate = (x @ gates["transformer_blocks.1.attn.to_gate_compress.weight"].T).unflatten(-1, (HEADS, -1))
        ref = vsa_h3_float64(q, k, v, gate, GRID, SEGMENTS, 0.9, mode)
        dense = vsa_h3_float64(q, k, v, gate, GRID, SEGMENTS, 0.0, mode)
        out_weight = attn.to_out[0].weight.double()
        expected, dense_expected = (r.flatten(2) @ out_weight.T for r in (ref, dense))
    assert rel(seen["out"], expected) < 2e-5
    # the selection is real: 2 of 16 cubes kept per video query tile changes the block's output
    assert rel(dense_expected, expected) > 2e-2


@pytest.mark.slow
def test_transformer_equals_float64_reference_model(dense_output):
    model, gates = tiny_model(), tiny_gates()
    reference = copy.deepcopy(model)
    for i, block in enumerate(reference.transformer_blocks):
        block.attn.set_processor(Float64Processor(gates[f"transformer_blocks.{i}.attn.to_gate_compress.weight"],
                                                  0.9, "exempt"))
    fasth3.enable_fasth3(model, gates)
    with torch.no_grad():
        out, expected = model(**tiny_inputs())[0], reference(**tiny_inputs())[0]
    assert rel(out, expected) < 1e-4
    assert rel(out, dense_output) > 1e-3          # and it is not the dense model


@pytest.mark.slow
def test_outside_the_window_dense_bit_for_bit_and_disable_restores(caplog):
    model, untouched = tiny_model(), tiny_model()
    fasth3.enable_fasth3(model, tiny_gates(), start_percent=0.5)      # sparse while sigma <= 0.923
    early, late = tiny_inputs(video_timestep=0.0), tiny_inputs(video_timestep=0.5)   # sigma 1.0, 0.5
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="solattn.diffusers"):
        assert torch.equal(model(**early)[0], untouched(**early)[0])
        assert torch.equal(model(**early)[0], untouched(**early)[0])
    said = [r.getMessage() for r in caplog.records if "outside the sparse window" in r.getMessage()]
    assert said == ["FastH3: dense: sigma 1 (timestep 0) is outside the sparse window [0, 0.9231]"]
    with torch.no_grad():
        assert not torch.equal(model(**late)[0], untouched(**late)[0])
        fasth3.disable(model)
        assert not hasattr(model.transformer_blocks[0].attn, "to_gate_compress")
        assert not model._forward_pre_hooks
        assert type(model.transformer_blocks[0].attn.processor).__name__ == "MiniMaxH3AttnProcessor"
        assert torch.equal(model(**late)[0], untouched(**late)[0])


@pytest.mark.slow
def test_dense_blocks_and_attention_backend_reach_the_dense_processor():
    model = tiny_model()
    fasth3.enable_fasth3(model, tiny_gates(), dense_blocks=[0])
    model.set_attention_backend("_native_math")
    assert all(b.attn.processor.dense._attention_backend == "_native_math" for b in model.transformer_blocks)
    calls = []
    dense = model.transformer_blocks[0].attn.processor.dense
    model.transformer_blocks[0].attn.processor.dense = lambda *a: calls.append(1) or dense(*a)
    with torch.no_grad():
        model(**tiny_inputs())
    assert calls == [1]


def test_gate_keys_missing_are_named_and_nothing_changes():
    model = tiny_model()
    processors = [b.attn.processor for b in model.transformer_blocks]
    partial = {"transformer_blocks.0.attn.to_gate_compress.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
               "transformer_blocks.0.attn.to_q.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"missing keys: transformer_blocks\.1\.attn\.to_gate_compress\.weight"):
        fasth3.enable_fasth3(model, partial)
    with pytest.raises(ValueError, match="no key matched among the 1 keys given.*base MiniMax-H3 has no gates"):
        fasth3.enable_fasth3(model, {"proj_in.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        fasth3.enable_fasth3(model, {**tiny_gates(), "transformer_blocks.1.attn.to_gate_compress.weight":
                                     torch.zeros(3, 3)})
    for kwargs, arg in (({"sparsity": 1.5}, "sparsity"), ({"prefix_mode": "all"}, "prefix_mode"),
                        ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent"),
                        ({"dense_blocks": [7]}, "dense_blocks")):
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            fasth3.enable_fasth3(model, tiny_gates(), **kwargs)
    assert [b.attn.processor for b in model.transformer_blocks] == processors
    assert not hasattr(model.transformer_blocks[0].attn, "to_gate_compress") and not model._forward_pre_hooks


@pytest.mark.slow
def test_a_compiled_wrapper_reaches_its_module_and_enabling_twice_is_refused():
    model = tiny_model()
    compiled = torch.compile(model)                       # not run: only the wrapper matters here
    fasth3.enable_fasth3(compiled, tiny_gates())
    assert isinstance(model._solattn_fasth3, fasth3.FastH3) and model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="already enabled"):
        fasth3.enable_fasth3(model, tiny_gates())
    fasth3.disable(compiled, keep_gates=True)
    assert not model._forward_pre_hooks and model.transformer_blocks[0].attn.to_gate_compress is not None
    with pytest.raises(ValueError, match="argument 'transformer'"):
        fasth3.disable(model)


def test_gates_from_safetensors_in_comfyui_naming(tmp_path):
    from safetensors.torch import save_file
    gates = tiny_gates(naming="model.diffusion_model.blocks.{}.attn.to_gate_compress.weight")
    save_file({**gates, "model.diffusion_model.blocks.0.attn.qkv_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "fasth3.safetensors"))
    model = tiny_model()
    fasth3.enable_fasth3(model, tmp_path)                     # a folder of safetensors files
    for i, block in enumerate(model.transformer_blocks):
        assert torch.equal(block.attn.to_gate_compress.weight,
                           gates[f"model.diffusion_model.blocks.{i}.attn.to_gate_compress.weight"])
    assert "transformer_blocks.1.attn.to_gate_compress.weight" in model.state_dict()


@pytest.mark.parametrize("order", ["enable_then_offload", "offload_then_enable"])
def test_sequential_cpu_offload_moves_the_gates_with_their_module(order):
    """accelerate's cpu_offload (what diffusers' enable_sequential_cpu_offload calls): weights live
    off the module (meta) and are loaded per call; the gates must be too, in either order."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (diffusers' offload needs it)")
    reference = tiny_model()
    fasth3.enable_fasth3(reference, tiny_gates())
    model = tiny_model()
    if order == "enable_then_offload":
        fasth3.enable_fasth3(model, tiny_gates())
        accelerate.cpu_offload(model, execution_device="cpu", offload_buffers=True)
    else:
        accelerate.cpu_offload(model, execution_device="cpu", offload_buffers=True)
        fasth3.enable_fasth3(model, tiny_gates())
    assert model.transformer_blocks[1].attn.to_gate_compress.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(**tiny_inputs())[0], reference(**tiny_inputs())[0])


@pytest.mark.parametrize("order", ["enable_then_offload", "offload_then_enable"])
def test_pipeline_model_cpu_offload_composes(order):
    """diffusers' own enable_model_cpu_offload (accelerate's whole-model hook) on a pipeline holding
    the transformer: the gates are ordinary submodules, moved with it."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (diffusers' offload needs it)")
    from diffusers import DiffusionPipeline

    class TinyPipeline(DiffusionPipeline):
        model_cpu_offload_seq = "transformer"

        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    reference = tiny_model()
    fasth3.enable_fasth3(reference, tiny_gates())
    pipe = TinyPipeline(tiny_model())
    if order == "enable_then_offload":
        fasth3.enable_fasth3(pipe.transformer, tiny_gates())
        pipe.enable_model_cpu_offload(device="cpu")
    else:
        pipe.enable_model_cpu_offload(device="cpu")
        fasth3.enable_fasth3(pipe.transformer, tiny_gates())
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**tiny_inputs())[0], reference(**tiny_inputs())[0])
    pipe.maybe_free_model_hooks()                    # re-installs the hooks, as after a pipeline call
    assert isinstance(pipe.transformer._solattn_fasth3, fasth3.FastH3)
    assert pipe.transformer.transformer_blocks[0].attn.to_gate_compress.weight.device.type == "cpu"


@pytest.mark.slow
def test_torch_compile_of_the_transformer():
    """torch.compile of a FastH3 transformer: the pre-hook runs eagerly (a graph break), the
    processors' choice is guarded, so the window switches between sparse and dense graphs."""
    model, untouched = tiny_model(), tiny_model()
    fasth3.enable_fasth3(model, tiny_gates(), start_percent=0.5)
    early, late = tiny_inputs(video_timestep=0.0), tiny_inputs(video_timestep=0.5)
    with torch.no_grad():
        eager_late = model(**late)[0]
        dense_early, dense_late = untouched(**early)[0], untouched(**late)[0]
        compiled = torch.compile(model)
        assert rel(compiled(**late)[0], eager_late) < 1e-5
        assert rel(compiled(**early)[0], dense_early) < 1e-5      # outside the window: dense
        assert rel(compiled(**late)[0], eager_late) < 1e-5
    assert rel(eager_late, dense_late) > 1e-3                     # inside it: sparse


@pytest.mark.slow
def test_tiny_example_runs():
    root = Path(__file__).resolve().parents[3]
    res = subprocess.run([sys.executable, str(root / "examples" / "diffusers_fasth3_tiny.py"), "--device", "cpu"],
                         capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr
    assert "after disable, equal to the dense model: True" in res.stdout
    difference = float(res.stdout.split("relative difference to the dense model: ")[1].split()[0])
    assert 1e-3 < difference < 1.0


ACCELERATORS = [d for d in device_types() if d != "cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not ACCELERATORS, reason="no cuda, xpu or mps device here")
@pytest.mark.parametrize("device", ACCELERATORS)
def test_on_an_accelerator_equals_the_cpu(device):
    """The same FastH3 model on an accelerator (whatever solattn's dispatch picks there) and on the
    CPU, in fp32: one code path for every device."""
    cpu = tiny_model()
    fasth3.enable_fasth3(cpu, tiny_gates())
    model = tiny_model().to(device)
    fasth3.enable_fasth3(model, tiny_gates())
    assert model.transformer_blocks[0].attn.to_gate_compress.weight.device.type == device
    with torch.no_grad():
        inputs = {k: v.to(device, torch.float32 if v.dtype == torch.float64 else v.dtype)   # mps has no fp64
                  if isinstance(v, torch.Tensor) else v for k, v in tiny_inputs().items()}
        got = model(**inputs)[0]
        want = cpu(**tiny_inputs())[0]
    assert rel(got.cpu(), want) < 1e-3          # TF32 / kernel accumulation order, selection identical
