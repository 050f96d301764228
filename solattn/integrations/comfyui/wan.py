"""Wan (``comfy/ldm/wan``) with vsa: FastWan's gated video sparse attention.

ComfyUI's Wan loader has no place for FastWan's gate projections and sets their keys aside, so
the gates travel beside the model: read (gate keys only) from the file the model was loaded from
(a FastWan checkpoint converted by ``python -m solattn.integrations.fastwan to-comfyui`` keeps
them), or from a file the node names (:func:`resolve_gates`). Each block's self-attention
``forward`` gets an object patch (ComfyUI restores it when the model is unpatched) that computes
the block's gate from the self-attention input, ``to_gate_compress(x)``, and runs the block's
own attention code with a per-call attention override: :func:`solattn.video_sparse_attn` on the
roped q, k, v with the patched latent grid ComfyUI records (``transformer_options["grid_sizes"]``).
Cross-attention, and every call kept dense, run the attention that was there before.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, Optional

import torch

from ...validation import validate
from ...op import video_sparse_attn
from .. import fastwan
from .attention import OVERRIDE_KEY, comfy_layout, dense_attention
from .settings import DISPLAY_NAME, fail
from .state import SparseAttention

#: the object patch of block i's self-attention forward
FORWARD_KEY = "diffusion_model.blocks.{}.self_attn.forward"
#: the node's gate choices besides a file: the file the model was loaded from, or no gates
FROM_MODEL_FILE = "from_model_file"
NO_GATES = "none"


def wan_classes():
    try:
        from comfy.ldm.wan.model import WanModel, WanSelfAttention
    except ImportError:
        return None, None
    return WanModel, WanSelfAttention


def is_wan(diffusion_model) -> bool:
    """A ComfyUI Wan model whose blocks have Wan self-attention (Wan2.1, Wan2.2, VACE ...)."""
    model_cls, attn_cls = wan_classes()
    if model_cls is None or not isinstance(diffusion_model, model_cls):
        return False
    blocks = getattr(diffusion_model, "blocks", None)
    return bool(blocks) and all(isinstance(getattr(b, "self_attn", None), attn_cls) for b in blocks)


class WanGates:
    """The checked gate tensors of a Wan model (block -> weight, bias) and where they came from;
    :meth:`project` applies block i's gate to the self-attention input on its device and dtype
    (copies kept for the sampling run, until :meth:`release`)."""

    def __init__(self, tensors: Dict[int, Dict[str, torch.Tensor]], source: str):
        self.tensors = tensors
        self.source = source
        self._cast = {}

    def project(self, index: int, x: torch.Tensor) -> torch.Tensor:
        key = (index, x.device, x.dtype)
        cast = self._cast.get(key)
        if cast is None:
            entry = self.tensors[index]
            cast = tuple(None if entry.get(p) is None else entry[p].to(device=x.device, dtype=x.dtype)
                         for p in ("weight", "bias"))
            self._cast[key] = cast
        return torch.nn.functional.linear(x, *cast)

    def release(self):
        """Drop the device copies :meth:`project` made (ComfyUI's model management does not see
        them): called when a sampling run ends, so the gates do not hold device memory between
        runs; the next run copies them again."""
        self._cast.clear()


#: ComfyUI's loaders that record the file they loaded as the first argument of
#: ``ModelPatcher.cached_patcher_init``: "Load Diffusion Model" and "Load Checkpoint"
RECORDING_LOADERS = ("load_diffusion_model", "load_checkpoint_guess_config")


def model_file(model) -> Optional[str]:
    """The file ComfyUI's "Load Diffusion Model" (or "Load Checkpoint") loaded ``model`` from, when
    it recorded it (``cached_patcher_init``); None for other loaders and ComfyUI releases without it."""
    init = getattr(model, "cached_patcher_init", None)
    if not init or getattr(init[0], "__name__", "") not in RECORDING_LOADERS or len(init) < 2 or not init[1]:
        return None
    path = init[1][0]
    return str(path) if isinstance(path, (str, os.PathLike)) and os.path.isfile(path) else None


def no_gates_reason(model, vsa_gates) -> str:
    """Why :func:`resolve_gates` found no gates for ``vsa_gates``, in words a user can act on."""
    if vsa_gates is None or vsa_gates == NO_GATES:
        return f"vsa_gates is '{NO_GATES}'"
    if vsa_gates != FROM_MODEL_FILE:
        return f"vsa_gates {vsa_gates!r} gave none"
    path = model_file(model)
    if path is None:
        return (f"vsa_gates is '{FROM_MODEL_FILE}' but the loader did not record which file it loaded (ComfyUI's "
                f"'Load Diffusion Model' does; other loaders and older ComfyUI releases do not): to run a FastWan "
                f"model with its gates, choose its converted file in vsa_gates")
    return (f"{os.path.basename(path)} has no to_gate_compress keys (a base Wan checkpoint; a FastWan transformer "
            f"keeps them when converted with 'python -m solattn.integrations.fastwan to-comfyui')")


def _named_file(name) -> str:
    if os.path.isfile(str(name)):
        return str(name)
    try:
        import folder_paths
        found = folder_paths.get_full_path("diffusion_models", str(name))
    except ImportError:
        found = None
    if not found:
        fail("vsa_gates", name, f"'{FROM_MODEL_FILE}', '{NO_GATES}', a file in ComfyUI's models/diffusion_models, "
                                f"or a path to a safetensors file holding the FastWan gates")
    return found


def resolve_gates(model, diffusion_model, vsa_gates) -> Optional[WanGates]:
    """The FastWan gates of a ComfyUI Wan ``model`` as the node's ``vsa_gates`` asks, checked
    against the model (a misshapen gate is refused naming its key), or None (no gates)."""
    if vsa_gates is None or vsa_gates == NO_GATES:
        return None
    blocks = diffusion_model.blocks
    dim, heads = int(diffusion_model.dim), int(diffusion_model.num_heads)
    if isinstance(vsa_gates, dict):
        tensors = fastwan.checked_gates(vsa_gates, len(blocks), dim, heads, DISPLAY_NAME)
        return WanGates(tensors, "a state dict")
    if vsa_gates == FROM_MODEL_FILE:
        path = model_file(model)
        if path is None:
            return None
        tensors = fastwan.checked_gates(path, len(blocks), dim, heads, DISPLAY_NAME, required=False)
        return None if tensors is None else WanGates(tensors, os.path.basename(path))
    if not isinstance(vsa_gates, (str, os.PathLike)):
        fail("vsa_gates", vsa_gates, f"'{FROM_MODEL_FILE}', '{NO_GATES}', a file name or path, or a state dict",
             TypeError)
    path = _named_file(vsa_gates)
    tensors = fastwan.checked_gates(path, len(blocks), dim, heads, DISPLAY_NAME)
    return WanGates(tensors, os.path.basename(path))


def wan_grid(transformer_options, tokens: int):
    """The patched latent grid ``(t, h, w)`` of this call, or a reason string."""
    grid = transformer_options.get("grid_sizes")
    if grid is None or len(grid) != 3:
        return "no grid_sizes in transformer_options"
    grid = tuple(int(n) for n in grid)
    if math.prod(grid) != tokens:
        return (f"{tokens} tokens, the latent grid {grid} has {math.prod(grid)} (reference or context latents "
                f"the grid does not describe)")
    return grid


def make_wan_override(state: SparseAttention, previous, grid, gate, block_index) -> Callable:
    """The attention override of one self-attention call: VSA on its q, k, v."""
    s = state.settings

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def dense():
            return dense_attention(previous, func, q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                   skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None or q.shape != k.shape or q.shape != v.shape:
            state.note(("vsa_call", block_index), f"dense: block {block_index} attention call is not the "
                                                  f"self-attention VSA expects (mask={mask is not None}, "
                                                  f"q {tuple(q.shape)}, k {tuple(k.shape)})")
            return dense()
        if skip_reshape:                                               # (B, H, S, D)
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:                                                          # (B, S, H * D)
            qs, ks, vs = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
        g = None if gate is None else gate.view(qs.shape)
        scale = kwargs.get("scale")
        out = state.run_or_note(qs, lambda: validate(qs, ks, vs, scale=scale),
                                lambda: video_sparse_attn(qs, ks, vs, grid, sparsity=s.sparsity, gate=g, scale=scale))
        if out is None:
            return dense()
        cubes = math.prod(-(-n // 4) for n in grid)
        state.note(("vsa", grid, qs.device.type),
                   f"vsa on {qs.device.type}: Wan grid {grid} ({cubes} cubes, top-k "
                   f"{max(1, min(math.ceil((1 - s.sparsity) * cubes), cubes))}), keep {s.keep_percent:g}%, "
                   + ("gated coarse branch" if g is not None else "no to_gate_compress: fine only"))
        return comfy_layout(out, skip_output_reshape)

    return override


def make_attention_forward(state: SparseAttention, gates: Optional[WanGates], block_index: int,
                           previous: Callable) -> Callable:
    """Block ``block_index``'s self-attention ``forward(x, freqs, transformer_options)``: ``previous``
    (the module's own forward, or another patch's) with the VSA override for this call when the
    call is inside the node's settings."""

    def forward(x, freqs, transformer_options={}):
        reason = state.dense_reason(transformer_options, x.shape[1], block_index)
        grid = None
        if reason is None:
            grid = wan_grid(transformer_options, x.shape[1])
            if isinstance(grid, str):
                reason = ("layout", grid), f"dense: {grid}"
        if reason is not None:
            state.note(*reason)
            return previous(x, freqs, transformer_options=transformer_options)
        gate = None if gates is None else gates.project(block_index, x)
        override = make_wan_override(state, transformer_options.get(OVERRIDE_KEY), grid, gate, block_index)
        return previous(x, freqs, transformer_options={**transformer_options, OVERRIDE_KEY: override})

    forward.solattn_state = state
    return forward


