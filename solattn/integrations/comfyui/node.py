"""Applying the node to a ComfyUI model (``apply``) and the node classes ComfyUI registers.

With ComfyUI's node API v3 (``comfy_api.latest`` with ``DynamicCombo``), the node's inputs have the
names of the built-in "Model Sparse Attention" node (``selection`` shown as "method", with ``tau`` /
``keep_percent`` under it, ``start_percent``, ``end_percent``, ``dense_blocks``, ``min_tokens``,
``extra_tokens``, ``sink_conditioning``, ``verbose``), so swapping the two keeps a workflow's
values. Older ComfyUI gets the classic node with the same values as flat inputs.
"""

from __future__ import annotations

import inspect
import numbers

from . import wan
from .attention import install_override
from .h3 import PATCH_KEY, install_block_patches
from .settings import (DEFAULT_MIN_TOKENS, DISPLAY_NAME, METHODS, NODE_ID, SINK_MODES, VSA_PREFIX_MODES,
                       Settings, check_percent, fail, parse_block_list)
from .state import SparseAttention, log

CALLBACK_KEY = "solattn_sparse_attention"


def _h3_model_class():
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError:
        return None
    return MiniMaxH3Model


def _blocks_take_attention(diffusion_model) -> bool:
    blocks = getattr(diffusion_model, "blocks", None)
    if not blocks:
        return False
    return "attention" in inspect.signature(blocks[0].forward).parameters


def _has_gate(diffusion_model) -> bool:
    return getattr(diffusion_model.blocks[0].attn, "to_gate_compress", None) is not None


def choose_method(method: str, diffusion_model, wan_gates=None, no_gates_reason: str = "vsa_gates gave none"):
    """``(method to run, why)``: ``method`` itself (why None), or for ``auto`` vsa on a MiniMax-H3
    model with ``to_gate_compress`` (a FastH3 checkpoint) whose blocks take the ``attention=``
    argument or on a Wan model with FastWan gates (``wan_gates``, :func:`.wan.resolve_gates`),
    else sol-attn."""
    if method not in METHODS:
        fail("method", method, f"one of {METHODS}")
    h3_class = _h3_model_class()
    is_h3 = h3_class is not None and isinstance(diffusion_model, h3_class)
    if not is_h3 and wan.is_wan(diffusion_model):
        why = None
        if method == "auto":
            method, why = (("vsa", f"a Wan model with FastWan to_gate_compress gates (from {wan_gates.source})")
                           if wan_gates is not None else
                           ("sol-attn", f"a Wan model without FastWan to_gate_compress gates: {no_gates_reason}"))
        return method, why
    why = None
    if method == "auto":
        if is_h3 and _has_gate(diffusion_model) and _blocks_take_attention(diffusion_model):
            method, why = "vsa", "a MiniMax-H3 model with to_gate_compress (FastH3)"
        elif is_h3 and _has_gate(diffusion_model):
            method, why = "sol-attn", "this ComfyUI's MiniMax-H3 blocks take no 'attention' argument, which vsa needs"
        else:
            method, why = "sol-attn", ("a MiniMax-H3 model without to_gate_compress" if is_h3 else
                                       f"{type(diffusion_model).__name__} is not a MiniMax-H3 model")
    if method == "vsa" and not is_h3:
        fail("method", method, "'vsa' only on MiniMax-H3 (FastH3) and Wan (FastWan) models; "
                               "'auto', 'sol-attn' or 'sla' on this model")
    if method == "vsa" and not _blocks_take_attention(diffusion_model):
        raise RuntimeError(f"{DISPLAY_NAME}: this ComfyUI's MiniMax-H3 blocks take no 'attention' "
                           f"argument, which vsa needs; update ComfyUI")
    return method, why


def _install_vsa_at_step(state: SparseAttention, model_options: dict):
    """Before every step: a node applied after this one that replaced its block patches (ComfyUI's
    built-in sparse node does) gets wrapped, so vsa still runs; one line says so."""
    opts = model_options.get("transformer_options", {})
    patches = dict(opts.get("patches_replace", {}))
    dit = dict(patches.get("dit", {}))
    wrapped = install_block_patches(state, state.h3_blocks, dit)
    if dit == patches.get("dit"):
        return
    patches["dit"] = dit
    model_options["transformer_options"] = {**opts, "patches_replace": patches}
    if wrapped:
        state.note("later_block_patches", f"{wrapped} block patch(es) of a node applied after this one "
                                          f"(such as ComfyUI's built-in 'Model Sparse Attention') replaced "
                                          f"vsa's; vsa now runs around them, they run inside it", always=True)


