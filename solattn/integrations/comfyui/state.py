"""Per-model state of the node and the decisions both attention paths share: the schedule window
(sigma read once per model step), the token minimum, ``dense_blocks``, MiniMax-H3's conditioning
sinks, solattn's refusals, and the log-once memory."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

import torch

from ... import dispatch
from ...validation import BLOCK
from .settings import DISPLAY_NAME, Settings

log = logging.getLogger("solattn.comfyui")


def video_segment(layout) -> Optional[Tuple[int, int]]:
    """``(start, stop)`` of a packed H3 layout's single video segment, or None."""
    videos = [(a, b) for a, b, kind in layout.segments if kind == "video"]
    return videos[0] if len(videos) == 1 else None


def refusal(check: Callable) -> Optional[str]:
    """The message of solattn's argument check, or None when the call is valid."""
    try:
        check()
    except (TypeError, ValueError) as err:
        return str(err)
    return None


class SparseAttention:
    """Options plus per-run state of one patched model (the log-once memory, reset at cleanup).

    ``h3_blocks``: the MiniMax-H3 model's blocks when the model is one (their attention modules
    carry the checkpoint's own attention choice, ``comfy_attention``, which dense calls keep)."""

    def __init__(self, settings: Settings, patch_size: Sequence[int] = (1, 2, 2), h3_blocks=None):
        self.settings = settings
        self.patch_size = tuple(int(p) for p in patch_size)
        self.h3_blocks = h3_blocks
        self._logged = set()
        self._sigma = None       # (sigmas tensor, its version or None, its first sigma): see first_sigma

    # -- bookkeeping ------------------------------------------------------------------------
    def reset(self):
        self._logged.clear()
        self._sigma = None

    def new_step(self):
        """Forget the step's sigma (called before every model step)."""
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

    def note(self, key, message: str, always: bool = False):
        """Log ``message`` once per ``key`` until the next :meth:`reset` (one line per reason);
        per-call lines only when the node's ``verbose`` is on, ``always`` lines in any case."""
        if key not in self._logged and (always or self.settings.verbose):
            self._logged.add(key)
            log.info("%s: %s", DISPLAY_NAME, message)

    def preferred_attention(self, transformer_options):
        """The checkpoint's own attention choice of the H3 block this call belongs to, or None."""
        index = transformer_options.get("block_index")
        if self.h3_blocks is None or not isinstance(index, int) or not 0 <= index < len(self.h3_blocks):
            return None
        return getattr(self.h3_blocks[index].attn, "comfy_attention", None)

    # -- decisions shared by both paths -----------------------------------------------------
    def dense_reason(self, transformer_options, tokens: int, block_index) -> Optional[Tuple[object, str]]:
        """``(log key, message)`` when this call stays dense whatever its tensors are, else None."""
        s = self.settings
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = self.first_sigma(sigmas)
            if sigma > s.sigma_start or sigma < s.sigma_end:
                return "schedule", (
                    f"dense: sigma {sigma:.4g} is outside the start/end window: start_percent "
                    f"{s.start_percent:g} .. end_percent {s.end_percent:g} = sigma {s.sigma_start:.4g} .. "
                    f"{s.sigma_end:.4g}")
        if tokens < s.min_tokens:
            return ("min_tokens", tokens), f"dense: {tokens} tokens < min_tokens {s.min_tokens}"
        if s.dense_blocks:
            if block_index is None:
                # without the index no call can be matched to a block: say so instead of
                # silently running the listed blocks sparse
                self.note("no_block_index", "dense_blocks has no effect: this model's attention calls "
                                            "carry no transformer_options['block_index'] (update ComfyUI)",
                          always=True)
            else:
                i, kind = int(block_index), transformer_options.get("block_type")
                if (None, i) in s.dense_blocks or (kind is not None and (str(kind).lower(), i) in s.dense_blocks):
                    label = f"{kind}:{i}" if kind is not None else str(i)
                    return ("dense_blocks", label), f"dense: block {label} is in dense_blocks"
                if kind is None and any(t is not None for t, _ in s.dense_blocks):
                    self.note("no_block_type", "dense_blocks entries with a block type have no effect: this "
                                               "model's attention calls carry no transformer_options['block_type']",
                              always=True)
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
        video = video_segment(layout)
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
        refused = refusal(check)
        if refused is None:
            try:
                return run()
            except dispatch.BackendError as err:
                refused = str(err).splitlines()[0]
        self.note(("refused", refused), f"dense: solattn refuses {tuple(qs.shape)} "
                                        f"{qs.dtype} on {qs.device}: {refused}")
        return None
