"""ComfyUI node "Model Sparse Attention (solattn)": block-sparse attention through solattn.

The node takes the place of ComfyUI's built-in "Model Sparse Attention" node and offers its
choices, but runs on every device solattn runs on (xpu, cpu, mps, cuda):

- MiniMax-H3 with ``vsa``: every transformer block is replaced by a patch
  (``set_model_patch_replace(patch, "dit", "double_block", i)``) that runs the block unchanged
  except for the attention core. The block's own attention module still projects, normalises
  and ropes q/k; a per-call ``optimized_attention_override`` then hands q, k, v to
  :func:`solattn.video_sparse_attn` with the gate ``attn.to_gate_compress(attention input)``
  and the layout of ``transformer_options["minimax_h3_layout"]`` (conditioning segments as
  the prefix, video as 4x4x4 cubes of the patched latent grid).
- Any other model, and ``sol-attn`` / ``sla`` on MiniMax-H3: the ``optimized_attention_override``
  hook runs :func:`solattn.sol_attn` on self-attention calls.
- Outside the schedule window, under the token minimum, in ``dense_blocks``, for masked or
  cross-attention calls and on inputs solattn refuses, the attention that was there before
  runs, and one log line says why.

Nothing here imports ComfyUI at module import: the node logic is plain Python over the
objects ComfyUI passes in, so it is testable without ComfyUI. ``apply`` imports
``comfy.patcher_extension`` and ``comfy.ldm.minimax.model`` when it runs inside ComfyUI.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
from dataclasses import dataclass
from typing import Callable, FrozenSet, Optional, Sequence, Tuple

import torch

from .. import dispatch
from ..ops import sol_attn
from ..validation import BLOCK, fail, validate
from ..video import video_sparse_attn

log = logging.getLogger("solattn.comfyui")

NODE_ID = "SolAttnModelSparseAttention"
DISPLAY_NAME = "Model Sparse Attention (solattn)"
METHODS = ("sol-attn", "sla", "vsa")
SINK_MODES = ("exact_kv_and_rows", "exact_kv", "off")
VSA_PREFIX_MODES = ("exempt", "compete")
DEFAULT_MIN_TOKENS = 12288
OVERRIDE_KEY = "optimized_attention_override"
CALLBACK_KEY = "solattn_sparse_attention"


def _fail(arg: str, received, allowed: str, exc=ValueError):
    fail(DISPLAY_NAME, arg, repr(received), allowed, exc)


#: a dense_blocks entry: (block type or None for any, block index)
BlockKey = Tuple[Optional[str], int]


def parse_block_list(text) -> FrozenSet[BlockKey]:
    """``"0, 1, 47-49, single:3-4"`` -> ``{(None, 0), (None, 1), (None, 47), (None, 48), (None, 49),
    ("single", 3), ("single", 4)}``; empty text -> no blocks. An entry without a type matches that
    index in every block family; ``type:`` limits it to calls whose
    ``transformer_options["block_type"]`` is that type (ComfyUI's Flux-like models number their
    ``double`` and ``single`` blocks from 0 each)."""
    allowed = ("block indices and ranges separated by commas or spaces, each optionally after a block "
               "type, e.g. '0, 1, 47-49' or 'double:0-2, single:5'")
    if text is None:
        return frozenset()
    if not isinstance(text, str):
        _fail("dense_blocks", text, allowed, TypeError)
    blocks = set()
    # spaces around a dash or after a colon belong to the entry; any other comma / space separates
    for piece in re.split(r"[,\s]+", re.sub(r"\s*:\s*", ":", re.sub(r"\s*-\s*", "-", text.strip()))):
        if not piece:
            continue
        m = re.fullmatch(r"(?:([A-Za-z_]+):)?(\d+)(?:-(\d+))?", piece)
        if m is None:
            _fail("dense_blocks", text, allowed)
        kind = None if m.group(1) is None else m.group(1).lower()
        a = int(m.group(2))
        b = a if m.group(3) is None else int(m.group(3))
        blocks.update((kind, i) for i in range(min(a, b), max(a, b) + 1))
    return frozenset(blocks)


@dataclass(frozen=True)
class Settings:
    """The node's choices, checked. ``sigma_start >= sigma_end`` bound the sparse window."""

    method: str = "sol-attn"
    tau: float = 1.3
    keep_percent: float = 10.0
    sigma_start: float = math.inf
    sigma_end: float = 0.0
    min_tokens: int = DEFAULT_MIN_TOKENS
    dense_blocks: FrozenSet[BlockKey] = frozenset()   # parse_block_list's; plain ints: any type
    sink_conditioning: str = "exact_kv_and_rows"
    vsa_prefix: str = "exempt"

    def __post_init__(self):
        if self.method not in METHODS:
            _fail("method", self.method, f"one of {METHODS}")
        for name in ("tau", "keep_percent", "sigma_start", "sigma_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                _fail(name, value, "a number", TypeError)
        if not math.isfinite(self.tau):
            _fail("tau", self.tau, "a finite number")
        if not 0.0 < self.keep_percent < 100.0:
            _fail("keep_percent", self.keep_percent, "a percentage 0 < keep_percent < 100")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral):
            _fail("min_tokens", self.min_tokens, "an int >= 0", TypeError)
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an int >= 0")
        if self.sink_conditioning not in SINK_MODES:
            _fail("sink_conditioning", self.sink_conditioning, f"one of {SINK_MODES}")
        if self.vsa_prefix not in VSA_PREFIX_MODES:
            _fail("vsa_prefix", self.vsa_prefix, f"one of {VSA_PREFIX_MODES}")
        # plain ints match every block family; families compare lower-case, as dense_reason reads them
        object.__setattr__(self, "dense_blocks", frozenset(
            (None, int(x)) if isinstance(x, numbers.Integral)
            else (None if x[0] is None else str(x[0]).lower(), int(x[1])) for x in self.dense_blocks))

    @property
    def topk_ratio(self) -> float:
        """``sol_attn``'s ``topk_ratio``: 0 (tau mode) for sol-attn, the kept fraction for sla."""
        return 0.0 if self.method == "sol-attn" else self.keep_percent / 100.0

    @property
    def sparsity(self) -> float:
        """VSA's sparsity, the skipped fraction, as the decimal FastVideo is given (10 -> 0.9)."""
        return (100.0 - self.keep_percent) / 100.0


