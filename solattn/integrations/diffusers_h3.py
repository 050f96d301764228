"""FastH3 (FastVideo's VSA-trained MiniMax-H3) in diffusers; :mod:`.diffusers` is the front door
(:func:`~.diffusers.enable_vsa`, :func:`~.diffusers.disable`), FastWan lives in :mod:`.diffusers_wan`.

``enable_fasth3(transformer, gates)`` turns a loaded
``diffusers.MiniMaxH3Transformer3DModel`` into FastH3, on every device solattn runs on:

- each transformer block's attention gets its gate projection ``attn.to_gate_compress``, loaded
  from a state dict or safetensors files (:mod:`.diffusers_gates`);
- a forward pre-hook on the transformer reads the packed layout from the model's own arguments
  (``position_ids``, ``video_indices``, ``audio_indices``, ``text_indices``): the prefix
  segments are the runs of text / video / audio rows in packed order, the latent grid
  ``(t, h, w)`` after patching is the raster grid of the trailing video rows' ``position_ids``;
  it also reads the generated video's timestep to decide the schedule window;
- each block's processor then runs ``video_sparse_attn`` (FastVideo-H3 semantics: prefix
  segments in their own 64-row tiles, video in 4x4x4 cubes, ``prefix_mode``, the gate as is);
  outside the window, in ``dense_blocks`` and on calls it cannot serve, it hands the call to
  the processor that was there before, which uses the diffusers attention backend the user set.
  One log line per reason says why.

``solattn.integrations.diffusers.disable(transformer)`` restores the processors and removes the
hook (and the gates, unless kept), after which the model computes exactly what it computed before.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..validation import SUPPORTED_DTYPES
from ..op import video_sparse_attn
from . import diffusers_gates

log = logging.getLogger("solattn.diffusers")

STATE_ATTR = "_solattn_fasth3"
PREFIX_MODES = ("exempt", "compete")
#: MiniMaxH3Transformer3DModel.forward's parameters, in order (positional calls are mapped by them)
FORWARD_ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
                "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")
Grid = Tuple[int, int, int]


def _fail(arg: str, received, allowed: str, exc=ValueError):
    raise exc(f"enable_fasth3: argument '{arg}' received {received!r}; allowed: {allowed}")


def percent_to_sigma(percent: float, shift: float) -> float:
    """Sampling progress -> the flow sigma reached there, as ComfyUI's flow models map it:
    ``shift * s / (1 + (shift - 1) * s)`` with ``s = 1 - percent`` (0 -> 1.0, 1 -> 0.0)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    s = 1.0 - percent
    return shift * s / (1.0 + (shift - 1.0) * s)


