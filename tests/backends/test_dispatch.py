"""Backend selection: priorities, forcing, the context manager, the environment variable, errors."""

from __future__ import annotations


import dataclasses

import pytest
import torch

import solattn
from solattn.validation import validate
from solattn import devices, dispatch
from solattn.backends import reference as refmod
from solattn.testing import make_qkv


def test_use_backend_names_its_own_argument():
    with pytest.raises(ValueError, match=r"use_backend: argument 'name' received 'nope'; allowed: one of \["):
        with solattn.use_backend("nope"):
            pass


@pytest.mark.parametrize("device", ["nodevice", "cuda:x", 3.5])
def test_list_backends_refuses_what_is_not_a_device(device):
    with pytest.raises((ValueError, TypeError), match=r"list_backends: argument 'device' received "):
        solattn.list_backends(device)


def test_backends_listing():
    infos = solattn.list_backends("cpu")
    names = [i["name"] for i in infos]
    assert {"reference", "sdpa"} <= set(names)
    for i in infos:
        assert set(i) >= {"name", "available", "reasons", "priority", "description"}
        assert i["available"] == (not i["reasons"])
    by = {i["name"]: i for i in infos}
    assert by["sdpa"]["available"] and by["sdpa"]["priority"] == 0
    assert by["reference"]["available"]


def test_auto_picks_first_in_priority_and_explicit_beats_it():
    q, k, v = make_qkv(1, 100, 2, 8)
    p = validate(q, k, v)
    assert dispatch.choose(p).name == dispatch.priority("cpu")[0] == "sdpa"
    assert dispatch.choose(p, "reference").name == "reference"
    with solattn.use_backend("reference") as b:
        assert b.name == "reference"
        assert dispatch.choose(p).name == "reference"
        assert dispatch.choose(p, "sdpa").name == "sdpa"   # the argument beats the context
    assert dispatch.choose(p).name == "sdpa"


def test_use_backend_runs_that_backend(monkeypatch):
    seen = []
    orig = refmod.ReferenceBackend.forward
    monkeypatch.setattr(refmod.ReferenceBackend, "forward",
                        lambda self, p, plan=None: seen.append(1) or orig(self, p, plan))
    q, k, v = make_qkv(1, 100, 2, 8)
    with solattn.use_backend("reference"):
        solattn.sol_attn(q, k, v)
    assert seen


def test_forced_backend_that_cannot_run_raises_with_reasons(monkeypatch):
    monkeypatch.setattr(refmod.budget, "_value", 1024)
    q, k, v = make_qkv(1, 100, 2, 8)
    with pytest.raises(solattn.BackendError, match=r"backend 'reference' cannot run.*budget.*can: sdpa"):
        solattn.sol_attn(q, k, v, backend="reference")
    with solattn.use_backend("reference"):
        with pytest.raises(solattn.BackendError, match="reference"):
            solattn.sol_attn(q, k, v)


def test_nothing_can_run_lists_every_backend(monkeypatch):
    monkeypatch.setattr(refmod.budget, "_value", 1024)
    q, k, v = make_qkv(1, 100, 2, 8)
    p = validate(q, k, v)
    monkeypatch.setitem(devices.DEVICES, "cpu", dataclasses.replace(devices.DEVICES["cpu"], priority=("reference",)))
    with pytest.raises(solattn.BackendError) as ei:
        dispatch.choose(p)
    msg = str(ei.value)
    for name in dispatch.registered():
        assert f"  {name}:" in msg


