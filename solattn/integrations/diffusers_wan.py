"""FastWan in diffusers: Wan's self-attention through :func:`solattn.video_sparse_attn`.

``enable_fastwan(transformer, gates)`` (or :func:`solattn.integrations.diffusers.enable_vsa`) turns
a loaded ``diffusers.WanTransformer3DModel`` (Wan2.1, Wan2.2) into FastWan, FastVideo's
VSA-trained Wan, on every device solattn runs on:

- each block's self-attention ``blocks[i].attn1`` gets its gate projection ``to_gate_compress``
  (``Linear(dim, dim)`` with bias), read from the FastWan transformer's own files
  (``blocks.{i}.to_gate_compress.*``; :mod:`.fastwan`). diffusers' loader sets these keys aside
  ("weights ... were not used"), so they are read again here, gate keys only;
- a forward pre-hook reads the latent grid from the model's input: ``hidden_states`` is
  ``(B, C, F, H, W)`` and the patch ``(pt, ph, pw)`` gives the token grid
  ``(F // pt, H // ph, W // pw)``, in the raster order the model flattens it; and the timestep,
  for the schedule window (``sigma = timestep / 1000``, the largest per-token value for Wan2.2's
  per-token timesteps);
- each ``attn1`` processor runs VSA as FastVideo's Wan backend defines it (4x4x4 cubes, partial
  edge cubes carry their live-token counts, ``topk = max(1, min(ceil((1 - sparsity) * cubes),
  cubes))``, fine + gate * coarse, RoPE on q and k before tiling, no prefix: text enters through
  the dense cross-attention ``attn2``, which is left alone). Outside the window, in
  ``dense_blocks`` and on calls it cannot serve, the processor that was there before runs (with
  the diffusers attention backend the user set), and one log line per reason says why.

:func:`solattn.integrations.diffusers.disable` restores the processors, removes the hook and the
gates: the model then computes exactly what it computed before.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..validation import SUPPORTED_DTYPES
from ..op import video_sparse_attn
from . import diffusers_gates, fastwan
from .diffusers_h3 import STATE_ATTR, FastH3Processor, VsaState, _check_settings, _note, percent_to_sigma


NAME = "enable_fastwan"
#: WanTransformer3DModel.forward's first parameters, in order (positional calls are mapped by them)
FORWARD_ARGS = ("hidden_states", "timestep")
#: Wan's flow schedulers count timesteps to 1000 (sigma = timestep / 1000)
NUM_TRAIN_TIMESTEPS = 1000.0
Grid = Tuple[int, int, int]


class FastWan(VsaState):
    """Settings and per-call state of one transformer running FastWan (``enable_fastwan``'s result;
    also ``transformer._solattn_fasth3``). ``grid`` is the token grid while the current forward
    runs sparse, else None; the pre-hook sets it before every forward."""

    LABEL = "FastWan"

    def __init__(self, sparsity: float, sigma_start: float, sigma_end: float, dense_blocks: frozenset,
                 patch_size: Sequence[int]):
        super().__init__(sparsity, sigma_start, sigma_end, dense_blocks)
        self.patch_size = tuple(int(p) for p in patch_size)
        self.grid: Optional[Grid] = None

    def clear(self) -> None:
        self.grid = None

    @torch.compiler.disable
    def read_forward(self, module, args, kwargs):
        """The transformer's forward pre-hook: this forward's grid, or None (dense)."""
        self.grid = None
        inputs = dict(zip(FORWARD_ARGS, args))
        inputs.update((k, v) for k, v in kwargs.items() if k in FORWARD_ARGS)
        x = inputs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            self.note("args", "dense: the forward call has no (B, C, F, H, W) hidden_states")
            return None
        if not self.whole_schedule:
            t = inputs.get("timestep")
            if not isinstance(t, torch.Tensor):
                self.note("timestep", "dense: the forward call has no timestep tensor for the schedule window")
                return None
            sigma = float(t.detach().max()) / NUM_TRAIN_TIMESTEPS
            if sigma > self.sigma_start or sigma < self.sigma_end:
                self.note("schedule", f"dense: sigma {sigma:.4g} (timestep {sigma * NUM_TRAIN_TIMESTEPS:.4g}) is "
                                      f"outside the sparse window [{self.sigma_end:.4g}, {self.sigma_start:.4g}]")
                return None
        pt, ph, pw = self.patch_size
        _, _, f, h, w = x.shape
        self.grid = (f // pt, h // ph, w // pw)
        cubes = math.prod(-(-n // 4) for n in self.grid)
        self.note(("sparse", self.grid), f"vsa: grid {self.grid} ({cubes} cubes of 4x4x4, "
                                         f"top-k {fastwan_topk(self.sparsity, cubes)}), sparsity {self.sparsity:g}"
                  + (f", blocks {sorted(self.dense_blocks)} dense" if self.dense_blocks else ""))
        return None


def fastwan_topk(sparsity: float, cubes: int) -> int:
    """FastVideo's rule: ``max(1, min(ceil((1 - sparsity) * cubes), cubes))``."""
    return max(1, min(math.ceil((1 - sparsity) * cubes), cubes))