def packed_layout(position_ids: torch.Tensor, video_indices: torch.Tensor, audio_indices: torch.Tensor,
                  text_indices: torch.Tensor):
    """``(grid, prefix segment lengths)`` of one packed MiniMax-H3 sequence, or a reason string.

    Every row belongs to exactly one of the index tensors; the runs of equal modality in packed
    order are the segments. The sequence must end with video rows (the generated video): their
    ``position_ids`` give the grid, ``(distinct t, distinct h, distinct w)``, and the last
    ``t * h * w`` of them must be exactly that grid in raster order. Video rows of the same run
    in front of those (conditioning frames packed right before the target) form a segment of
    their own. FastVideo's ``[text | conditioning | audio | video]`` packing gives its segments.
    """
    rows = position_ids.shape[0]
    kind = torch.full((rows,), -1, dtype=torch.int64)
    count = torch.zeros(rows, dtype=torch.int64)
    for code, index in enumerate((text_indices, video_indices, audio_indices)):
        index = index.detach().reshape(-1).to("cpu", torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
            return f"an index tensor points outside the {rows} packed rows"
        kind[index] = code
        count.index_add_(0, index, torch.ones_like(index))
    if rows == 0 or not bool((count == 1).all()):
        return "text_indices, video_indices and audio_indices do not cover every packed row exactly once"
    cuts = [0] + (torch.nonzero(kind[1:] != kind[:-1]).flatten() + 1).tolist() + [rows]
    runs = [(a, b, int(kind[a])) for a, b in zip(cuts[:-1], cuts[1:])]
    start, stop, last = runs[-1]
    if last != 1:
        return "the packed sequence does not end with video rows (the generated video)"
    pos = position_ids[start:stop].detach().to("cpu", torch.float64)
    axes = [torch.unique(pos[:, axis]) for axis in range(3)]
    grid = tuple(int(a.numel()) for a in axes)
    video = math.prod(grid)
    if video > stop - start or not torch.equal(pos[pos.shape[0] - video:], torch.cartesian_prod(*axes)):
        return (f"the trailing {stop - start} video rows' position_ids are not a (t, h, w) raster grid "
                f"(distinct values per axis {grid})")
    segments = [b - a for a, b, _ in runs[:-1]] + ([stop - start - video] if stop - start > video else [])
    return grid, tuple(segments)


class VsaState:
    """What every model's VSA state holds: the sparsity, the schedule window (in sigmas), the
    blocks kept dense, the processors replaced and gates added (for ``disable``), the pre-hook,
    and the reasons already logged. ``LABEL`` names the model in log lines."""

    LABEL = "VSA"

    def __init__(self, sparsity: float, sigma_start: float, sigma_end: float, dense_blocks: frozenset):
        self.sparsity = sparsity
        self.sigma_start = sigma_start
        self.sigma_end = sigma_end
        self.dense_blocks = dense_blocks
        self.originals: Dict[nn.Module, object] = {}   # attention module -> the processor it had
        self.added_gates = []                          # attention modules given a to_gate_compress
        self.hook = None
        self._logged = set()

    def note(self, key, message: str):
        """Log ``message`` once per ``key`` (one line per reason)."""
        if key not in self._logged:
            self._logged.add(key)
            log.info("%s: %s", self.LABEL, message)

    @property
    def whole_schedule(self) -> bool:
        return self.sigma_start >= 1.0 and self.sigma_end <= 0.0

    def clear(self) -> None:
        """Forget the current forward's layout (``disable``)."""

    def install(self, transformer, attns, tensors, processor, caller: str, zero_gate: str = ""):
        """Give each attention module its gate (``tensors[i]``, when given) and the processor
        ``processor(self, previous processor, i)``, hook the transformer's forward and record this
        state on it; without gates (given or already there) say once that only the fine stage runs."""
        for i, attn in enumerate(attns):
            if tensors is not None:
                attn.add_module(diffusers_gates.GATE_ATTR,
                                diffusers_gates.build_gate(attn, tensors[i], attn.to_q.weight, caller))
                self.added_gates.append(attn)
            self.originals[attn] = attn.processor
            attn.set_processor(processor(self, attn.processor, i))
        if tensors is None and getattr(attns[0], diffusers_gates.GATE_ATTR, None) is None:
            log.warning("%s: no gate projections (gates=None): VSA runs its sparse fine stage without the coarse "
                        "branch%s, which is not what %s was trained with", self.LABEL, zero_gate, self.LABEL)
        self.hook = transformer.register_forward_pre_hook(self.read_forward, with_kwargs=True)
        setattr(transformer, STATE_ATTR, self)
        return self


class FastH3(VsaState):
    """The settings and per-call state of one transformer running FastH3 (``enable_fasth3``'s
    result; also ``transformer._solattn_fasth3``). ``sparse`` is ``(grid, prefix segments)`` while
    the current forward runs sparse, else None; the pre-hook sets it before every forward."""

    LABEL = "FastH3"

    def __init__(self, sparsity: float, prefix_mode: str, sigma_start: float, sigma_end: float,
                 dense_blocks: frozenset):
        super().__init__(sparsity, sigma_start, sigma_end, dense_blocks)
        self.prefix_mode = prefix_mode
        self.sparse: Optional[Tuple[Grid, Tuple[int, ...]]] = None
        self._layout_key = None                        # (the index tensors, their versions), layout

    def clear(self) -> None:
        self.sparse = None


    def _layout(self, inputs) -> object:
        """:func:`packed_layout` of these inputs, cached while the same index tensors come back."""
        tensors = tuple(inputs[n] for n in ("position_ids", "video_indices", "audio_indices", "text_indices"))
        key = tuple((id(t), _version(t)) for t in tensors)
        if self._layout_key is not None and self._layout_key[0] == key and all(
                a is b for a, b in zip(self._layout_key[1], tensors)):
            return self._layout_key[2]
        layout = packed_layout(*tensors)
        self._layout_key = (key, tensors, layout)      # holds the tensors: their ids stay theirs
        return layout

    @torch.compiler.disable
    def read_forward(self, module, args, kwargs):
        """The transformer's forward pre-hook: decide sparse or dense for this forward (host side,
        outside any compiled graph)."""
        self.sparse = None
        inputs = dict(zip(FORWARD_ARGS, args))
        inputs.update((k, v) for k, v in kwargs.items() if k in FORWARD_ARGS)
        if any(inputs.get(n) is None for n in FORWARD_ARGS[3:]):
            self.note("args", "dense: the forward call lacks the packed-layout arguments")
            return None
        if not self.whole_schedule:
            timestep, rows = inputs["timestep"], inputs["timestep_indices"]
            sigma = 1.0 - float(timestep.reshape(-1)[rows.reshape(-1)[-1]])   # the generated video's
            if sigma > self.sigma_start or sigma < self.sigma_end:
                self.note("schedule",
                          f"dense: sigma {sigma:.4g} (timestep {1 - sigma:.4g}) is outside the sparse window "
                          f"[{self.sigma_end:.4g}, {self.sigma_start:.4g}]")
                return None
        layout = self._layout(inputs)
        if isinstance(layout, str):
            self.note(("layout", layout), f"dense: {layout}")
            return None
        self.sparse = layout
        grid, segments = layout
        self.note(("sparse", layout), f"vsa: grid {grid}, prefix segments {list(segments)} ({self.prefix_mode}), "
                                      f"sparsity {self.sparsity:g}"
                  + (f", blocks {sorted(self.dense_blocks)} dense" if self.dense_blocks else ""))
        return None


class FastH3Processor:
    """MiniMax-H3 attention processor running VSA through solattn while its ``FastH3`` says so,
    else the processor it replaced (``dense``). ``_attention_backend`` and ``_parallel_config``
    are the replaced processor's, so ``transformer.set_attention_backend`` reaches the dense path."""

    def __init__(self, state: FastH3, dense, block_index: int):
        self.state = state
        self.dense = dense
        self.block_index = block_index

    @property
    def _attention_backend(self):
        return getattr(self.dense, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, backend):
        self.dense._attention_backend = backend

    @property
    def _parallel_config(self):
        return getattr(self.dense, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, config):
        self.dense._parallel_config = config

    def __call__(self, attn, hidden_states: torch.Tensor, rotary_emb=None, attention_mask=None) -> torch.Tensor:
        state = self.state
        layout = state.sparse
        if layout is None or self.block_index in state.dense_blocks:
            return self.dense(attn, hidden_states, rotary_emb, attention_mask)
        reason = self._refusal(hidden_states, attention_mask)
        if reason is not None:
            _note(state, reason)
            return self.dense(attn, hidden_states, rotary_emb, attention_mask)
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = (x.unflatten(-1, (attn.heads, -1)) for x in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if rotary_emb is not None:
            query, key = _rotary(query, rotary_emb), _rotary(key, rotary_emb)
        projection = getattr(attn, diffusers_gates.GATE_ATTR, None)
        gate = None if projection is None else projection(hidden_states).unflatten(-1, (attn.heads, -1))
        grid, segments = layout
        out = video_sparse_attn(query, key, value, grid, sparsity=state.sparsity, gate=gate,
                                prefix_len=list(segments), prefix_mode=state.prefix_mode)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _refusal(self, hidden_states: torch.Tensor, attention_mask) -> Optional[str]:
        if attention_mask is not None:
            return "dense: an attention_mask was passed (VSA takes none)"
        if self._parallel_config is not None:
            return "dense: context parallelism shards the sequence (VSA needs the whole packed sequence)"
        if hidden_states.dtype not in SUPPORTED_DTYPES:
            return f"dense: dtype {hidden_states.dtype} (solattn runs {', '.join(map(str, SUPPORTED_DTYPES))})"
        return None


def _version(t: torch.Tensor):
    """The tensor's version counter (None for inference-mode tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


@torch.compiler.disable
def _note(state: VsaState, message: str):
    """``state.note`` keyed by the message, outside any compiled graph (processors call it)."""
    state.note(message, message)


def _rotary(x: torch.Tensor, rotary_emb) -> torch.Tensor:
    """diffusers' own MiniMax-H3 rotary embedding (so the sparse path ropes as the dense one does)."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb
    return _apply_rotary_emb(x, *rotary_emb)


def _check_settings(sparsity, prefix_mode, start_percent, end_percent, shift, dense_blocks, num_blocks):
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or not 0.0 <= sparsity <= 1.0:
        _fail("sparsity", sparsity, "a number 0 <= sparsity <= 1 (the skipped fraction of video cubes; "
                                    "FastH3 was trained at 0.9)")
    if prefix_mode not in PREFIX_MODES:
        _fail("prefix_mode", prefix_mode, f"one of {PREFIX_MODES}")
    for name, value in (("start_percent", start_percent), ("end_percent", end_percent)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
            _fail(name, value, "a number 0 <= percent <= 1 (sampling progress)")
    if start_percent > end_percent:
        _fail("start_percent", start_percent, f"a value <= end_percent ({end_percent})")
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or not shift > 0:
        _fail("shift", shift, "a positive number (the video schedule's flow shift; MiniMax-H3 uses 12)")
    blocks = list(dense_blocks) if isinstance(dense_blocks, Iterable) else None
    if blocks is None or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in blocks):
        _fail("dense_blocks", dense_blocks, "an iterable of transformer block indices", TypeError)
    if any(not 0 <= b < num_blocks for b in blocks):
        _fail("dense_blocks", dense_blocks, f"block indices in [0, {num_blocks})")
    return frozenset(int(b) for b in blocks)


def _transformer_blocks(transformer) -> Sequence[nn.Module]:
    blocks = getattr(transformer, "transformer_blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks else None
    if attn is None or not hasattr(attn, "set_processor") or not hasattr(attn, "processor"):
        _fail("transformer", type(transformer).__name__,
              "a diffusers MiniMaxH3Transformer3DModel (transformer_blocks[i].attn with set_processor)")
    if getattr(transformer, STATE_ATTR, None) is not None:
        raise RuntimeError("enable_fasth3: FastH3 is already enabled on this transformer; call "
                           "solattn.integrations.diffusers.disable(transformer) first to change its settings")
    return blocks


def enable_fasth3(transformer, gates, *, sparsity: float = 0.9, prefix_mode: str = "exempt",
                  start_percent: float = 0.0, end_percent: float = 1.0, shift: float = 12.0,
                  dense_blocks: Iterable[int] = ()) -> FastH3:
    """Run a diffusers ``MiniMaxH3Transformer3DModel`` as FastH3 (VSA attention through solattn).

    Args:
        transformer: the loaded transformer (e.g. ``pipe.transformer``), changed in place (a
            ``torch.compile``'d one: the module it wraps). Call this before diffusers' group
            offloading; model and sequential CPU offload may come before or after.
        gates: the gate projections ``to_gate_compress``: a state dict, a safetensors file, a
            folder of them (the FastH3 ``transformer`` folder, or the pipeline folder holding
            it) or a list of files; diffusers (``transformer_blocks.{i}``) or ComfyUI
            (``blocks.{i}``) naming, any prefix. A checkpoint without them is refused, naming
            the missing keys. ``None``: no coarse branch (the sparse fine stage only), or the
            model's own ``to_gate_compress`` layers when it already has them.
        sparsity: the skipped fraction of video cubes; ``ceil((1 - sparsity) * n_video)`` cubes
            are kept per query tile (FastVideo's rule). 0.9 keeps 10 %, as FastH3 was trained.
        prefix_mode: ``"exempt"`` (every conditioning tile is attended on top of the kept
            cubes, FastVideo's default) or ``"compete"``.
        start_percent, end_percent: the part of sampling that runs sparse, as in ComfyUI's
            node: a forward is sparse while its video sigma (``1 - timestep`` of the generated
            video rows) lies in ``[percent_to_sigma(end), percent_to_sigma(start)]``.
        shift: the video schedule's flow shift used to map percents to sigmas (12 for H3).
        dense_blocks: transformer block indices that always run dense.

    Returns:
        The :class:`FastH3` state (also stored as ``transformer._solattn_fasth3``).
    """
    transformer = getattr(transformer, "_orig_mod", transformer)      # a torch.compile'd model's module
    blocks = _transformer_blocks(transformer)
    frozen = _check_settings(sparsity, prefix_mode, start_percent, end_percent, shift, dense_blocks, len(blocks))
    attns = [block.attn for block in blocks]
    hidden, inner = attns[0].to_q.in_features, attns[0].to_q.out_features
    tensors = None
    if gates is not None:
        diffusers_gates.refuse_group_offload(transformer)
        tensors = diffusers_gates.checked_gates(gates, len(blocks), hidden, inner)   # refuses before any change
    state = FastH3(float(sparsity), prefix_mode, percent_to_sigma(float(start_percent), float(shift)),
                   percent_to_sigma(float(end_percent), float(shift)), frozen)
    for i, attn in enumerate(attns):
        if tensors is not None:
            if getattr(attn, diffusers_gates.GATE_ATTR, None) is not None:
                raise RuntimeError(f"enable_fasth3: transformer_blocks.{i}.attn already has a "
                                   f"{diffusers_gates.GATE_ATTR}; pass gates=None to use it")
    return state.install(transformer, attns, tensors, FastH3Processor, "enable_fasth3")
