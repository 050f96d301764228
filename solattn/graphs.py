"""Opt-in CUDA-graph replay for small, launch-bound ``sol_attn`` and ``video_sparse_attn`` calls.

A small attention call is host bound: Python, validation, planning and four Triton
launches can take several times longer on the CPU than the kernels take on the GPU.
Captured once in a :class:`torch.cuda.CUDAGraph`, the same work replays with one
launch and a few microseconds of host time. Inside a :func:`cuda_graphs` block,
eligible calls go through a :class:`GraphCache`:

    import torch, solattn
    from solattn.graphs import cuda_graphs

    q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad(), cuda_graphs(max_graphs=8) as cache:
        for step in range(10):
            q.normal_()                      # new contents, same addresses: the graph still applies
            out = solattn.sol_attn(q, k, v, topk_ratio=0.1)
    print(cache.stats)                       # eager_calls=1 captures=1 replays=8 ...

The same mechanism, without the wiring, on any function of CUDA tensors:

    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    cache = GraphCache()
    for _ in range(3):
        out = cache.run(lambda: (a @ b).softmax(-1), (a, b), extra="matmul-softmax")

When it helps: problems whose GPU time is small next to the per-call host time (short
sequences, few heads, small batches, many layers), called repeatedly with inputs kept at
the same addresses, e.g. static buffers of an inference loop. Large problems are GPU
bound and gain nothing.

Constraints:

* A graph is keyed by every input's address, shape, strides, dtype and device, the
  caller's ``extra`` (the non-tensor arguments), the current CUDA stream and the tuning in
  force (:func:`solattn.config.tuning_key`: a call under other launch settings captures anew). It replays
  whatever memory sits at those addresses, so new *contents* hit the cache, new
  *tensors* (fresh allocations) usually miss it. Every tensor ``fn`` reads must be in
  ``tensors`` and every other value that changes its work must be in ``extra``.
* The first ``capture_after - 1`` sightings of a key run eagerly (the first call also
  compiles Triton kernels, which must not happen during a capture); the
  ``capture_after``-th warms up once on a side stream, captures and replays.
* Each graph holds its intermediate buffers and its output in a private memory pool,
  about one call's working memory, until evicted (at most ``max_graphs`` graphs,
  least recently used first) or :meth:`GraphCache.clear`.
* The returned tensor is a clone of the graph's static output (the next replay
  overwrites that buffer): one device copy of the output per call.
* No autograd: a call with grad enabled and an input that requires grad runs eagerly.
* A function that cannot be captured (a host sync such as ``.item()``, a CPU<->GPU copy)
  is reported once by a warning and runs eagerly from then on for that key. In ``sol_attn``
  and ``video_sparse_attn`` that is every call whose routing plan is not the fused one (the ``sdpa`` backend, or a
  problem outside ``solattn.routing.fused.fused_plan_usable``, e.g. over its memory budget).
* Thread safety: one lock per cache covers its bookkeeping, captures and replays (a
  replay is a few microseconds); eager calls run outside it. Captures are serialised
  process-wide, as CUDA graph capture requires.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import inspect
import threading
import warnings
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from .compiling import tracing
from .config import graph_recording, recording_graph, tuning_key

__all__ = ["cuda_graphs", "active_cache", "GraphCache", "GraphStats"]

Tensor = torch.Tensor

_ACTIVE: contextvars.ContextVar[Optional["GraphCache"]] = contextvars.ContextVar(
    "solattn_graph_cache", default=None)

# torch.cuda.graph allows one capture at a time per process.
_CAPTURE_LOCK = threading.Lock()

# CUDAGraph objects whose capture ended abnormally. Their allocator filters refer to the
# object, so they are kept alive rather than freed under a filter that may still be called.
_ABANDONED: List[object] = []

_UNCAPTURABLE = object()


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"argument '{name}' received {value!r} ({type(value).__name__}); "
                        "allowed: an int >= 1")
    if value < 1:
        raise ValueError(f"argument '{name}' received {value!r}; allowed: an int >= 1")
    return value


@dataclasses.dataclass
class GraphStats:
    """Counters of a :class:`GraphCache`. Every call is counted once, in ``eager_calls``,
    ``captures`` (the call that captured a graph and answered from its first replay) or
    ``replays`` (a call answered by an existing graph). ``failures``: captures that raised
    (their calls ran eagerly and count in ``eager_calls`` too). ``evictions``: graphs
    dropped to stay within ``max_graphs``."""

    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    failures: int = 0
    evictions: int = 0


class _Entry:
    __slots__ = ("replay", "static_out")

    def __init__(self, replay: Callable[[], None], static_out: Tensor):
        self.replay, self.static_out = replay, static_out


class _Suspended:
    """No cache is active while the cache itself runs ``fn``: a wired ``sol_attn`` inside
    ``fn`` then takes its plain path instead of re-entering the cache. ``recording``: the run
    is the warm-up or the capture of a graph (see :func:`recording`)."""

    def __init__(self, recording: bool = False):
        self.recording = recording

    def __enter__(self):
        self._token = _ACTIVE.set(None)
        self._recording = recording_graph(self.recording)
        self._recording.__enter__()

    def __exit__(self, *exc):
        self._recording.__exit__(*exc)
        _ACTIVE.reset(self._token)


def _graph_kwargs() -> Dict[str, object]:
    try:
        params = inspect.signature(torch.cuda.graph.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return {}
    # thread_local: only this thread's unsafe CUDA calls invalidate the capture, so other
    # threads keep running eagerly meanwhile.
    return {"capture_error_mode": "thread_local"} if "capture_error_mode" in params else {}


class GraphCache:
    """Captures and replays CUDA graphs of callables, keyed by their inputs' addresses.

    Args:
        max_graphs: the most captured graphs kept (least recently used evicted first).
        capture_after: the sighting of a key that captures it (earlier ones run eagerly).
            ``1`` captures at once (after one warm-up run on a side stream).
    """

    def __init__(self, max_graphs: int = 8, capture_after: int = 2):
        self.max_graphs = _check_count(max_graphs, "max_graphs")
        self.capture_after = _check_count(capture_after, "capture_after")
        self._lock = threading.RLock()
        self._graphs: "collections.OrderedDict[Hashable, _Entry]" = collections.OrderedDict()
        # Sightings of keys not (yet) captured, or _UNCAPTURABLE; bounded so that inputs at
        # ever-changing addresses do not grow it without limit.
        self._seen: "collections.OrderedDict[Hashable, object]" = collections.OrderedDict()
        self._max_seen = 4 * self.max_graphs
        self._warned: set = set()
        self._stats = GraphStats()

    # ---- public -------------------------------------------------------------------------
    @property
    def stats(self) -> GraphStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (releasing their memory pools) and every sighting; the
        counters in :attr:`stats` are kept."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()

    def run(self, fn: Callable[[], Tensor], tensors: Sequence[Optional[Tensor]],
            extra: Hashable) -> Tensor:
        """``fn()``, eagerly or from a graph captured for this key.

        Args:
            fn: takes no arguments, returns one tensor; launches GPU work only on the
                current stream and does no host synchronisation (else it stays eager).
            tensors: every tensor ``fn`` reads (``None`` entries allowed).
            extra: a hashable value standing for everything else that changes ``fn``'s work.
        """
        if not callable(fn):
            raise TypeError(f"argument 'fn' received {fn!r}; allowed: a callable taking no arguments")
        tensors = tuple(tensors)
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"argument 'tensors' received {type(t).__name__} at index {i}; "
                                "allowed: torch.Tensor or None")
        try:
            hash(extra)
        except TypeError:
            raise TypeError(f"argument 'extra' received {extra!r} ({type(extra).__name__}); "
                            "allowed: a hashable value") from None

        if not self._eligible(tensors):
            return self._eager(fn)
        key = (self._context_key(tensors), extra, tuning_key(), tuple(
            None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
            for t in tensors))

        with self._lock:
            entry = self._graphs.get(key)
            if entry is not None:
                self._graphs.move_to_end(key)
                self._stats.replays += 1
                entry.replay()
                return entry.static_out.clone()
            state = self._seen.pop(key, 0)
            if state is not _UNCAPTURABLE and state + 1 >= self.capture_after:
                out = self._capture_and_replay(key, fn)
                if out is not None:
                    return out
            else:
                self._remember(key, state if state is _UNCAPTURABLE else state + 1)
        return self._eager(fn)

    def _capture_and_replay(self, key: Hashable, fn: Callable[[], Tensor]) -> Optional[Tensor]:
        """Warm up, capture, store and replay ``key``'s graph (the cache lock is held);
        None when the capture failed (the key is then marked uncapturable)."""
        with _CAPTURE_LOCK, _Suspended(recording=True):
            out = self._warmup(fn)
            if not isinstance(out, Tensor):
                raise TypeError(f"argument 'fn' returned {type(out).__name__}; allowed: "
                                "a function returning one torch.Tensor")
            del out
            try:
                replay, static_out = self._capture(fn)
            except Exception as exc:  # noqa: BLE001 - any capture error falls back to eager
                reason = _describe(exc)
            else:
                reason = None
        if reason is not None:
            self._stats.failures += 1
            self._remember(key, _UNCAPTURABLE)
            if reason not in self._warned:
                self._warned.add(reason)
                warnings.warn(f"solattn.graphs: capturing a CUDA graph failed ({reason}); "
                              "calls with these inputs run eagerly from now on",
                              RuntimeWarning, stacklevel=3)
            return None
        self._graphs[key] = _Entry(replay, static_out)
        self._stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self._stats.evictions += 1
        replay()
        return static_out.clone()

    # ---- mechanics (overridable) ----------------------------------------------------------
    def _eligible(self, tensors: Tuple[Optional[Tensor], ...]) -> bool:
        """Graphs apply to CUDA tensors on the current device, outside another capture and
        outside autograd."""
        present = [t for t in tensors if t is not None]
        if tracing():  # traced (fake) tensors have no addresses to key by
            return False
        if not present or not self._devices_ok(present):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in present):
            return False
        return not self._capturing()

    def _devices_ok(self, present: List[Tensor]) -> bool:
        if not torch.cuda.is_available():
            return False
        device = torch.cuda.current_device()
        return all(t.device.type == "cuda" and t.device.index == device for t in present)

    def _capturing(self) -> bool:
        """Someone else is capturing on this stream: their graph would swallow ours."""
        return torch.cuda.is_current_stream_capturing()

    def _context_key(self, tensors: Tuple[Optional[Tensor], ...]) -> Hashable:
        """The current device and stream: a graph replays on the stream it is keyed by."""
        stream = torch.cuda.current_stream()
        return (stream.device.index, stream.cuda_stream)

    def _warmup(self, fn: Callable[[], Tensor]):
        """One run on a side stream before capture, as torch's CUDA-graph notes ask (lazy
        initialisation, autotuning and allocator warm-up stay out of the graph)."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = fn()
        current.wait_stream(side)
        return out

    def _capture(self, fn: Callable[[], Tensor]) -> Tuple[Callable[[], None], Tensor]:
        """Capture ``fn`` into a new graph; returns (replay, static output)."""
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(), **_graph_kwargs()):
                static_out = fn()
        except BaseException:
            _recover(graph, pool, before)
            raise
        return graph.replay, static_out

    def _eager(self, fn: Callable[[], Tensor]) -> Tensor:
        with self._lock:
            self._stats.eager_calls += 1
        with _Suspended():
            return fn()

    def _remember(self, key: Hashable, state: object) -> None:
        self._seen[key] = state
        while len(self._seen) > self._max_seen:
            self._seen.popitem(last=False)


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of the error, and of the one it interrupted: an invalidated
    capture fails again in ``capture_end``, which hides the call that broke it."""
    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"
    cause = exc.__cause__ or exc.__context__
    return line(exc) if cause is None else f"{line(exc)}; raised while handling {line(cause)}"


def _recover(graph, pool, before) -> None:
    """Leave the process usable after a capture raised.

    ``torch.cuda.graph.__exit__`` ends the capture and then restores the stream, but when
    the capture was invalidated (e.g. a host sync inside it) ``capture_end`` itself raises:
    the stream context is not exited and the allocator keeps routing to the graph's pool.
    A capture that ended cleanly (the error came from ``fn`` without invalidating it) needs
    nothing: the stream is back and the graph's destructor releases its pool."""
    if torch.cuda.current_stream() == before:
        return
    torch.cuda.set_stream(before)
    _ABANDONED.append(graph)
    device = before.device.index
    _reset_generator(device)
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except Exception:  # noqa: BLE001 - the capture never began allocating to the pool
        return
    try:
        torch._C._cuda_releasePool(device, pool)
    except Exception:  # noqa: BLE001 - best effort; the pool's blocks then stay reserved
        pass