def _video_segment(layout) -> Optional[Tuple[int, int]]:
    videos = [(a, b) for a, b, kind in layout.segments if kind == "video"]
    return videos[0] if len(videos) == 1 else None


class SparseAttention:
    """Options plus per-run state of one patched model (the log-once memory, reset at cleanup)."""

    def __init__(self, settings: Settings, patch_size: Sequence[int] = (1, 2, 2)):
        self.settings = settings
        self.patch_size = tuple(int(p) for p in patch_size)
        self.installed = set()   # override closures this object put on the hook
        self._logged = set()
        self._sigma = None       # (sigmas tensor, its version or None, its first sigma): see first_sigma

    # -- bookkeeping ------------------------------------------------------------------------
    def reset(self):
        self._logged.clear()
        self._sigma = None

    def first_sigma(self, sigmas) -> float:
        """``sigmas``' first entry as a float. ComfyUI hands every attention call of one model step
        the same ``sigmas`` tensor, usually on the GPU, where reading it waits for the device: so it
        is read once per tensor, not once per attention call, which would stop the host from
        queueing the next layers' work while the GPU runs. The cache holds the tensor itself, so a
        new tensor never takes a freed one's identity, and it is dropped before every model step
        (:meth:`new_step`, from ComfyUI's per-step ``ON_PREPARE_STATE`` callback). ComfyUI samples
        under ``torch.inference_mode()``, whose tensors have no version counter; outside it the
        version is part of the key too, so an in-place change is read again."""
        if not isinstance(sigmas, torch.Tensor):
            return float(sigmas[0])
        version = None if sigmas.is_inference() else sigmas._version
        cached = self._sigma
        if cached is not None and cached[0] is sigmas and cached[1] == version:
            return cached[2]
        value = float(sigmas.reshape(-1)[0])
        self._sigma = (sigmas, version, value)
        return value

    def new_step(self):
        """Forget the step's sigma (called before every model step)."""
        self._sigma = None

    def note(self, key, message: str):
        """Log ``message`` once per ``key`` until the next :meth:`reset` (one line per reason)."""
        if key not in self._logged:
            self._logged.add(key)
            log.info("%s: %s", DISPLAY_NAME, message)

    # -- decisions shared by both paths -----------------------------------------------------
    def dense_reason(self, transformer_options, tokens: int, block_index) -> Optional[Tuple[str, str]]:
        """``(kind, message)`` when this call stays dense whatever its tensors are, else None."""
        s = self.settings
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = self.first_sigma(sigmas)
            if sigma > s.sigma_start or sigma < s.sigma_end:
                return "schedule", (f"dense: sigma {sigma:.4g} is outside the start/end window "
                                    f"[{s.sigma_end:.4g}, {s.sigma_start:.4g}]")
        if tokens < s.min_tokens:
            return "min_tokens", f"dense: {tokens} tokens < min_tokens {s.min_tokens}"
        if s.dense_blocks:
            if block_index is None:
                # without the index no call can be matched to a block: say so instead of
                # silently running the listed blocks sparse
                self.note("no_block_index", "dense_blocks has no effect: this model's attention calls "
                                            "carry no transformer_options['block_index'] (update ComfyUI)")
            else:
                i, kind = int(block_index), transformer_options.get("block_type")
                if (None, i) in s.dense_blocks or (kind is not None and (str(kind).lower(), i) in s.dense_blocks):
                    label = f"{kind}:{i}" if kind is not None else str(i)
                    return "dense_blocks", f"dense: block {label} is in dense_blocks"
                if kind is None and any(t is not None for t, _ in s.dense_blocks):
                    self.note("no_block_type", "dense_blocks entries with a block type have no effect: this "
                                               "model's attention calls carry no transformer_options['block_type']")
        return None

    def sinks(self, transformer_options, tokens: int):
        """MiniMax-H3's conditioning rows for ``sol_attn``: ``(sink_blocks, sink_q)``.

        The packed prefix (text, conditioning, audio) are exact keys of every query block;
        with ``exact_kv_and_rows`` the target-audio query rows also attend every key exactly.
        """
        layout = transformer_options.get("minimax_h3_layout")
        mode = self.settings.sink_conditioning
        if mode == "off" or layout is None or getattr(layout, "seq_len", None) != tokens:
            return None, None
        video = _video_segment(layout)
        if video is None or video[0] <= 0:
            return None, None
        kv = [0, -(-video[0] // BLOCK)]
        if mode == "exact_kv":
            return kv, None
        audio = [(a, b) for a, b, kind in layout.segments if kind == "audio"]
        return kv, ([audio[0][0] // BLOCK, kv[1]] if audio else list(kv))

    def run_or_note(self, qs, check: Callable, run: Callable):
        """``run()``'s output, or None after noting why solattn refuses the call: ``check`` (solattn's
        argument check) failed, or no backend runs it (raised while choosing, before any work)."""
        refused = _refusal(check)
        if refused is None:
            try:
                return run()
            except dispatch.BackendError as err:
                refused = str(err).splitlines()[0]
        self.note(("refused", refused), f"dense: solattn refuses {tuple(qs.shape)} "
                                        f"{qs.dtype} on {qs.device}: {refused}")
        return None

    # -- generic path: the attention override ------------------------------------------------
    def make_override(self, previous: Optional[Callable]) -> Callable:
        """An ``optimized_attention_override`` running ``sol_attn``; declined calls run
        ``previous`` (the override that was on the hook) or ComfyUI's attention function."""
        s = self.settings

        def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                     skip_output_reshape=False, **kwargs):
            opts = kwargs.get("transformer_options") or {}

            def dense():
                return _previous_attention(previous, func, q, k, v, heads, mask=mask,
                                           attn_precision=attn_precision, skip_reshape=skip_reshape,
                                           skip_output_reshape=skip_output_reshape, **kwargs)

            if mask is not None:
                self.note("mask", "dense: masked attention call (solattn takes no attention mask)")
                return dense()
            if q.shape != k.shape or q.shape != v.shape or kwargs.get("enable_gqa", False):
                self.note("cross", f"dense: cross-attention or grouped keys (q {tuple(q.shape)}, "
                                   f"k {tuple(k.shape)}, v {tuple(v.shape)})")
                return dense()
            if skip_reshape:                                     # (B, H, N, D)
                tokens = q.shape[2]
                qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            else:                                                # (B, N, H * D)
                _, tokens, inner = q.shape
                if inner % heads:
                    self.note("heads", f"dense: inner dim {inner} is not divisible by {heads} heads")
                    return dense()
                dim_head = inner // heads
                qs, ks, vs = (t.unflatten(-1, (heads, dim_head)) for t in (q, k, v))
            reason = self.dense_reason(opts, tokens, opts.get("block_index"))
            if reason is not None:
                self.note(reason[0], reason[1])
                return dense()
            sink_blocks, sink_q = self.sinks(opts, tokens)
            call = dict(tau=s.tau, scale=kwargs.get("scale"), sink_blocks=sink_blocks, sink_q=sink_q,
                        topk_ratio=s.topk_ratio)
            out = self.run_or_note(qs, lambda: validate(qs, ks, vs, **call),
                                   lambda: sol_attn(qs, ks, vs, **call))
            if out is None:
                return dense()
            self.note(("sparse", tuple(qs.shape), qs.device.type),
                      f"{s.method} on {tuple(qs.shape)} {qs.dtype} {qs.device.type}"
                      + (f", sinks {sink_blocks}/{sink_q}" if sink_blocks else ""))
            return _comfy_layout(out, skip_output_reshape)

        return override

    def install_override(self, transformer_options: dict):
        """Put this object's override on top of the hook (idempotent once it is on top); also
        run before every step, so a node applied later cannot silently replace it."""
        current = transformer_options.get(OVERRIDE_KEY)
        if current in self.installed:
            return
        override = self.make_override(current)
        self.installed.add(override)
        transformer_options[OVERRIDE_KEY] = override

    # -- MiniMax-H3 VSA path: per-block patches ----------------------------------------------
    def vsa_geometry(self, layout, tokens: int):
        """``(grid, prefix segment lengths)`` of a packed H3 sequence, or a reason string."""
        if layout is None:
            return "no minimax_h3_layout in transformer_options"
        if getattr(layout, "seq_len", None) != tokens:
            return f"the layout describes {getattr(layout, 'seq_len', None)} rows, the call has {tokens}"
        video = _video_segment(layout)
        if video is None or video[1] != tokens:
            return "the layout's video segment is not the single last segment"
        _, lat_t, lat_h, lat_w, _ = layout.signature
        pt, ph, pw = self.patch_size
        grid = (int(lat_t) // pt, int(lat_h) // ph, int(lat_w) // pw)
        if math.prod(grid) != video[1] - video[0]:
            return f"video segment of {video[1] - video[0]} rows does not match the latent grid {grid}"
        prefix = [b - a for a, b, kind in layout.segments if kind != "video" and b > a]
        return grid, prefix

    def make_vsa_override(self, previous, grid, prefix, gate, block_index) -> Callable:
        s = self.settings

        def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                     skip_output_reshape=False, **kwargs):
            def dense():
                return _previous_attention(previous, func, q, k, v, heads, mask=mask,
                                           attn_precision=attn_precision, skip_reshape=skip_reshape,
                                           skip_output_reshape=skip_output_reshape, **kwargs)

            if mask is not None or not skip_reshape or q.shape != k.shape or q.shape != v.shape:
                self.note("vsa_call", f"dense: block {block_index} attention call is not the packed "
                                      f"self-attention VSA expects (mask={mask is not None}, "
                                      f"q {tuple(q.shape)}, k {tuple(k.shape)})")
                return dense()
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))          # (1, S, H, D)
            g = None if gate is None else gate.view(qs.shape)
            out = self.run_or_note(qs, lambda: validate(qs, ks, vs, scale=kwargs.get("scale")),
                                   lambda: video_sparse_attn(qs, ks, vs, grid, sparsity=s.sparsity, gate=g,
                                                             scale=kwargs.get("scale"), prefix_len=prefix,
                                                             prefix_mode=s.vsa_prefix))
            if out is None:
                return dense()
            self.note(("vsa", grid, tuple(prefix), qs.device.type),
                      f"vsa on {qs.device.type}: grid {grid}, prefix segments {list(prefix)} "
                      f"({s.vsa_prefix}), keep {s.keep_percent:g}%, "
                      + ("gated coarse branch" if g is not None else "no to_gate_compress: fine only"))
            return _comfy_layout(out, skip_output_reshape)

        return override

    def make_h3_block_patch(self, block, block_index: int, previous: Optional[Callable] = None) -> Callable:
        """The ``("dit", "double_block", i)`` replacement: the original block, whose attention
        call gets the VSA override when this call is inside the sparse settings. ``previous``:
        another node's replacement of the same block, installed before this one; it runs in the
        original block's place (with the VSA attention in its ``args``), so that node's change is
        kept rather than silently replaced."""
        attn = block.attn

        def block_patch(args, extra):
            def run(block_args):
                return extra["original_block"](block_args) if previous is None else previous(block_args, extra)

            h, opts = args["img"], args["transformer_options"]
            tokens = h.shape[-2]
            reason = self.dense_reason(opts, tokens, block_index)
            geometry = None
            if reason is None:
                geometry = self.vsa_geometry(opts.get("minimax_h3_layout"), tokens)
                if isinstance(geometry, str):
                    reason = ("layout", f"dense: {geometry}")
            if reason is not None:
                self.note(reason[0], reason[1])
                return run(args)
            grid, prefix = geometry

            def attention(x, rope_freqs=None, transformer_options={}):
                proj = getattr(attn, "to_gate_compress", None)
                gate = None if proj is None else proj(x)
                previous = transformer_options.get(OVERRIDE_KEY)
                override = self.make_vsa_override(previous, grid, prefix, gate, block_index)
                return attn(x, rope_freqs=rope_freqs,
                            transformer_options={**transformer_options, OVERRIDE_KEY: override})

            return run({**args, "attention": attention})

        return block_patch


def _previous_attention(previous, func, q, k, v, heads, **kw):
    """The attention that was there before: the override installed earlier, or ComfyUI's own."""
    return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)


