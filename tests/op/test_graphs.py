"""solattn.graphs: the CUDA-graph replay cache.

CPU tests drive the real key handling, policy, LRU and failure logic through a subclass
whose capture is a recording fake: its "graph" re-runs ``fn`` into a static output
buffer on replay, as a real graph rewrites its static output, so clone-versus-alias and
in-place input changes are observable. CUDA tests (``-k cuda``) capture real graphs.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings

import pytest
import torch

from solattn.graphs import GraphCache, _Suspended, active_cache, cuda_graphs
from solattn.testing import rel_l2

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
HAS_TRITON = importlib.util.find_spec("triton") is not None


class FakeCache(GraphCache):
    """Real bookkeeping; capture and replay replaced by a recorder that accepts CPU tensors."""

    def __init__(self, *args, fail=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []
        self.fail = fail

    def _devices_ok(self, present):
        return True

    def _capturing(self):
        return False

    def _context_key(self, tensors):
        return "stream-0"

    def _warmup(self, fn):
        self.log.append("warmup")
        return fn()

    def _capture(self, fn):
        self.log.append("capture")
        if self.fail is not None:
            raise self.fail
        static = fn()

        def replay():  # a real graph runs no Python: fn sees no active cache here either
            self.log.append("replay")
            with _Suspended():
                static.copy_(fn())
        return replay, static


class Counted:
    """fn for the cache: ``a * 2 + b`` that counts its runs."""

    def __init__(self, a, b=None):
        self.a, self.b, self.calls = a, b, 0

    def __call__(self):
        self.calls += 1
        return self.a * 2 + (0 if self.b is None else self.b)


def test_policy_eager_until_capture_after_then_replay():
    a = torch.arange(6.0)
    fn, cache = Counted(a), FakeCache(capture_after=3)
    for i in range(2):
        assert torch.equal(cache.run(fn, (a,), "k"), a * 2)
        assert cache.log == [] and fn.calls == i + 1
    out = cache.run(fn, (a,), "k")                       # third sighting: warm up, capture, replay
    assert cache.log == ["warmup", "capture", "replay"] and torch.equal(out, a * 2)
    for _ in range(2):
        assert torch.equal(cache.run(fn, (a,), "k"), a * 2)
    assert cache.log == ["warmup", "capture", "replay", "replay", "replay"]
    s = cache.stats
    assert (s.eager_calls, s.captures, s.replays, s.failures, s.evictions) == (2, 1, 2, 0, 0)
    assert len(cache) == 1


def test_capture_after_one_captures_on_first_call():
    a = torch.ones(3)
    cache = FakeCache(capture_after=1)
    cache.run(Counted(a), (a,), None)
    assert cache.log == ["warmup", "capture", "replay"] and cache.stats.eager_calls == 0


def test_replay_reads_the_inputs_current_contents():
    a = torch.ones(4)
    fn, cache = Counted(a), FakeCache(capture_after=1)
    cache.run(fn, (a,), "k")
    a.fill_(5.0)                                         # same address, new contents: a hit
    assert torch.equal(cache.run(fn, (a,), "k"), torch.full((4,), 10.0))
    assert cache.stats.replays == 1


def test_each_key_component_makes_a_new_key():
    base = torch.arange(16.0).reshape(4, 4)
    other = base.clone()
    cache = FakeCache(capture_after=2)
    variants = [
        ((base,), "x"),
        ((other,), "x"),                                 # another address
        ((base.view(16),), "x"),                         # same address, another shape
        ((base.t(),), "x"),                              # same address and shape, other strides
        ((base.view(torch.int32),), "x"),                # same address, shape, strides: dtype
        ((base[1:],), "x"),                              # storage offset -> another address
        ((base,), "y"),                                  # extra
        ((base, None), "x"),                             # one more (absent) input
        ((None, base), "x"),                             # position of the absent input
    ]
    for tensors, extra in variants:                      # first sightings: all eager
        cache.run(lambda: torch.zeros(1), tensors, extra)
    assert cache.log == [] and cache.stats.eager_calls == len(variants)
    for tensors, extra in variants:                      # second sightings: one capture each
        cache.run(lambda: torch.zeros(1), tensors, extra)
    assert cache.stats.captures == cache.log.count("capture") == len(variants)
    assert len(cache) == 8 and cache.stats.evictions == len(variants) - 8   # max_graphs=8


def test_the_tuning_in_force_is_part_of_the_key():
    """A call under other launch settings (solattn.config.tuning) captures its own graph: the
    graph of the default settings replays only where they are in force."""
    from solattn.backends.triton import TritonTuning
    from solattn.config import tuning
    a = torch.ones(3)
    cache = FakeCache(capture_after=1)
    cache.run(Counted(a), (a,), "k")
    with tuning(TritonTuning(tma_min_programs=0)):
        cache.run(Counted(a), (a,), "k")
        cache.run(Counted(a), (a,), "k")
    cache.run(Counted(a), (a,), "k")
    s = cache.stats
    assert (s.captures, s.replays, len(cache)) == (2, 2, 2)


def test_lru_eviction_drops_the_least_recently_used_graph():
    xs = [torch.full((2,), float(i)) for i in range(3)]
    fns = [Counted(x) for x in xs]
    cache = FakeCache(max_graphs=2, capture_after=1)

    def call(i):
        before = cache.log.count("capture")
        out = cache.run(fns[i], (xs[i],), i)
        assert torch.equal(out, xs[i] * 2)
        return cache.log.count("capture") > before     # True: this call captured

    assert call(0) and call(1)
    assert not call(0)                                   # replay: 0 is now the most recent
    assert call(2) and cache.stats.evictions == 1        # evicts 1, the least recently used
    assert not call(0) and not call(2)                   # both still held
    assert call(1) and cache.stats.evictions == 2        # 1 was gone: captured again, evicts 0
    assert call(0)
    assert len(cache) == 2 and cache.stats.evictions == 3


def test_sighting_table_is_bounded():
    # max_graphs=1 keeps at most 4 uncaptured keys; a key pushed out starts counting again.
    def sightings_then_probe(n_others):
        cache = FakeCache(max_graphs=1, capture_after=2)
        a = torch.ones(1)
        others = [torch.ones(1) for _ in range(n_others)]
        cache.run(lambda: a, (a,), "probe")
        for t in others:
            cache.run(lambda: t, (t,), "other")
        cache.run(lambda: a, (a,), "probe")
        return cache.stats.captures

    assert sightings_then_probe(3) == 1                  # remembered: second sighting captures
    assert sightings_then_probe(4) == 0                  # forgotten: counted as a first sighting


def test_failed_capture_marks_key_uncapturable_and_warns_once():
    a = torch.arange(3.0)
    fn = Counted(a)
    cache = FakeCache(capture_after=1, fail=RuntimeError("operation not permitted when stream is capturing"))
    with pytest.warns(RuntimeWarning, match="RuntimeError: operation not permitted when stream is capturing"):
        out = cache.run(fn, (a,), "k")
    assert torch.equal(out, a * 2)                       # answered eagerly
    assert cache.log == ["warmup", "capture"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):                               # no retry, no second warning
            assert torch.equal(cache.run(fn, (a,), "k"), a * 2)
        b = torch.ones(2)
        cache.run(Counted(b), (b,), "k")                 # another key, same reason: counted, silent
    assert cache.log == ["warmup", "capture", "warmup", "capture"]
    s = cache.stats
    assert (s.failures, s.eager_calls, s.captures, s.replays) == (2, 5, 0, 0)


def test_failure_warning_names_the_error_the_capture_end_hid():
    # an invalidated capture raises again when it ends; the warning names the first error too
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nhint")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as chained:
        error = chained
    a = torch.ones(1)
    cache = FakeCache(capture_after=1, fail=error)
    with pytest.warns(RuntimeWarning) as caught:
        cache.run(lambda: a + 1, (a,), "k")
    message = str(caught[0].message)
    assert ("RuntimeError: CUDA error: operation failed due to a previous error during capture; "
            "raised while handling RuntimeError: CUDA error: operation not permitted when stream "
            "is capturing)") in message and "hint" not in message


def test_returned_outputs_are_clones_of_the_static_output():
    a = torch.ones(3)
    fn, cache = Counted(a), FakeCache(capture_after=1)
    outs = [cache.run(fn, (a,), "k")]                    # the capturing call
    for value in (2.0, 3.0):
        a.fill_(value)
        outs.append(cache.run(fn, (a,), "k"))            # replays
    assert len({o.data_ptr() for o in outs}) == 3
    for o, want in zip(outs, (2.0, 4.0, 6.0)):           # later replays left earlier results alone
        assert torch.equal(o, torch.full((3,), want))
    outs[2].mul_(0.0)                                    # the caller's tensor is its own
    later = cache.run(fn, (a,), "k")
    assert torch.equal(later, torch.full((3,), 6.0)) and later.data_ptr() != outs[2].data_ptr()


def test_warmup_result_must_be_a_tensor():
    a = torch.ones(1)
    cache = FakeCache(capture_after=1)
    with pytest.raises(TypeError, match="'fn' returned tuple"):
        cache.run(lambda: (a, a), (a,), "k")


def test_grad_enabled_inputs_requiring_grad_run_eagerly():
    a = torch.ones(3, requires_grad=True)
    cache = FakeCache(capture_after=1)
    for _ in range(3):
        cache.run(lambda: a * 2, (a,), "k")
    assert cache.log == [] and cache.stats.eager_calls == 3
    with torch.no_grad():
        cache.run(lambda: a * 2, (a,), "k")
    assert cache.stats.captures == 1


def test_cpu_tensors_bypass_the_real_cache():
    a = torch.ones(3)
    fn, cache = Counted(a), GraphCache(capture_after=1)
    for _ in range(3):
        assert torch.equal(cache.run(fn, (a,), "k"), a * 2)
    assert fn.calls == 3 and len(cache) == 0
    s = cache.stats
    assert (s.eager_calls, s.captures, s.replays, s.failures) == (3, 0, 0, 0)
    cache.run(fn, (None,), "k")                          # no tensor at all: eager too
    assert cache.stats.eager_calls == 4


def test_clear_drops_graphs_and_sightings_keeps_stats():
    a = torch.ones(2)
    cache = FakeCache(capture_after=2)
    for _ in range(3):
        cache.run(lambda: a + 1, (a,), "k")
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.stats.captures == 1
    cache.run(lambda: a + 1, (a,), "k")                  # a first sighting again
    assert cache.stats.eager_calls == 2 and cache.log.count("capture") == 1


def test_argument_validation():
    for kw, exc, msg in [
        (dict(max_graphs=0), ValueError, r"'max_graphs' received 0; allowed: an int >= 1"),
        (dict(max_graphs=-3), ValueError, r"'max_graphs' received -3"),
        (dict(max_graphs=2.0), TypeError, r"'max_graphs' received 2.0 \(float\)"),
        (dict(max_graphs=True), TypeError, r"'max_graphs' received True \(bool\)"),
        (dict(capture_after=0), ValueError, r"'capture_after' received 0; allowed: an int >= 1"),
        (dict(capture_after="2"), TypeError, r"'capture_after' received '2' \(str\)"),
    ]:
        with pytest.raises(exc, match=msg):
            GraphCache(**kw)
        with pytest.raises(exc, match=msg):
            cuda_graphs(**kw)                            # raised at the call, before any `with`
    with pytest.raises(TypeError, match="'cache' received dict"):
        cuda_graphs(cache={})
    with pytest.raises(ValueError, match="'max_graphs'=4 .* given with 'cache'"):
        cuda_graphs(max_graphs=4, cache=GraphCache())
    cache, a = GraphCache(), torch.ones(1)
    with pytest.raises(TypeError, match="'fn' received 3"):
        cache.run(3, (a,), "k")
    with pytest.raises(TypeError, match="'tensors' received list at index 1"):
        cache.run(lambda: a, (a, [1]), "k")
    with pytest.raises(TypeError, match=r"'extra' received \[1\] \(list\)"):
        cache.run(lambda: a, (a,), [1])
    assert cache.stats.eager_calls == 0                  # nothing ran


def test_context_nesting_restores_the_outer_cache():
    assert active_cache() is None
    kept = GraphCache(max_graphs=3)
    with cuda_graphs(max_graphs=2) as outer:
        assert active_cache() is outer and outer.max_graphs == 2 and outer.capture_after == 2
        with cuda_graphs(cache=kept) as inner:
            assert inner is kept and active_cache() is kept
        assert active_cache() is outer
        seen = []
        t = threading.Thread(target=lambda: seen.append(active_cache()))
        t.start()
        t.join()
        assert seen == [None]                            # the scope binds this thread only
    assert active_cache() is None
    scope = cuda_graphs(cache=kept)                      # one scope object entered twice, nested
    with scope:
        with scope:
            assert active_cache() is kept
        assert active_cache() is kept
    assert active_cache() is None


def test_no_cache_is_active_inside_fn():
    a = torch.ones(1)
    seen = []

    def fn():
        seen.append(active_cache())
        return a + 1

    with cuda_graphs(capture_after=1) as cache:
        fake = FakeCache(capture_after=2)
        fake.run(fn, (a,), "k")                          # eager
        fake.run(fn, (a,), "k")                          # warm-up, capture, replay
        cache.run(fn, (a,), "k")                         # the real cache's eager (CPU) path
        assert active_cache() is cache
    assert seen == [None] * 5


# ---- CUDA: real graphs ---------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_matches_eager_after_inplace_changes():
    torch.manual_seed(0)
    a = torch.randn(96, 80, device="cuda")
    b = torch.randn(80, 64, device="cuda")
    cache = GraphCache(capture_after=2)

    def fn():
        return (a @ b).softmax(-1)

    outs = []
    for step in range(5):
        a.copy_(torch.randn_like(a))
        got = cache.run(fn, (a, b), "mm")
        want = fn()
        # cuBLAS may pick another kernel on another stream: equal up to fp32 rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"step {step}")
        outs.append(got)
    s = cache.stats
    assert (s.eager_calls, s.captures, s.replays, s.failures) == (1, 1, 3, 0)
    assert not torch.equal(outs[-1], outs[-2])           # contents changed, and so did the result


@pytest.mark.gpu
@needs_cuda
def test_cuda_host_sync_fails_capture_warns_and_stays_usable():
    x = torch.arange(8.0, device="cuda")
    cache = GraphCache(capture_after=2)
    stream = torch.cuda.current_stream()
    fn = lambda: x * x.sum().item()  # noqa: E731 - a host sync inside the captured function
    cache.run(fn, (x,), "sync")
    with pytest.warns(RuntimeWarning, match="capturing a CUDA graph failed") as caught:
        out = cache.run(fn, (x,), "sync")
    assert torch.equal(out, x * 28.0)
    print(caught[0].message)                             # the reason, for the record (-s)
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    x.fill_(1.0)
    assert torch.equal(cache.run(fn, (x,), "sync"), torch.full((8,), 8.0, device="cuda"))
    s = cache.stats
    assert (s.failures, s.captures, s.eager_calls) == (1, 0, 3)
    y = torch.randn(32, 32, device="cuda")               # random ops work (the RNG state is not left capturing)
    # and later captures still work
    for _ in range(3):
        assert torch.equal(cache.run(lambda: y @ y, (y,), "mm"), y @ y)
    assert cache.stats.captures == 1 and cache.stats.replays == 1


@pytest.mark.gpu
@needs_cuda
def test_cuda_clear_releases_graph_memory():
    a = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    cache = GraphCache(capture_after=1)
    for _ in range(2):
        out = cache.run(lambda: (a * 3).relu() + 1, (a,), "k")   # no cuBLAS: no workspace
    del out
    assert torch.cuda.memory_allocated() > base          # the static output lives in the graph's pool
    cache.clear()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_sol_attn_triton_replay_matches_eager():
    import solattn

    torch.manual_seed(0)
    shape = (1, 1000, 2, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def fn():
        return solattn.sol_attn(q, k, v, topk_ratio=0.1, tail=False, backend="triton")

    cache = GraphCache(capture_after=2)
    with torch.no_grad():
        for step in range(4):
            q.copy_(torch.randn_like(q))
            got = cache.run(fn, (q, k, v), ("t",))
            want = fn()
            assert torch.equal(got, want) or rel_l2(got, want) < 1e-6, f"step {step}"
    s = cache.stats
    assert (s.eager_calls, s.captures, s.replays, s.failures) == (1, 1, 2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sol_attn_inside_cuda_graphs_scope_replays():
    """The wiring: plain no-grad ``sol_attn`` calls inside ``cuda_graphs()`` capture once and then
    replay, each output equal to an eager call on the inputs' current contents; a call that needs
    autograd, or one with another argument, is not served by the same graph."""
    pytest.importorskip("triton")
    import solattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1000, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(topk_ratio=0.1, tail=False, backend="triton")
    with torch.no_grad():
        with cuda_graphs() as cache:
            outs = []
            for step in range(4):
                q.normal_()
                outs.append((solattn.sol_attn(q, k, v, **kw), q.clone()))
            other = solattn.sol_attn(q, k, v, **dict(kw, topk_ratio=0.3))   # a new key: eager
        for got, q_then in outs:
            want = solattn.sol_attn(q_then, k, v, **kw)
            assert torch.equal(got, want) or rel_l2(got, want) < 1e-6
        assert torch.equal(other, solattn.sol_attn(q, k, v, **dict(kw, topk_ratio=0.3)))
    s = cache.stats
    assert (s.captures, s.replays, s.failures) == (1, 2, 0)
    assert s.eager_calls == 2
    with cuda_graphs() as cache2:                              # grad needed: never through the cache
        qg = q.clone().requires_grad_(True)
        solattn.sol_attn(qg, k, v, **kw).float().sum().backward()
        assert qg.grad is not None and cache2.stats.captures == cache2.stats.replays == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_graphs_replay_reads_a_bool_key_bias_changed_in_place():
    """Validation turns a bool ``key_bias`` into a new float tensor: inside ``cuda_graphs()`` that
    conversion must be part of the captured work, reading the caller's mask. A graph that kept the
    float tensor made at capture would replay a stale (or freed) mask after the caller changes
    theirs in place."""
    import solattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1000, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(1000, dtype=torch.bool, device="cuda")
    kw = dict(topk_ratio=0.3, tail=False, backend="triton", key_bias=mask)
    with torch.no_grad():
        with cuda_graphs(capture_after=1) as cache:
            outs, held = [], []
            for step in range(4):
                mask.copy_(torch.rand(1000, device="cuda") < 0.7)
                outs.append((solattn.sol_attn(q, k, v, **kw), mask.clone()))
                # take freed blocks of the converted mask's size: a stale read would see NaN
                held.extend(torch.full((1000,), float("nan"), device="cuda") for _ in range(8))
        for step, (got, mask_then) in enumerate(outs):
            want = solattn.sol_attn(q, k, v, **dict(kw, key_bias=mask_then))
            assert torch.equal(got, want) or rel_l2(got, want) < 1e-6, f"step {step}"
        assert not torch.equal(outs[-1][0], outs[-2][0])
    s = cache.stats
    assert s.captures == 1 and s.replays == 3 and s.failures == 0


def test_recording_is_true_exactly_while_a_graph_is_warmed_up_and_captured():
    from solattn.graphs import recording
    a = torch.arange(4.0)
    seen = []

    def fn():
        seen.append(recording())
        return a * 2

    cache = FakeCache(capture_after=2)
    assert not recording()
    for _ in range(3):
        cache.run(fn, (a,), "k")
    # eager (first sighting), warm-up, capture; the fake's replay re-runs fn outside a recording,
    # like the eager calls
    assert seen[:3] == [False, True, True] and not any(seen[3:]) and not recording()
    assert cache.log[:2] == ["warmup", "capture"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_small_problems_take_tma_loads_only_when_recorded(monkeypatch):
    # the config the launcher picks (run_kernel intercepted: nothing runs): pointer loads below
    # tma_min_programs eagerly, TMA loads inside a graph's warm-up and capture, unless turned off
    from solattn.backends.triton import backend as tb
    from solattn.config import tuning
    from solattn.validation import validate
    picked = []
    monkeypatch.setattr(tb, "run_kernel", lambda problem, plan, cfg, *a, **k: picked.append(cfg.tma))
    q = torch.randn(1, 300, 2, 64)
    problem = validate(q, q, q, topk_ratio=0.3)
    assert problem.B * problem.H * problem.n < tb.TritonTuning().tma_min_programs
    tb.launch(problem, None)
    with _Suspended(recording=True):
        tb.launch(problem, None)
        with tuning(tb.TritonTuning(tma_in_graphs=False)):
            tb.launch(problem, None)
    with tuning(tb.TritonTuning(tma_min_programs=0)):
        tb.launch(problem, None)
    assert picked == [False, True, False, True]


# --------------------------------------------------------------------------- video_sparse_attn

def _vsa_inputs(device="cpu", dtype=torch.float32, prefix=70, grid=(4, 8, 8)):
    g = torch.Generator().manual_seed(0)
    T = prefix + grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, T, 2, 16 if device == "cpu" else 64, generator=g).to(device, dtype) for _ in range(3))
    return q, k, v, torch.rand(q.shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("variant", [dict(topk=3), dict(scale=0.3), dict(prefix_mode="compete"),
                                     dict(gate=0.5), dict(gate=None)])
def test_video_sparse_attn_goes_through_the_active_cache_keyed_by_every_argument(monkeypatch, variant):
    """Plain no-grad ``video_sparse_attn`` calls reach the cache with their inputs and the layout's
    tables as tensors: the same call captures, then replays on the inputs' current contents; a call
    that differs in any other argument is a new key (a replay of the first graph would return the
    first call's work, not this one's), and a call that needs autograd stays out of the cache.
    (On a CPU the cache is a recording fake, as above: the device check of the wiring is bypassed.)"""
    import solattn
    from solattn.op import custom

    cache, sightings = FakeCache(capture_after=2), []

    def through_cache(fn, device, key):
        tensors, extra = key()
        sightings.append(len(tensors))
        return cache.run(fn, tensors, tuple(tuple(x) if isinstance(x, list) else x for x in extra))

    q, k, v, gate = _vsa_inputs()
    base = dict(topk=2, gate=gate, prefix_len=70, backend="sdpa")
    monkeypatch.setattr(custom, "eager_call", through_cache)
    with torch.no_grad():
        outs = []
        for _ in range(4):
            q.normal_()
            gate.uniform_()
            outs.append((solattn.video_sparse_attn(q, k, v, (4, 8, 8), **base), q.clone(), gate.clone()))
        other = solattn.video_sparse_attn(q, k, v, (4, 8, 8), **dict(base, **variant))
    assert cache.log == ["warmup", "capture", "replay", "replay", "replay"]
    assert (cache.stats.eager_calls, cache.stats.captures, cache.stats.replays) == (2, 1, 2)
    assert sightings == [10] * 5     # q, k, v, key_bias and block_len (None), gate, the layout's four tables
    qg = q.clone().requires_grad_(True)
    solattn.video_sparse_attn(qg, k, v, (4, 8, 8), **base).sum().backward()
    assert len(sightings) == 5 and qg.grad is not None
    monkeypatch.undo()
    with torch.no_grad():
        for got, q_then, gate_then in outs:
            want = solattn.video_sparse_attn(q_then, k, v, (4, 8, 8), **dict(base, gate=gate_then))
            assert torch.equal(got, want)
        assert torch.equal(other, solattn.video_sparse_attn(q, k, v, (4, 8, 8), **dict(base, **variant)))
        assert not torch.equal(other, outs[-1][0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_video_sparse_attn_inside_cuda_graphs_scope_replays():
    """``video_sparse_attn`` on the triton backend (the fused plan: no host syncs) inside
    ``cuda_graphs()``: captured once, replayed, each output equal to an eager call on the inputs'
    current contents; another top-k is a new key."""
    import solattn

    q, k, v, gate = _vsa_inputs("cuda", torch.bfloat16, prefix=70, grid=(8, 16, 16))
    kw = dict(topk=4, gate=gate, prefix_len=70, backend="triton")
    with torch.no_grad():
        with cuda_graphs() as cache:
            outs = []
            for _ in range(4):
                q.normal_()
                gate.uniform_()
                outs.append((solattn.video_sparse_attn(q, k, v, (8, 16, 16), **kw), q.clone(), gate.clone()))
            other = solattn.video_sparse_attn(q, k, v, (8, 16, 16), **dict(kw, topk=9))
        for got, q_then, gate_then in outs:
            want = solattn.video_sparse_attn(q_then, k, v, (8, 16, 16), **dict(kw, gate=gate_then))
            assert torch.equal(got, want) or rel_l2(got, want) < 1e-6
        want = solattn.video_sparse_attn(q, k, v, (8, 16, 16), **dict(kw, topk=9))
        assert torch.equal(other, want) or rel_l2(other, want) < 1e-6
    s = cache.stats
    assert (s.captures, s.replays, s.failures, s.eager_calls) == (1, 2, 0, 2)