def test_env_preference_and_fallback_warning(monkeypatch):
    q, k, v = make_qkv(1, 100, 2, 8)
    p = validate(q, k, v)
    monkeypatch.setenv("SOLATTN_BACKEND", "reference")
    assert dispatch.choose(p).name == "reference"
    monkeypatch.setattr(refmod.budget, "_value", 1024)
    with pytest.warns(RuntimeWarning, match="SOLATTN_BACKEND=reference cannot run"):
        assert dispatch.choose(p).name == "sdpa"
    monkeypatch.setenv("SOLATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match="environment variable SOLATTN_BACKEND received 'nope'"):
        dispatch.choose(p)


def test_feature_dtype_and_device_reasons_are_reported():
    from solattn.backends.base import Backend

    class NoTail(Backend):
        name = "notail"
        devices = frozenset({"cuda"})
        dtypes = frozenset({torch.float16})
        head_dims = frozenset({64})
        features = frozenset({"topk", "tau"})
    q, k, v = make_qkv(1, 100, 2, 8)
    reasons = " | ".join(NoTail().not_supported_reasons(validate(q, k, v, tail=True)))
    assert "tail" in reasons and "float32" in reasons and "head dim 8" in reasons
    assert "device type 'cpu'" in reasons


def test_register_rejects_bad_names():
    from solattn.backends.base import Backend

    class Bad(Backend):
        name = "Bad-Name"
    with pytest.raises(ValueError, match="lowercase"):
        dispatch.register(Bad())


def test_backend_names_are_lowercase_words():
    for name in dispatch.registered():
        assert name.isalpha() and name == name.lower()


# --- scoped settings are per thread / per asyncio task --------------------------------------

def _in_thread(fn):
    """Run ``fn`` in a new thread; return its result or re-raise its exception here."""
    import threading
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "worker thread hung"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_use_backend_does_not_force_other_threads():
    q, k, v = make_qkv(1, 200, 2, 8, seed=3)
    by_sdpa = solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="sdpa")
    by_ref = solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="reference")
    assert not torch.equal(by_sdpa, by_ref)   # the two are told apart by their output bits
    with solattn.use_backend("reference"):
        assert torch.equal(solattn.sol_attn(q, k, v, topk_ratio=0.5), by_ref)
        other = _in_thread(lambda: solattn.sol_attn(q, k, v, topk_ratio=0.5))
        assert torch.equal(other, by_sdpa)
        inner = _in_thread(lambda: _run_forced("sdpa", q, k, v))
        assert torch.equal(inner, by_sdpa)
        assert dispatch.forced_backend() == "reference"   # the other thread's block did not touch ours


def _run_forced(name, q, k, v):
    with solattn.use_backend(name):
        return solattn.sol_attn(q, k, v, topk_ratio=0.5)


def test_memory_budget_scope_does_not_apply_to_other_threads():
    from solattn.budget import current_budget
    q, k, v = make_qkv(1, 200, 2, 8, seed=3)
    default = current_budget("reference")
    with solattn.memory_budget(1024, backend="reference"):
        assert current_budget("reference") == 1024
        with pytest.raises(solattn.BackendError, match="budget"):
            solattn.sol_attn(q, k, v, backend="reference")
        # another thread still has the process-wide budget: the reference runs there
        out = _in_thread(lambda: solattn.sol_attn(q, k, v, backend="reference"))
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert _in_thread(lambda: current_budget("reference")) == default
    # the process-wide setting stays process-wide
    try:
        solattn.set_memory_budget(1024, backend="reference")
        assert _in_thread(lambda: current_budget("reference")) == 1024
    finally:
        solattn.set_memory_budget(None, backend="reference")
    assert current_budget("reference") == default


