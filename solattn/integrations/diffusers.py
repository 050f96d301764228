"""VSA checkpoints in diffusers, through :func:`solattn.video_sparse_attn`: FastWan (Wan2.1 /
Wan2.2, :mod:`.diffusers_wan`) and FastH3 (MiniMax-H3, :mod:`.diffusers_h3`).
:func:`enable_vsa` picks by model, :func:`disable` undoes either.

    from solattn.integrations.diffusers import disable, enable_vsa
    enable_vsa(pipe.transformer, "<checkpoint>/transformer")     # its to_gate_compress weights
    ...
    disable(pipe.transformer)                                     # the dense model, bit for bit
"""

from __future__ import annotations

from . import diffusers_gates
from .diffusers_h3 import (STATE_ATTR, FastH3, FastH3Processor, VsaState, enable_fasth3, packed_layout,
                           percent_to_sigma)
from .diffusers_wan import FastWan, enable_fastwan

__all__ = ["enable_vsa", "disable", "enable_fasth3", "enable_fastwan", "FastH3", "FastH3Processor", "FastWan",
           "STATE_ATTR", "VsaState", "packed_layout", "percent_to_sigma"]


def enable_vsa(transformer, gates, **settings):
    """Run a VSA-trained checkpoint's attention through solattn, whichever model it is: a
    ``WanTransformer3DModel`` as FastWan (:func:`.diffusers_wan.enable_fastwan`: ``sparsity``
    0.8 by default, ``start_percent``, ``end_percent``, ``shift``, ``dense_blocks``), a
    ``MiniMaxH3Transformer3DModel`` as FastH3 (:func:`enable_fasth3`, which also takes
    ``prefix_mode``). ``gates``: the checkpoint's ``to_gate_compress`` projections (its
    transformer folder, safetensors files or a state dict), or None. Undo with :func:`disable`."""
    module = getattr(transformer, "_orig_mod", transformer)
    blocks = getattr(module, "blocks", None)
    if blocks and hasattr(blocks[0], "attn1"):
        return enable_fastwan(transformer, gates, **settings)
    if getattr(module, "transformer_blocks", None):
        return enable_fasth3(transformer, gates, **settings)
    raise ValueError(f"enable_vsa: argument 'transformer' received a {type(module).__name__}; allowed: a diffusers "
                     f"WanTransformer3DModel (FastWan) or MiniMaxH3Transformer3DModel (FastH3)")


def disable(transformer, *, keep_gates: bool = False) -> None:
    """Undo :func:`enable_vsa` / :func:`enable_fasth3` / ``enable_fastwan``: the original
    processors and no hook; the gate projections are removed unless ``keep_gates`` (they are
    unused by the dense model either way)."""
    transformer = getattr(transformer, "_orig_mod", transformer)
    state = getattr(transformer, STATE_ATTR, None)
    if not isinstance(state, VsaState):
        raise ValueError(f"disable: argument 'transformer' received a {type(transformer).__name__} without "
                         f"VSA enabled; allowed: a transformer enable_vsa (enable_fasth3, enable_fastwan) "
                         f"was applied to")
    state.hook.remove()
    for attn, processor in state.originals.items():
        attn.set_processor(processor)
    if not keep_gates:
        for attn in state.added_gates:
            delattr(attn, diffusers_gates.GATE_ATTR)
    delattr(transformer, STATE_ATTR)
    state.clear()