def _rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on ``(B, S, H, D)``: channel pairs ``(2j, 2j + 1)`` turn
    by the pair's angle (diffusers' ``freqs_cos`` / ``freqs_sin`` repeat each angle twice)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class FastWanProcessor(FastH3Processor):
    """Wan self-attention processor running VSA through solattn while its ``FastWan`` state says so,
    else the processor it replaced (``dense``)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs) -> torch.Tensor:
        state = self.state
        grid = state.grid

        def dense():
            return self.dense(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)

        if grid is None or self.block_index in state.dense_blocks:
            return dense()
        reason = self._refusal(hidden_states, encoder_hidden_states, attention_mask, rotary_emb, grid)
        if reason is not None:
            _note(state, reason)
            return dense()
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotary(query, *rotary_emb), _rotary(key, *rotary_emb)
        projection = getattr(attn, fastwan.GATE_ATTR, None)
        gate = None if projection is None else projection(hidden_states).unflatten(-1, (attn.heads, -1))
        out = video_sparse_attn(query, key, value, grid, sparsity=state.sparsity, gate=gate)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _refusal(self, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, grid) -> Optional[str]:
        if encoder_hidden_states is not None:
            return "dense: a cross-attention call reached the self-attention processor"
        if attention_mask is not None:
            return "dense: an attention_mask was passed (VSA takes none)"
        if self._parallel_config is not None:
            return "dense: context parallelism shards the sequence (VSA needs the whole video)"
        if hidden_states.dtype not in SUPPORTED_DTYPES:
            return f"dense: dtype {hidden_states.dtype} (solattn runs {', '.join(map(str, SUPPORTED_DTYPES))})"
        if hidden_states.shape[1] != math.prod(grid):
            return (f"dense: {hidden_states.shape[1]} tokens, the latent grid {grid} has {math.prod(grid)} "
                    f"(extra tokens the grid does not describe)")
        return None


def _wan_blocks(transformer) -> Sequence[nn.Module]:
    blocks = getattr(transformer, "blocks", None)
    attn = getattr(blocks[0], "attn1", None) if blocks else None
    if attn is None or not hasattr(attn, "set_processor") or not hasattr(attn, "to_q"):
        raise ValueError(f"{NAME}: argument 'transformer' received a {type(transformer).__name__}; allowed: a "
                         f"diffusers WanTransformer3DModel (blocks[i].attn1 with set_processor)")
    if getattr(transformer, STATE_ATTR, None) is not None:
        raise RuntimeError(f"{NAME}: VSA is already enabled on this transformer; call "
                           f"solattn.integrations.diffusers.disable(transformer) first to change its settings")
    return blocks


def enable_fastwan(transformer, gates, *, sparsity: float = 0.8, start_percent: float = 0.0,
                   end_percent: float = 1.0, shift: float = 8.0, dense_blocks: Iterable[int] = ()) -> FastWan:
    """Run a diffusers ``WanTransformer3DModel`` as FastWan (VSA self-attention through solattn).

    Args:
        transformer: the loaded transformer (e.g. ``pipe.transformer``), changed in place (a
            ``torch.compile``'d one: the module it wraps). Call this before diffusers' group
            offloading.
        gates: the FastWan gate projections: the FastWan ``transformer`` folder (or the pipeline
            folder holding it), a safetensors file, a list of them, or a state dict; FastWan's
            ``blocks.{i}.to_gate_compress.{weight,bias}`` naming (``blocks.{i}.attn1.`` and
            ComfyUI's ``blocks.{i}.self_attn.`` too), any prefix. A missing or misshapen gate is
            refused naming its key. ``None``: no coarse branch (FastVideo's zero gate: the sparse
            fine stage only), or the model's own ``attn1.to_gate_compress`` when it has them.
        sparsity: the skipped fraction of cubes; ``topk = max(1, min(ceil((1 - sparsity) *
            cubes), cubes))`` key cubes per query cube. FastWan was trained at 0.8 (1.3B, 5B) and
            0.9 (14B).
        start_percent, end_percent: the part of sampling that runs sparse: a forward is sparse
            while ``timestep / 1000`` lies in ``[percent_to_sigma(end), percent_to_sigma(start)]``.
        shift: the flow shift used to map percents to sigmas (FastWan2.1: 8, FastWan2.2-5B: 5).
        dense_blocks: block indices that always run dense.
    """
    transformer = getattr(transformer, "_orig_mod", transformer)
    blocks = _wan_blocks(transformer)
    frozen = _check_settings(sparsity, "exempt", start_percent, end_percent, shift, dense_blocks, len(blocks))
    attns = [block.attn1 for block in blocks]
    dim, heads = attns[0].to_q.in_features, attns[0].heads
    if attns[0].to_q.out_features != dim:
        raise ValueError(f"{NAME}: argument 'transformer' has attn1.to_q {attns[0].to_q.in_features} -> "
                         f"{attns[0].to_q.out_features}; allowed: a Wan transformer (dim -> dim projections)")
    tensors = None
    if gates is not None:
        diffusers_gates.refuse_group_offload(transformer, "enable_vsa")
        tensors = fastwan.checked_gates(gates, len(blocks), dim, heads, NAME)   # refuses before any change
        for i, attn in enumerate(attns):
            if getattr(attn, fastwan.GATE_ATTR, None) is not None:
                raise RuntimeError(f"{NAME}: blocks.{i}.attn1 already has a {fastwan.GATE_ATTR}; pass gates=None "
                                   f"to use it")
    state = FastWan(float(sparsity), percent_to_sigma(float(start_percent), float(shift)),
                    percent_to_sigma(float(end_percent), float(shift)), frozen,
                    transformer.config.patch_size)
    return state.install(transformer, attns, tensors, FastWanProcessor, "enable_vsa", " (FastVideo's zero gate)")


__all__ = ["FastWan", "FastWanProcessor", "enable_fastwan", "fastwan_topk"]