def test_backward_in_one_thread_while_another_leaves_use_backend():
    """Interleaving of a backward pass (which suspends forced backends) in thread B with thread A
    leaving its use_backend block: neither raises, nothing stays forced afterwards."""
    import threading
    entered_a, entered_b, left_a = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def thread_a():
        try:
            with solattn.use_backend("reference"):
                entered_a.set()
                assert entered_b.wait(30)
            left_a.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            left_a.set()

    def thread_b():
        try:
            assert entered_a.wait(30)
            with dispatch.without_forced_backend():   # what the backward pass enters
                entered_b.set()
                assert left_a.wait(30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            entered_b.set()

    ts = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, errors
    assert dispatch.forced_backend() is None
    p = validate(*make_qkv(1, 100, 2, 8))
    assert dispatch.choose(p).name == "sdpa"


@pytest.mark.slow
def test_real_backward_in_a_thread_leaves_other_threads_forced_backend_alone():
    import threading
    q, k, v = make_qkv(1, 200, 2, 8, seed=5)
    inside, done = threading.Event(), threading.Event()
    seen = []

    def forcing_thread():
        with solattn.use_backend("reference"):
            inside.set()
            assert done.wait(60)
            seen.append(dispatch.forced_backend())

    t = threading.Thread(target=forcing_thread)
    t.start()
    assert inside.wait(30)
    try:
        qg = q.clone().requires_grad_(True)
        solattn.sol_attn(qg, k, v, topk_ratio=0.5).sum().backward()
        assert qg.grad is not None and torch.isfinite(qg.grad).all()
    finally:
        done.set()
        t.join(timeout=60)
    assert seen == ["reference"]
    assert dispatch.forced_backend() is None


def test_use_backend_is_per_asyncio_task():
    import asyncio
    p = validate(*make_qkv(1, 100, 2, 8))

    async def forcing(entered, release):
        with solattn.use_backend("reference"):
            entered.set()
            await release.wait()
            return dispatch.choose(p).name

    async def plain(entered, release):
        await entered.wait()
        name = dispatch.choose(p).name
        release.set()
        return name

    async def main():
        entered, release = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(forcing(entered, release), plain(entered, release))

    assert asyncio.run(main()) == ["reference", "sdpa"]


# --- the triton backend's reasons fit the machine -------------------------------------------

def test_triton_reasons_say_what_would_help(monkeypatch):
    from solattn.backends.triton import backend as tb
    triton = dispatch.get_backend("triton")
    monkeypatch.setattr(tb, "_triton_installed", lambda: False)
    # on the CPU without the interpreter, installing Triton would not help: say what would
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (cpu,) = triton.availability_reasons("cpu")
    assert "CUDA GPUs (sm_80+)" in cpu and "TRITON_INTERPRET=1" in cpu and "sdpa" in cpu
    assert "install" not in cpu
    assert all("install" not in r for r in triton.availability_reasons("mps"))
    # under the interpreter it would (on Linux)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (hint,) = triton.availability_reasons("cpu")
    assert hint == tb._install_hint("cpu", tb.sys.platform)
    assert tb._install_hint("cuda", "linux") == "triton not installed (pip install triton)"
    win = tb._install_hint("cuda", "win32")
    assert "no Windows wheels" in win and "pip install triton-windows" in win
    mac = tb._install_hint("cpu", "darwin")
    assert "macOS" in mac and "pip install" not in mac
    assert "pytorch-triton-xpu" in tb._install_hint("xpu", "linux")
    # the backend listing shows the same reason
    monkeypatch.delenv("TRITON_INTERPRET")
    info = {i["name"]: i for i in solattn.list_backends("cpu")}["triton"]
    assert info["reasons"] == [cpu] and not info["available"]


# --- the package layout and the public surface ----------------------------------------------

@pytest.mark.slow
def test_backends_subpackage_and_listing_function_coexist():
    import importlib
    import subprocess
    import sys
    # in a fresh interpreter, in both import orders
    for first, second in (("import solattn.backends.sdpa", "import solattn"),
                          ("import solattn", "import solattn.backends.sdpa")):
        code = (f"{first}; {second}; import types; "
                "assert isinstance(solattn.backends, types.ModuleType); "
                "from solattn.backends.sdpa import SdpaBackend; "
                "names = [b['name'] for b in solattn.list_backends('cpu')]; "
                "assert names[0] == 'sdpa' and 'reference' in names, names; print('ok')")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    sdpa_mod = importlib.import_module("solattn.backends.sdpa")
    assert solattn.backends.sdpa is sdpa_mod
    assert [b["name"] for b in solattn.list_backends("cpu")][0] == "sdpa"


def test_public_surface_is_the_user_facing_names():
    assert set(solattn.__all__) == {
        "sol_attn", "video_sparse_attn", "plan", "video_plan", "tile", "untile", "list_backends", "use_backend",
        "best_device", "BackendError", "memory_budget", "set_memory_budget", "register_backend",
        "Backend", "BLOCK", "cuda_graphs", "warm_up", "__version__"}
    for name in solattn.__all__:
        assert hasattr(solattn, name), name
    public = {n for n in vars(solattn) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(solattn, n)).__name__ == "module"}
    assert public - modules == set(solattn.__all__) - {"__version__"}
    for internal in ("build_plan", "validate", "Problem", "Plan", "ReferenceBackend", "SdpaBackend"):
        assert not hasattr(solattn, internal), internal
    assert solattn.Backend is solattn.backends.base.Backend


# --- registration with priority; capability checks live once in the base class ---------------

class _Toy(solattn.Backend):
    """A third-party backend: the reference's arithmetic, counting its calls."""
    name = "toy"
    description = "test toy"
    devices = frozenset({"cpu"})
    uses_plan = False

    def __init__(self, refuse=None):
        self.calls = 0
        self.refuse = refuse

    def problem_reasons(self, problem):
        return [self.refuse] if self.refuse else []

    def forward(self, problem, plan=None):
        self.calls += 1
        return refmod.reference_forward(problem)


