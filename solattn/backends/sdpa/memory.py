"""The one memory model of the portable backend: bytes a chunk of query blocks takes, and how
many query blocks fit in a budget.

Everything the backend allocates beyond inputs, output and the routing plan is a per-call table
of O(T) (:func:`fixed_bytes`), the contiguous key and value (in inference also query, then
output) block layouts of a run of (batch, head) pairs (:func:`layout_bytes`, sized by :func:`pairs_per_layout`) or part of a chunk
(:func:`chunk_bytes`); the forward sizes every chunk with :func:`rows_per_chunk`, so nothing
else needs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...validation import BLOCK

#: key rows appended for the pooled tail: one live row (the centroid as key, the tail's mean value
#: as value, its log-weight as mask entry) padded to a multiple of 16, which fused GPU kernels prefer for
#: the mask's last dimension
TAIL_ROWS = 16

#: On the CPU, chunks are kept small (and reused) so that they stay in cache and in the
#: allocator's heap: fresh multi-hundred-MB allocations each page-fault on first touch, which
#: costs more than the gather itself (0.6 s vs 0.06 s for a 512 MB gather on a 2-core CPU).
CHUNK_CAP = {"cpu": 32 << 20}

_INDEX = 8      # int64 row numbers


@dataclass(frozen=True)
class ChunkShape:
    """What one SDPA call of a group looks like, per query block."""

    q_rows: int          # query rows (64, or fewer for the ragged last block)
    key_blocks: int      # exact key blocks c
    D: int
    elt: int             # bytes per input element
    mask_elt: int        # bytes per mask element (0: no mask)
    tail: bool           # the tail column is on
    blocks: bool = False  # k, v gathered as whole blocks from layouts (the tail: one whole block)
    row_mask: bool = True  # with the tail: the mask holds one row per query row (else one per block)
    packed_kv: bool = False  # SDPA may repack k and v into a copy of their own (see chunk_bytes)

    @property
    def keys(self) -> int:
        return self.key_blocks * BLOCK + (TAIL_ROWS if self.tail else 0)

    @property
    def gathered_keys(self) -> int:
        """Key rows the k and v gathers hold (a whole zero block for the tail from layouts)."""
        return (self.key_blocks + 1) * BLOCK if self.tail and self.blocks else self.keys


def chunk_bytes(rows: int, s: ChunkShape) -> int:
    """Peak bytes of one chunk of ``rows`` query blocks of shape ``s``.

    Per query block: gathered q, k, v and their int64 row (or block) numbers; SDPA's output
    (query blocks as heads: row-major per query row across blocks) and its copy in block order,
    its fp32 accumulators; the scores a math-fallback kernel materialises; with a mask, the
    fp32 mask and its copy in the mask dtype (one row per query block, or one per query row
    where the tail's per-row residual matters, plus the tail's fp32 query copy and row logits).
    ``packed_kv``: PyTorch's CPU flash kernel repacks bf16/fp16 keys and values for the matrix
    units (AMX) when the CPU has them, a whole copy of the gathered k and v per call.
    """
    Lq, keys, D = s.q_rows, s.keys, s.D
    index_rows = Lq + (2 * (s.key_blocks + 1) if s.blocks else 2 * keys)
    per = (Lq * D * s.elt * 3                 # gathered q, SDPA output (heads), its copy in block order
           + 2 * s.gathered_keys * D * s.elt  # gathered k, v
           + 2 * index_rows * _INDEX          # row numbers and their temporaries
           + Lq * D * 4                       # fp32 accumulators inside SDPA
           + Lq * keys * 4)                      # scores of a math-fallback kernel
    if s.packed_kv:
        per += 2 * s.gathered_keys * D * s.elt
    if s.mask_elt:
        per_row = s.tail and s.row_mask
        mask_rows = Lq if per_row else 1
        per += mask_rows * keys * (4 * 2 + s.mask_elt)       # fp32 mask, re-centred copy, cast
        if per_row:
            per += Lq * D * 4 + Lq * 4 * 2                # fp32 queries for q . m, tail logits
    return rows * per


def slice_bytes_per_row(s: ChunkShape) -> int:
    """Bytes per query block of the index tables the forward builds for many chunks at once:
    q and output row numbers (plus the temporaries of computing them), key block numbers twice
    (the selection and the layout's numbering), (b, h, i, row), the dead-row flags and, with the
    tail, the rows' centroid, tail value, tail_lse and residual."""
    tail = s.D * (4 + s.elt) + 2 * 4 if s.tail else 0
    return 3 * s.q_rows * _INDEX + 2 * (s.key_blocks + 1) * _INDEX + 4 * _INDEX + s.q_rows + tail


def fixed_bytes(B: int, T: int, H: int, n: int, bias_rows: int, masked: bool, tail: bool = False) -> int:
    """Per-call tables outside the chunks: the key-slot bias table (and its masked copy), the
    row offsets of every (block, slot) of q, k, v and the output, group bookkeeping per query
    block (keys, masks, row numbers) and, with the tail, the residual's mean, spread and flag
    per query block."""
    table = 2 * bias_rows * n * BLOCK * 4 if masked else 0
    residual = B * H * n * (4 * 2 + 1) if tail else 0
    return table + residual + 4 * n * BLOCK * _INDEX + B * H * n * 8 * 4


def floor_bytes(B: int, T: int, H: int, D: int, tail: bool, coarse: bool, bias_rows: int, masked: bool,
                width: int = 3) -> int:
    """The least working memory a call takes whatever its budget (beyond inputs and output): the
    routing plan's fp32 block means of q, k and v and its outputs (counts, index lists at least
    ``width`` wide, the tail's value and log-weight, the coarse term), and this backend's per-call
    tables (:func:`fixed_bytes`). It grows as B H T: at B=1, T=262144, D=64 with the tail, about
    25 MiB at H=4, 33 at H=6, 59 at H=12, 110 at H=24. A budget below it is refused (the
    backend's reasons say so); at or above it a call's working memory, plan included, stays
    within the budget times 1.25 plus :data:`BUDGET_SLACK`."""
    n = -(-T // BLOCK)
    pairs = B * H * n
    plan = 3 * pairs * D * 4 + pairs * (4 + 4 * min(n, width) + 1)    # block means; counts, lists, flags
    if tail:
        plan += pairs * (D + 1) * 4                                     # tail value and log-weight
    if coarse:
        plan += pairs * D * 4
    return plan + fixed_bytes(B, T, H, n, bias_rows, masked, tail)


#: what a call may take beyond 1.25 times its budget (a budget at least :func:`floor_bytes`):
#: allocator and library scratch that no chunk size bounds (SDPA's per-thread buffers, freed heap
#: not yet returned). Measured at T=262144, H=4, D=64, bf16, top-k 0.1 % on a 2-core CPU (resident
#: peak of the whole call): 34-36 MiB at a 26 MiB budget (the floor), 38-62 MiB at 32 MiB, 40-52 MiB
#: at 64 MiB; H=24: 122 MiB at 128 MiB
BUDGET_SLACK = 32 << 20


def residual_token_bytes(B: int, H: int, D: int) -> int:
    """Bytes per token of the tail-residual pass: q's fp32 copy and the copy the batched dot may
    make of it, then the residuals and their masked and centred temporaries (fp32)."""
    return B * H * (2 * D * 4 + 8 * 4)


def residual_tokens(budget: int, B: int, H: int, D: int, device: torch.device) -> int:
    """Tokens per step of the tail-residual pass (a multiple of 64, at least 64)."""
    budget = min(budget, CHUNK_CAP.get(device.type, budget))
    return max(1, budget // residual_token_bytes(B, H, D) // BLOCK) * BLOCK


def layout_bytes(pairs: int, n: int, D: int, elt: int, tables: int = 2) -> int:
    """The block layouts of ``pairs`` (batch, head) pairs, plus their zero blocks: ``tables`` of
    them (2: keys and values; 3 in inference, where the queries are laid out too, then overwritten
    by the output), and with the queries the int64 row numbers that gather them and the output
    (with their temporaries)."""
    return tables * BLOCK * D * elt + pairs * _pair_layout_bytes(n, D, elt, tables)


def _pair_layout_bytes(n: int, D: int, elt: int, tables: int) -> int:
    rows = 3 * n * BLOCK * _INDEX if tables > 2 else 0
    return tables * n * BLOCK * D * elt + rows


def pairs_per_layout(budget: int, pairs: int, n: int, D: int, elt: int, tables: int = 2) -> int:
    """(batch, head) pairs whose ``tables`` layouts (see :func:`layout_bytes`) take at most half
    of ``budget`` (the other half is for the chunks' gathers); 0 when not even one pair fits,
    and the backend then gathers rows straight from the inputs."""
    half = budget // 2
    if layout_bytes(1, n, D, elt, tables) > half:
        return 0
    return min(pairs, max(1, (half - tables * BLOCK * D * elt) // _pair_layout_bytes(n, D, elt, tables)))


def packs_kv(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA on ``device`` may keep a repacked copy of reduced-precision keys and values
    (the CPU flash kernel does on CPUs with AMX; counting it everywhere on the CPU keeps the
    model an upper bound whatever the CPU)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def rows_per_chunk(budget: int, s: ChunkShape, device: torch.device) -> int:
    """Query blocks per SDPA call: as many as fit in ``budget``, at least one. On the CPU the
    chunk is also capped (:data:`CHUNK_CAP`, a speed limit: the cap counts what the backend
    itself gathers, not SDPA's repacked copy, which the budget does count)."""
    rows = budget // chunk_bytes(1, s)
    cap = CHUNK_CAP.get(device.type)
    if cap is not None:
        rows = min(rows, cap // chunk_bytes(1, replace(s, packed_kv=False)))
    return max(1, rows)
