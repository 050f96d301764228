"""The two-number model
--------------------

``N = B * T * H * D`` elements per tensor, ``e`` bytes per element, ``P`` = number of exact
(query block, key block) pairs = ``plan.kv_num_blocks.sum()``, ``K = P * 64 * D`` elements of
kept keys (and as many of values), ``n = ceil(T / 64)``.

FLOPs (two matmuls, 2 FLOPs per multiply-add; ragged last blocks counted as full; the tail's
one extra key per query block and the coarse branch, under 2 % at these sizes, not counted):

    dense  = 4 * B * H * T * T * D
    sparse = 4 * P * 64 * 64 * D

Bytes moved (a model of the traffic each path implies, not a measurement):

    dense    = e * 4N                       read q, k, v; write out
    sdpa     = e * (3N + 3N + 6K + 3N)      routing reads q, k, v once (block means);
                                            q rows: source read, gathered copy written, read back by SDPA;
                                            K and V of kept blocks: source read, gathered copy
                                            written, read back by SDPA (3 x 2K);
                                            out: SDPA writes it, the scatter reads it and writes out
    fused    = e * (3N + N + 2K + N)        any other backend (a block-index kernel, no gather):
                                            routing reads, q read, kept K/V read in place, out written

``K / N ~= kept_fraction * n``, so at long T the gather traffic (6K) dominates the portable
backend's bytes while the FLOPs shrink with the kept fraction: ``gflops`` (achieved GFLOP/s on
the counted FLOPs; the tables switch to TFLOP/s when a row reaches 1 TFLOP/s) and ``gbps``
(achieved GB/s on the modelled bytes), both over the whole call, routing plan included, say which
wall a row is closer to on the device at hand; subtract ``plan_ms`` for the backend alone.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..validation import BLOCK

Shape = Tuple[int, int, int, int]   # (B, T, H, D)

#: the byte models :func:`bytes_moved` knows
BYTE_MODELS = ("dense", "sdpa", "fused")


def flop_count(shape: Shape, kept_pairs: Optional[int]) -> float:
    """Dense (``kept_pairs is None``) ``4 B H T^2 D``, sparse ``4 P 64^2 D``."""
    B, T, H, D = shape
    if kept_pairs is None:
        return 4.0 * B * H * T * T * D
    return 4.0 * kept_pairs * BLOCK * BLOCK * D


def bytes_moved(shape: Shape, elt: int, kept_pairs: Optional[int], model: str) -> float:
    """Bytes moved under the model named ``model`` (``dense``, ``sdpa`` or ``fused``), with
    ``elt`` bytes per element; ``kept_pairs`` is unused by ``dense``."""
    if model not in BYTE_MODELS:
        raise ValueError(f"bytes_moved: argument 'model' received {model!r}; allowed: {BYTE_MODELS}")
    B, T, H, D = shape
    N = float(B * T * H * D)
    if model == "dense":
        return elt * 4 * N
    K = float(kept_pairs) * BLOCK * D
    if model == "sdpa":
        return elt * (3 * N + 3 * N + 6 * K + 3 * N)
    return elt * (3 * N + N + 2 * K + N)


def model_text() -> str:
    """This module's description of the models, as Markdown (for ``bench.md``)."""
    doc = __doc__ or ""
    title, _, body = doc.partition("\n--------------------\n")
    return f"## {title.strip()}\n\n{body.strip()}"