@pytest.fixture
def toy_registered():
    made = []

    def make(priority=None, refuse=None):
        toy = _Toy(refuse)
        made.append(solattn.register_backend(toy, priority=priority))
        return toy
    yield make
    if "toy" in dispatch.registered():
        dispatch.unregister("toy")
    assert "toy" not in dispatch.registered()


def test_registered_backend_with_priority_is_chosen_automatically(toy_registered):
    q, k, v = make_qkv(1, 200, 2, 8, seed=6)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="reference")
    toy = toy_registered(priority={"cpu": 0})
    assert dispatch.priority("cpu") == ["toy", "sdpa", "reference"]
    out = solattn.sol_attn(q, k, v, topk_ratio=0.5)
    assert toy.calls == 1 and torch.equal(out, want)
    listing = solattn.list_backends("cpu")
    assert [i["name"] for i in listing][:3] == ["toy", "sdpa", "reference"]
    assert listing[0]["priority"] == 0 and listing[0]["available"]
    # one int: that position on every device type it declares
    toy = toy_registered(priority=1)
    assert dispatch.priority("cpu") == ["sdpa", "toy", "reference"]
    assert "toy" not in dispatch.priority("cuda")
    solattn.sol_attn(q, k, v, topk_ratio=0.5)
    assert toy.calls == 0
    # a position past the end is last
    toy_registered(priority={"cpu": 99})
    assert dispatch.priority("cpu") == ["sdpa", "reference", "toy"]
    # without a priority it runs only when asked for
    toy = toy_registered()
    assert "toy" not in dispatch.priority("cpu")
    solattn.sol_attn(q, k, v, topk_ratio=0.5)
    assert toy.calls == 0
    assert torch.equal(solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="toy"), want) and toy.calls == 1
    dispatch.unregister("toy")
    with pytest.raises(ValueError, match="argument 'backend' received 'toy'"):
        solattn.sol_attn(q, k, v, backend="toy")


def test_register_rejects_bad_priorities():
    toy = _Toy()
    with pytest.raises(ValueError, match=r"argument 'priority' received device type 'cuda'.*\['cpu'\]"):
        dispatch.register(toy, priority={"cuda": 0})
    with pytest.raises(ValueError, match=r"argument 'priority' received position=-1"):
        dispatch.register(toy, priority=-1)
    with pytest.raises(TypeError, match=r"argument 'priority' received 'cpu'=1.5"):
        dispatch.register(toy, priority={"cpu": 1.5})
    with pytest.raises(TypeError, match=r"argument 'priority' received str 'first'"):
        dispatch.register(toy, priority="first")
    with pytest.raises(TypeError, match="argument 'backend' received str"):
        dispatch.register("toy")
    assert "toy" not in dispatch.registered()
    with pytest.raises(ValueError, match="argument 'backend' received 'toy'"):
        dispatch.unregister("toy")


def test_nothing_can_run_table_walks_the_selection_order(monkeypatch, toy_registered):
    toy_registered(priority={"cpu": 0}, refuse="toy refuses")
    monkeypatch.setattr(refmod.budget, "_value", 1024)
    monkeypatch.setitem(devices.DEVICES, "cpu", dataclasses.replace(devices.DEVICES["cpu"], priority=("reference",)))
    p = validate(*make_qkv(1, 100, 2, 8))
    with pytest.raises(solattn.BackendError) as ei:
        dispatch.choose(p)
    lines = str(ei.value).splitlines()[1:]
    shown = [line.split(":")[0].strip() for line in lines]
    walked = [i["name"] for i in solattn.list_backends("cpu")]
    assert shown == walked == ["toy", "reference", "flex", "sdpa", "triton"]
    assert lines[0] == "  toy: toy refuses"
    assert lines[3] == "  sdpa: can run"


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_compute_capability_is_checked_once_in_the_base_class(monkeypatch):
    class NeedsHopper(solattn.Backend):
        name = "hopper"
        devices = frozenset({"cuda"})
        min_compute_capability = (9, 0)

        def device_reasons(self, device):
            return ["hopper library missing"]

    b = NeedsHopper()
    _fake_cuda(monkeypatch, (8, 6))
    assert b.availability_reasons("cuda") == [
        "needs a GPU of compute capability 9.0 or newer (sm_90+); cuda is 8.6"]
    assert b.availability_reasons("cuda:1") == [
        "needs a GPU of compute capability 9.0 or newer (sm_90+); cuda:1 is 8.6"]
    _fake_cuda(monkeypatch, (9, 0))
    assert b.availability_reasons("cuda") == ["hopper library missing"]   # appended by the backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert b.availability_reasons("cuda") == [
        "no CUDA device available (torch.cuda.is_available() is False)"]
    # the built-in triton backend declares sm_80 and gets the same generic message
    _fake_cuda(monkeypatch, (7, 5))
    assert dispatch.get_backend("triton").availability_reasons("cuda") == [
        "needs a GPU of compute capability 8.0 or newer (sm_80+); cuda is 7.5"]