def _comfy_layout(out: torch.Tensor, skip_output_reshape: bool) -> torch.Tensor:
    """solattn's ``(B, N, H, D)`` output in the layout ComfyUI's attention function returns:
    ``(B, H, N, D)`` with ``skip_output_reshape``, else ``(B, N, H * D)``."""
    if skip_output_reshape:
        return out.transpose(1, 2)
    return out.flatten(2)


def _refusal(check: Callable) -> Optional[str]:
    """The message of solattn's argument check, or None when the call is valid."""
    try:
        check()
    except (TypeError, ValueError) as err:
        return str(err)
    return None


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


def apply(model, *, method: str, tau: float = 1.3, keep_percent: float = 10.0,
          start_percent: float = 0.0, end_percent: float = 1.0, dense_blocks="",
          min_tokens: int = DEFAULT_MIN_TOKENS, sink_conditioning: str = "exact_kv_and_rows",
          vsa_prefix: str = "exempt"):
    """Return a clone of the ComfyUI ``model`` (a ModelPatcher) with solattn sparse attention."""
    for name, value in (("start_percent", start_percent), ("end_percent", end_percent)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
            _fail(name, value, "a number 0 <= percent <= 1")
    model_sampling = model.get_model_object("model_sampling")
    settings = Settings(method=method, tau=tau, keep_percent=keep_percent,
                        sigma_start=float(model_sampling.percent_to_sigma(start_percent)),
                        sigma_end=float(model_sampling.percent_to_sigma(end_percent)),
                        min_tokens=min_tokens, dense_blocks=parse_block_list(dense_blocks),
                        sink_conditioning=sink_conditioning, vsa_prefix=vsa_prefix)
    diffusion_model = model.get_model_object("diffusion_model")
    h3_class = _h3_model_class()
    is_h3 = h3_class is not None and isinstance(diffusion_model, h3_class)
    if method == "vsa" and not is_h3:
        _fail("method", method, "'vsa' only on MiniMax-H3 models (FastH3 checkpoints); "
                                "'sol-attn' or 'sla' on this model")
    if method == "vsa" and not _blocks_take_attention(diffusion_model):
        raise RuntimeError(f"{DISPLAY_NAME}: this ComfyUI's MiniMax-H3 blocks take no 'attention' "
                           f"argument, which vsa needs; update ComfyUI")

    state = SparseAttention(settings, getattr(diffusion_model, "patch_size", (1, 2, 2)))
    m = model.clone()
    from comfy.patcher_extension import CallbacksMP
    m.add_callback_with_key(CallbacksMP.ON_CLEANUP, CALLBACK_KEY, lambda model_patcher: state.reset())
    if method == "vsa":
        earlier = m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        chained = 0
        for i, block in enumerate(diffusion_model.blocks):
            previous = earlier.get(("double_block", i))
            chained += previous is not None
            m.set_model_patch_replace(state.make_h3_block_patch(block, i, previous), "dit", "double_block", i)
        if chained:
            log.info("%s: vsa wraps %d block patch(es) another node installed earlier; they run inside "
                     "it, with the sparse attention", DISPLAY_NAME, chained)
        if getattr(diffusion_model.blocks[0].attn, "to_gate_compress", None) is None:
            log.warning("%s: the model has no to_gate_compress layers; vsa runs the sparse fine stage "
                        "without the coarse branch", DISPLAY_NAME)
    else:
        state.install_override(m.model_options["transformer_options"])

    def prepare_step(model_patcher, timestep, model_options, *args):
        state.new_step()
        if method != "vsa":
            state.install_override(model_options["transformer_options"])

    m.add_callback_with_key(CallbacksMP.ON_PREPARE_STATE, CALLBACK_KEY, prepare_step)
    m.solattn_sparse_attention = state    # for inspection and tests
    return m


class SolAttnModelSparseAttention:
    """The ComfyUI node (classic node API, so it loads in every ComfyUI version)."""

    CATEGORY = "model/patch"
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    DESCRIPTION = ("Block-sparse attention through solattn on any device (xpu, cpu, mps, cuda). "
                   "Put it where ComfyUI's 'Model Sparse Attention' node would go. vsa needs a "
                   "MiniMax-H3 FastH3 checkpoint; sol-attn and sla work on any model's self-attention. "
                   "Outside start/end_percent, dense_blocks and under min_tokens the attention "
                   "that was there before runs.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to patch."}),
                "method": (list(METHODS), {"default": "sol-attn", "tooltip": (
                    "sol-attn: training-free adaptive threshold (uses tau). sla: fixed fraction of key "
                    "blocks (uses keep_percent; for weights trained for it). vsa: FastVideo's video "
                    "sparse attention with the learned coarse gate (uses keep_percent; FastH3 only).")}),
                "tau": ("FLOAT", {"default": 1.3, "min": 0.0, "max": 4.0, "step": 0.05, "tooltip":
                                  "sol-attn only: threshold in score sigmas; higher is sparser."}),
                "keep_percent": ("FLOAT", {"default": 10.0, "min": 0.5, "max": 95.0, "step": 0.5, "tooltip":
                                           "sla / vsa: percent of key blocks (vsa: video cubes) each query "
                                           "block keeps. FastH3 was trained at 10."}),
                "start_percent": ("FLOAT", {"default": 0.2, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                            "Sampling progress where sparse attention begins."}),
                "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                          "Sampling progress where sparse attention ends."}),
            },
            "optional": {
                "dense_blocks": ("STRING", {"default": "", "tooltip":
                                            "Transformer blocks that always run dense, e.g. '0, 1, 47-49'; in models with two "
                                            "block families, 'double:0-2, single:5' (a bare index matches both)."}),
                "min_tokens": ("INT", {"default": DEFAULT_MIN_TOKENS, "min": 0, "max": 1 << 20, "step": 512,
                                       "tooltip": "Sequences shorter than this stay dense."}),
                "sink_conditioning": (list(SINK_MODES), {"default": "exact_kv_and_rows", "tooltip": (
                    "MiniMax-H3 with sol-attn / sla. exact_kv: every query attends the packed text / "
                    "audio / reference rows exactly. exact_kv_and_rows: also runs the target-audio "
                    "query rows dense. vsa always treats those rows as FastVideo does.")}),
                "vsa_prefix": (list(VSA_PREFIX_MODES), {"default": "exempt", "tooltip": (
                    "vsa only. exempt: conditioning key tiles are always attended on top of the video "
                    "top-k (FastVideo's default). compete: they compete in one top-k with the video cubes.")}),
            },
        }

    def patch(self, model, method, tau, keep_percent, start_percent, end_percent, dense_blocks="",
              min_tokens=DEFAULT_MIN_TOKENS, sink_conditioning="exact_kv_and_rows", vsa_prefix="exempt"):
        return (apply(model, method=method, tau=tau, keep_percent=keep_percent,
                      start_percent=start_percent, end_percent=end_percent, dense_blocks=dense_blocks,
                      min_tokens=min_tokens, sink_conditioning=sink_conditioning, vsa_prefix=vsa_prefix),)


NODE_CLASS_MAPPINGS = {NODE_ID: SolAttnModelSparseAttention}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: DISPLAY_NAME}