def _reset_generator(device: int) -> None:
    """The capture's epilogue never ran, so the device's default RNG state still believes it is
    being captured, and every later random op on the device fails ("Offset increment outside
    graph capture"). A clone of the state (same seed and offset) is not capturing: swap it in."""
    try:
        gen = torch.cuda.default_generators[device]
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, IndexError, RuntimeError):  # a torch without graph-safe states
        pass


class _Scope:
    def __init__(self, cache: GraphCache):
        self.cache = cache
        self._tokens: List[contextvars.Token] = []

    def __enter__(self) -> GraphCache:
        self._tokens.append(_ACTIVE.set(self.cache))
        return self.cache

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())


def cuda_graphs(max_graphs: Optional[int] = None, capture_after: Optional[int] = None, *,
                cache: Optional[GraphCache] = None) -> _Scope:
    """Context manager: eligible ``sol_attn`` and ``video_sparse_attn`` calls inside the block go through a
    :class:`GraphCache` (yielded by ``with``). A new cache by default (``max_graphs=8``,
    ``capture_after=2``), or ``cache=`` an existing one to keep its graphs across blocks.
    The scope covers the thread or asyncio task that entered it; nested blocks: the inner
    cache applies, the outer one again after it."""
    if cache is not None:
        if not isinstance(cache, GraphCache):
            raise TypeError(f"argument 'cache' received {type(cache).__name__}; "
                            "allowed: a solattn.graphs.GraphCache or None")
        if max_graphs is not None or capture_after is not None:
            raise ValueError(f"arguments 'max_graphs'={max_graphs!r} and 'capture_after'="
                             f"{capture_after!r} given with 'cache'; allowed: either an existing "
                             "cache or the settings of a new one")
        return _Scope(cache)
    return _Scope(GraphCache(8 if max_graphs is None else max_graphs,
                             2 if capture_after is None else capture_after))


def recording() -> bool:
    """True while a :class:`GraphCache` warms up and captures a call in this thread / task
    (:func:`solattn.config.graph_recording`, where the backends read it)."""
    return graph_recording()


def active_cache() -> Optional[GraphCache]:
    """The innermost active :class:`GraphCache` of this thread / task, or None."""
    return _ACTIVE.get()
