"""The ``sdpa`` backend's settings in force (:func:`solattn.config.tuning`), as a value.

    from solattn.backends.sdpa import SdpaTuning
    from solattn.config import tuning
    with tuning(SdpaTuning(query_rows=32)):        # only the calls inside the block
        out = solattn.sol_attn(q, k, v, topk_ratio=0.1, backend="sdpa")
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import Tuning
from ...validation import BLOCK


def _fail(name: str, value, allowed: str, kind=ValueError):
    raise kind(f"SdpaTuning: argument '{name}' received {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class SdpaTuning(Tuning):
    """How the ``sdpa`` backend issues its work; results do not depend on it beyond rounding.

    - ``query_rows``: query rows per item of an SDPA call (a divisor of 64). A 64-row query block
      becomes ``64 / query_rows`` items (as heads) that share its gathered keys and values
      through a stride-0 view, not a copy. PyTorch's CPU flash kernel repacks a call's bf16/fp16
      keys and values for the matrix units (AMX) only when an item has 64 query rows or more:
      32 skips that whole copy of the keys and values per call and runs the products unpacked.
      Kernels off the CPU may copy a stride-0 view: keep 64 there.
    - ``parallel_bytes`` / ``parallel_flops``: on the CPU the forward runs with one intra-op
      thread, and only copies of at least ``parallel_bytes`` and SDPA calls of at least
      ``parallel_flops`` run with the caller's threads (see :mod:`.forward`). The default, 0 and
      0, gives them all the caller's threads: on quiet CPUs that is the faster policy (B=1
      T=8192 H=16 D=128 bf16 top-k 10 % on 16 AMX cores: 155 ms against 252 ms with one
      thread for the smaller ops, dense SDPA 204 ms; on 2 AVX2 cores 5.45x / 3.26x against
      5.06x / 2.83x dense at top-k 10 % / 20 %). Where other processes keep the cores busy,
      every parallel region waits for its descheduled workers, and ``parallel_bytes=16 << 20,
      parallel_flops=1 << 26`` (ops of about 2 ms or more on one thread) is faster: 5.17x
      against 3.00x dense there on the loaded 2-core CPU.
    - ``chunk_threads``: the small per-chunk passes (a chunk's output written back over its
      queries, the mask of a chunk with the tail or a key bias: each well under a millisecond on
      one thread) take the caller's threads only where it has at least this many (and they reach
      ``parallel_bytes``). Left on one thread they were the largest one-threaded stretch of a
      call on a 16-core AMX Xeon (the output copies: 4.8 ms of a 97 ms call at B=1 T=8192 H=16
      D=128 bf16 top-k 10 %); on a 2-core CPU that other processes keep busy, each parallel
      region a chunk adds waits for descheduled workers (~8 ms each).
    """

    query_rows: int = BLOCK
    parallel_bytes: int = 0
    parallel_flops: int = 0
    chunk_threads: int = 4

    def __post_init__(self):
        for name in ("query_rows", "parallel_bytes", "parallel_flops", "chunk_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(name, value, "an int", TypeError)
        if self.query_rows < 1 or BLOCK % self.query_rows:
            _fail("query_rows", self.query_rows, f"a divisor of {BLOCK} (1, 2, 4, 8, 16, 32 or 64)")
        for name in ("parallel_bytes", "parallel_flops"):
            if getattr(self, name) < 0:
                _fail(name, getattr(self, name), "an int >= 0")
        if self.chunk_threads < 1:
            _fail("chunk_threads", self.chunk_threads, "an int >= 1")