def apply(model, *, method: str = "auto", tau: float = 1.3, keep_percent: float = 10.0,
          start_percent: float = 0.0, end_percent: float = 1.0, dense_blocks="",
          min_tokens: int = DEFAULT_MIN_TOKENS, sink_conditioning: str = "exact_kv_and_rows",
          vsa_prefix: str = "exempt", extra_tokens: int = 0, verbose: bool = True,
          vsa_gates=wan.FROM_MODEL_FILE):
    """Return a clone of the ComfyUI ``model`` (a ModelPatcher) with solattn sparse attention.
    ``extra_tokens`` is accepted so that the built-in node's values carry over; solattn routes
    whole key blocks, so a non-zero value has no effect (one log line says so). ``vsa_gates``
    (Wan models): where FastWan's gates come from: ``"from_model_file"`` (the file "Load
    Diffusion Model" loaded, e.g. one ``python -m solattn.integrations.fastwan to-comfyui``
    wrote), ``"none"``, a file in ``models/diffusion_models`` or a path, or a state dict."""
    check_percent("start_percent", start_percent)
    check_percent("end_percent", end_percent)
    if isinstance(extra_tokens, bool) or not isinstance(extra_tokens, numbers.Integral):
        fail("extra_tokens", extra_tokens, "an int >= 0", TypeError)
    if extra_tokens < 0:
        fail("extra_tokens", extra_tokens, "an int >= 0")
    diffusion_model = model.get_model_object("diffusion_model")
    model_sampling = model.get_model_object("model_sampling")
    is_wan = wan.is_wan(diffusion_model)
    wan_gates = wan.resolve_gates(model, diffusion_model, vsa_gates) if is_wan else None
    no_gates = wan.no_gates_reason(model, vsa_gates) if is_wan and wan_gates is None else ""
    method, why = choose_method(method, diffusion_model, wan_gates, no_gates)
    settings = Settings(method=method, tau=tau, keep_percent=keep_percent, min_tokens=min_tokens,
                        sigma_start=float(model_sampling.percent_to_sigma(start_percent)),
                        sigma_end=float(model_sampling.percent_to_sigma(end_percent)),
                        dense_blocks=parse_block_list(dense_blocks), sink_conditioning=sink_conditioning,
                        vsa_prefix=vsa_prefix, start_percent=start_percent, end_percent=end_percent,
                        verbose=verbose)
    if why is not None:
        log.info("%s: method auto chose %s: %s", DISPLAY_NAME, method, why)
    if extra_tokens:
        log.info("%s: extra_tokens %d has no effect: solattn keeps whole key blocks (no extra routed "
                 "tokens)", DISPLAY_NAME, extra_tokens)

    h3_class = _h3_model_class()
    blocks = diffusion_model.blocks if h3_class is not None and isinstance(diffusion_model, h3_class) else None
    state = SparseAttention(settings, getattr(diffusion_model, "patch_size", (1, 2, 2)), blocks)
    m = model.clone()
    from comfy.patcher_extension import CallbacksMP

    def cleanup(model_patcher):
        state.reset()
        if wan_gates is not None:
            wan_gates.release()           # no device copies of the gates between runs

    m.add_callback_with_key(CallbacksMP.ON_CLEANUP, CALLBACK_KEY, cleanup)
    if method == "vsa" and is_wan:
        wan.install_attention_patches(state, m, wan_gates, len(diffusion_model.blocks))
        if hasattr(CallbacksMP, "ON_CLONE"):     # deep copies of the model get patches of their own modules
            m.add_callback_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY,
                                    lambda model_patcher, clone: wan.rebind_attention_patches(clone))
        if wan_gates is None:
            log.warning("%s: no FastWan to_gate_compress gates (%s); vsa runs the sparse fine stage without the "
                        "coarse branch (FastVideo's zero gate)", DISPLAY_NAME, no_gates)
        else:
            log.info("%s: FastWan gates of %d blocks from %s", DISPLAY_NAME, len(wan_gates.tensors), wan_gates.source)
    elif method == "vsa":
        dit = dict(m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {}))
        chained = install_block_patches(state, blocks, dit)
        for i in range(len(blocks)):
            m.set_model_patch_replace(dit[(PATCH_KEY, i)], "dit", PATCH_KEY, i)
        if chained:
            log.info("%s: vsa wraps %d block patch(es) another node installed earlier; they run inside "
                     "it, with the sparse attention", DISPLAY_NAME, chained)
        if not _has_gate(diffusion_model):
            log.warning("%s: the model has no to_gate_compress layers; vsa runs the sparse fine stage "
                        "without the coarse branch", DISPLAY_NAME)
    else:
        install_override(state, m.model_options["transformer_options"])

    def prepare_step(model_patcher, timestep, model_options, *args):
        state.new_step()
        if method == "vsa" and is_wan:
            return                                   # object patches: nothing a later node can replace
        if method == "vsa":
            _install_vsa_at_step(state, model_options)
        else:
            install_override(state, model_options.setdefault("transformer_options", {}), at_step=True)

    m.add_callback_with_key(CallbacksMP.ON_PREPARE_STATE, CALLBACK_KEY, prepare_step)
    m.solattn_sparse_attention = state    # for inspection and tests
    return m