def test_backends_cannot_replace_the_generic_checks():
    with pytest.raises(TypeError, match="overrides Backend.availability_reasons.*device_reasons"):
        class Replaces(solattn.Backend):
            name = "replaces"

            def availability_reasons(self, device):
                return []
    with pytest.raises(TypeError, match="overrides Backend.not_supported_reasons.*problem_reasons"):
        class Rewrites(solattn.Backend):
            name = "rewrites"

            def not_supported_reasons(self, problem):
                return []


@pytest.mark.slow
def test_use_backend_reaches_compiled_calls_at_run_time():
    """The forced backend is read when the custom ops run, not baked in when torch.compile traces."""
    q, k, v = make_qkv(1, 200, 2, 8, seed=3)
    by_sdpa = solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="sdpa")
    by_ref = solattn.sol_attn(q, k, v, topk_ratio=0.5, backend="reference")
    fn = torch.compile(lambda q, k, v: solattn.sol_attn(q, k, v, topk_ratio=0.5), fullgraph=True,
                       backend="eager")
    assert torch.equal(fn(q, k, v), by_sdpa)
    with solattn.use_backend("reference"):
        assert torch.equal(fn(q, k, v), by_ref)
    assert torch.equal(fn(q, k, v), by_sdpa)
    qv, kv, vv = make_qkv(1, 2 * 4 * 8, 2, 8, seed=4)
    vsa = torch.compile(lambda q, k, v: solattn.video_sparse_attn(q, k, v, (2, 4, 8), topk=1),
                        fullgraph=True, backend="eager")
    vsa(qv, kv, vv)
    with solattn.use_backend("reference"), pytest.raises(solattn.BackendError, match="cannot serve VSA"):
        vsa(qv, kv, vv)


def test_backward_recomputes_under_the_forward_calls_scoped_settings(monkeypatch):
    """The backward pass runs after the ``with`` blocks of its forward have ended (and on CUDA
    in autograd's own thread): it must recompute with the budget and backend of the forward."""
    from solattn.backends import sdpa as sdpamod
    from solattn.budget import current_budget

    seen = []
    real = sdpamod.sdpa_forward

    def spy(problem, plan, *args, **kwargs):
        seen.append(current_budget("sdpa"))
        return real(problem, plan, *args, **kwargs)

    monkeypatch.setattr(sdpamod, "sdpa_forward", spy)
    q, k, v = (torch.randn(1, 256, 2, 16, requires_grad=True) for _ in range(3))
    with solattn.memory_budget(5 << 20), solattn.use_backend("sdpa"):
        out = solattn.sol_attn(q, k, v, topk_ratio=0.5)
    out.sum().backward()
    assert seen == [5 << 20, 5 << 20]
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_choice_key_follows_everything_that_decides_the_backend(toy_registered, monkeypatch):
    """The key solattn.cuda_graphs adds to a call's arguments changes with use_backend,
    SOLATTN_BACKEND and every register / unregister (a graph must not replay another choice)."""
    monkeypatch.delenv("SOLATTN_BACKEND", raising=False)
    keys = [dispatch.choice_key()]
    with solattn.use_backend("sdpa"):
        keys.append(dispatch.choice_key())
    monkeypatch.setenv("SOLATTN_BACKEND", "reference")
    keys.append(dispatch.choice_key())
    toy_registered(priority={"cpu": 0})
    keys.append(dispatch.choice_key())
    dispatch.unregister("toy")
    keys.append(dispatch.choice_key())
    assert len(set(keys)) == len(keys)
    assert dispatch.choice_key() == keys[-1]                   # stable while nothing changes
