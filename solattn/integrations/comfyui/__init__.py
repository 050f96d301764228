"""ComfyUI node "Model Sparse Attention (solattn)": block-sparse attention through solattn.

The node takes the place of ComfyUI's built-in "Model Sparse Attention" node, with the same input
names, but runs on every device solattn runs on (xpu, cpu, mps, cuda):

- MiniMax-H3 with ``vsa`` (what ``auto`` picks for a FastH3 checkpoint, one with
  ``to_gate_compress``): every transformer block is replaced by a patch that runs the block
  unchanged except for the attention core (:mod:`.h3`): :func:`solattn.video_sparse_attn` with the
  gate ``attn.to_gate_compress(attention input)`` and the layout of
  ``transformer_options["minimax_h3_layout"]`` (conditioning segments as the prefix, video as
  4x4x4 cubes of the patched latent grid).
- Any other model, and ``sol-attn`` / ``sla`` on MiniMax-H3: the ``optimized_attention_override``
  hook runs :func:`solattn.sol_attn` on self-attention calls (:mod:`.attention`).
- Outside the schedule window, under the token minimum, in ``dense_blocks``, for masked,
  cross-attention and grouped-key calls and on inputs solattn refuses, the attention that was
  there before runs (another node's override, else the checkpoint's own attention choice, else
  ComfyUI's), and one log line says why (:mod:`.state`).

Modules: :mod:`.settings` (choices and their checks), :mod:`.state` (schedule and log decisions),
:mod:`.attention` and :mod:`.h3` (the two override paths), :mod:`.node` (``apply``), :mod:`.classes`
(the node classes). Nothing here imports ComfyUI at import time except :mod:`.classes`, which uses
ComfyUI's node API v3 when it is importable.
"""

from .attention import OVERRIDE_KEY, install_override, make_override
from .classes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, ClassicNode, SolAttnModelSparseAttention
from .h3 import install_block_patches, make_block_patch
from .node import CALLBACK_KEY, apply, choose_method
from .settings import (DEFAULT_MIN_TOKENS, DISPLAY_NAME, METHODS, NODE_ID, RUN_METHODS, SINK_MODES,
                       VSA_PREFIX_MODES, Settings, parse_block_list)
from .state import SparseAttention

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "NODE_ID", "DISPLAY_NAME", "METHODS", "RUN_METHODS",
           "SINK_MODES", "VSA_PREFIX_MODES", "DEFAULT_MIN_TOKENS", "OVERRIDE_KEY", "CALLBACK_KEY", "Settings",
           "SparseAttention", "ClassicNode", "SolAttnModelSparseAttention", "apply", "choose_method",
           "parse_block_list", "make_override", "install_override", "make_block_patch",
           "install_block_patches"]