def _own_forward(module) -> Callable:
    def forward(x, freqs, transformer_options={}):
        return type(module).forward(module, x, freqs, transformer_options=transformer_options)
    return forward


def _patch(state: SparseAttention, gates: Optional[WanGates], index: int, previous: Callable, module) -> Callable:
    """Block ``index``'s patch; ``module``: the self-attention whose own forward ``previous`` runs
    (None when ``previous`` is another node's patch)."""
    patch = make_attention_forward(state, gates, index, previous)
    patch.solattn_previous = previous
    patch.solattn_gates = gates
    patch.solattn_module = module
    return patch


def install_attention_patches(state: SparseAttention, model, gates: Optional[WanGates], num_blocks: int):
    """Object-patch every block's self-attention forward of the ModelPatcher ``model`` (a clone)."""
    blocks = model.get_model_object("diffusion_model").blocks
    for i in range(num_blocks):
        key = FORWARD_KEY.format(i)
        # another node's patch of this clone, else the module's own forward (looked up per call: the
        # shared module may carry a patch of another clone right now)
        existing = model.object_patches.get(key)
        if getattr(existing, "solattn_state", None) is not None:     # this node applied twice: the original
            previous, module = existing.solattn_previous, existing.solattn_module
        elif existing is not None:
            previous, module = existing, None
        else:
            module = blocks[i].self_attn
            previous = _own_forward(module)
        model.add_object_patch(key, _patch(state, gates, i, previous, module))


def rebind_attention_patches(model):
    """ComfyUI's ``ON_CLONE`` callback: a clone that holds another model object than the one the
    patches were made for (a deep copy: a multi-GPU clone, a non-dynamic delegate, ``force_deepcopy``)
    gets patches that run that model's own self-attention modules, not the first model's."""
    blocks = model.get_model_object("diffusion_model").blocks
    for i, block in enumerate(blocks):
        key = FORWARD_KEY.format(i)
        patch = model.object_patches.get(key)
        module = getattr(patch, "solattn_module", None)
        if module is None or module is block.self_attn:
            continue
        model.object_patches[key] = _patch(patch.solattn_state, patch.solattn_gates, i,
                                           _own_forward(block.self_attn), block.self_attn)
