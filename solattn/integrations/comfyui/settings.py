"""The node's choices: names, defaults, parsing and checks (no ComfyUI imports)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

from ... import validation

NODE_ID = "SolAttnModelSparseAttention"
DISPLAY_NAME = "Model Sparse Attention (solattn)"
#: what a user picks; "auto" resolves to one of RUN_METHODS when the node is applied
METHODS = ("auto", "sol-attn", "sla", "vsa")
RUN_METHODS = ("sol-attn", "sla", "vsa")
SINK_MODES = ("exact_kv_and_rows", "exact_kv", "off")
VSA_PREFIX_MODES = ("exempt", "compete")
DEFAULT_MIN_TOKENS = 12288


def fail(arg: str, received, allowed: str, exc=ValueError):
    """solattn's refusal message, naming the node: the argument, what it received, what is allowed."""
    validation.fail(DISPLAY_NAME, arg, repr(received), allowed, exc)


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
        fail("dense_blocks", text, allowed, TypeError)
    blocks = set()
    # spaces around a dash or after a colon belong to the entry; any other comma / space separates
    for piece in re.split(r"[,\s]+", re.sub(r"\s*:\s*", ":", re.sub(r"\s*-\s*", "-", text.strip()))):
        if not piece:
            continue
        m = re.fullmatch(r"(?:([A-Za-z_]+):)?(\d+)(?:-(\d+))?", piece)
        if m is None:
            fail("dense_blocks", text, allowed)
        kind = None if m.group(1) is None else m.group(1).lower()
        a = int(m.group(2))
        b = a if m.group(3) is None else int(m.group(3))
        blocks.update((kind, i) for i in range(min(a, b), max(a, b) + 1))
    return frozenset(blocks)


def check_percent(name: str, value) -> float:
    """A schedule position ``0 <= value <= 1`` (ComfyUI's start_percent / end_percent)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        fail(name, value, "a number 0 <= percent <= 1")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """The node's choices, checked. ``sigma_start >= sigma_end`` bound the sparse window;
    ``start_percent`` / ``end_percent`` are the same window as the user gave it (for messages)."""

    method: str = "sol-attn"
    tau: float = 1.3
    keep_percent: float = 10.0
    sigma_start: float = math.inf
    sigma_end: float = 0.0
    min_tokens: int = DEFAULT_MIN_TOKENS
    dense_blocks: FrozenSet[BlockKey] = frozenset()   # parse_block_list's; plain ints: any type
    sink_conditioning: str = "exact_kv_and_rows"
    vsa_prefix: str = "exempt"
    start_percent: float = 0.0
    end_percent: float = 1.0
    verbose: bool = True

    def __post_init__(self):
        if self.method not in RUN_METHODS:
            fail("method", self.method, f"one of {RUN_METHODS}")
        for name in ("tau", "keep_percent", "sigma_start", "sigma_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                fail(name, value, "a number", TypeError)
        if not math.isfinite(self.tau):
            fail("tau", self.tau, "a finite number")
        if not 0.0 < self.keep_percent < 100.0:
            fail("keep_percent", self.keep_percent, "a percentage 0 < keep_percent < 100")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral):
            fail("min_tokens", self.min_tokens, "an int >= 0", TypeError)
        if self.min_tokens < 0:
            fail("min_tokens", self.min_tokens, "an int >= 0")
        if self.sink_conditioning not in SINK_MODES:
            fail("sink_conditioning", self.sink_conditioning, f"one of {SINK_MODES}")
        if self.vsa_prefix not in VSA_PREFIX_MODES:
            fail("vsa_prefix", self.vsa_prefix, f"one of {VSA_PREFIX_MODES}")
        check_percent("start_percent", self.start_percent)
        check_percent("end_percent", self.end_percent)
        if not isinstance(self.verbose, bool):
            fail("verbose", self.verbose, "True or False", TypeError)
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
