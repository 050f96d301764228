"""The comfy-kitchen plug-in against the real comfy-kitchen package (0.2.40 in CI; 0.2.36 passes too).

comfy-kitchen's ``sol_attn`` accepts head_dim 128 only (its shared call rule applies to
every backend), so every call here uses D = 128.
"""

import importlib.util
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ck = pytest.importorskip(
    "comfy_kitchen",
    reason="comfy-kitchen is not installed: `pip install comfy-kitchen==0.2.40` (it is in the 'test' extra)")

from comfy_kitchen.exceptions import NoCapableBackendError  # noqa: E402
from comfy_kitchen.registry import registry  # noqa: E402

import solattn  # noqa: E402
from solattn.integrations import comfy_kitchen as plugin  # noqa: E402
from solattn.testing import rel_l2, tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
NODE_INIT = ROOT / "integrations" / "comfyui" / "solattn_sparse_attention" / "__init__.py"
D = 128
NAME = "solattn"  # the plug-in's name in comfy-kitchen's registry (Intel's fork takes "xpu")


def registry_state():
    return {
        "backends": dict(registry._backends),
        "capabilities": {name: set(caps) for name, caps in registry._capabilities.items()},
        "constraints": dict(registry._constraints),
        "unavailable": dict(registry._unavailable),
        "priority": list(registry._priority),
        "disabled": set(registry._disabled),
    }


@pytest.fixture(autouse=True)
def registry_is_restored():
    """Every test starts without the plug-in and leaves comfy-kitchen's registry as it found it."""
    assert not plugin.is_installed()
    before = registry_state()
    yield
    plugin.uninstall()
    assert registry_state() == before


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records every problem solattn's sdpa backend runs (the spy delegates to the real forward)."""
    cls = type(solattn.dispatch.get_backend(plugin.SOLATTN_BACKEND))
    original = cls.forward
    calls = []

    def spy(self, problem, plan=None):
        calls.append(problem)
        return original(self, problem, plan)

    monkeypatch.setattr(cls, "forward", spy)
    return calls


def op_kwargs(q, k, v, **over):
    """The kwargs comfy-kitchen's custom op hands its registry for a call with defaults."""
    kw = dict(q=q, k=k, v=v, tau=1.0, scale=None, sink_blocks=[0, 0], sink_q=[0, 0], key_bias=None,
              topk_ratio=0.0, tail=True, block_len=None, coarse_gate=None, token_aug=0)
    kw.update(over)
    return kw


def eager_reference(*args, **kwargs):
    with registry.use_backend("eager"):
        return ck.sol_attn(*args, **kwargs)


def run_python(code, env_value=None):
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_VAR}
    if env_value is not None:
        env[plugin.ENV_VAR] = env_value
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- import and install

@pytest.mark.slow
def test_import_solattn_does_not_import_comfy_kitchen():
    res = run_python("import sys, solattn; print(sorted(m for m in sys.modules if 'comfy_kitchen' in m))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.slow
def test_install_from_env_installs_what_the_variable_asks():
    code = ("import solattn, comfy_kitchen as ck\n"
            "from comfy_kitchen.registry import registry as r\n"
            "from solattn.integrations import comfy_kitchen as p\n"
            "assert not p.is_installed()  # import solattn installs nothing\n"
            "p.install_from_env()\n"
            "print(p.installed_devices(), r._priority[0],\n"
            "      sorted(r.get_constraints('solattn', 'sol_attn').default_devices))\n"
            "q = k = v = __import__('torch').randn(1, 128, 1, 128)\n"
            "print(r.get_capable_backend('sol_attn', dict(q=q, k=k, v=v, tau=1.0, topk_ratio=0.0, token_aug=0)))")
    res = run_python(code, " cpu, xpu ")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["('cpu', 'xpu') solattn ['cpu', 'xpu']", "solattn"]

    bad = run_python("from solattn.integrations import comfy_kitchen as p; p.install_from_env()", "cuda")
    assert bad.returncode != 0
    assert "SOLATTN_COMFY_KITCHEN" in bad.stderr and "'cuda'" in bad.stderr and "'xpu'" in bad.stderr


@pytest.mark.parametrize("devices", ["cuda", ("xpu", "gpu"), (), 3, None, ("XPU",)])
def test_install_rejects_other_devices(devices):
    with pytest.raises(ValueError) as err:
        plugin.install(devices)
    msg = str(err.value)
    assert "'devices'" in msg and repr(devices) in msg and "('xpu', 'mps', 'cpu')" in msg
    assert not plugin.is_installed()


def test_install_without_comfy_kitchen_says_how_to_get_it(monkeypatch):
    for name in [m for m in sys.modules if m == "comfy_kitchen" or m.startswith("comfy_kitchen.")]:
        monkeypatch.setitem(sys.modules, name, None)  # what an uninstalled package looks like
    with pytest.raises(ImportError, match=r"pip install comfy-kitchen"):
        plugin.install(("cpu",))
    assert not plugin.is_installed()


def test_refuses_to_replace_a_foreign_backend_of_the_same_name():
    foreign = type(sys)("someone_elses_backend")
    registry.register(NAME, foreign, {"sol_attn": None})
    try:
        with pytest.raises(RuntimeError, match=f"already has a backend named '{NAME}'"):
            plugin.install(("cpu",))
        assert registry._backends[NAME] is foreign and not plugin.is_installed()
    finally:
        with registry._lock:
            registry._backends.pop(NAME)
            registry._capabilities.pop(NAME)
            registry._constraints.pop((NAME, "sol_attn"))


def test_coexists_with_intels_xpu_backend(sdpa_calls):
    """Intel's comfy-kitchen fork registers a backend named "xpu": the plug-in takes its own name,
    leaves that backend alone, and uninstall leaves it as it was."""
    assert plugin.BACKEND_NAME == NAME != "xpu"
    intel = type(sys)("intel_xpu_backend")
    intel.sol_attn = lambda **kw: pytest.fail("the plug-in goes first")
    original = list(registry._priority)
    registry.register("xpu", intel, {"sol_attn": None})
    registry.set_priority(["xpu", *original])
    try:
        plugin.install(("cpu",))
        assert registry._backends["xpu"] is intel and registry._backends[NAME] is plugin
        assert registry._priority[:2] == [NAME, "xpu"]
        q = k = v = torch.randn(1, 128, 1, D)
        ck.sol_attn(q, k, v)
        assert len(sdpa_calls) == 1
        plugin.install(("cpu",), first=False)                   # behind Intel's, ahead of eager
        assert registry._priority == ["xpu", *original[:-1], NAME, "eager"]
        plugin.uninstall()
        assert registry._backends["xpu"] is intel and registry._priority == ["xpu", *original]
    finally:
        plugin.uninstall()
        registry.set_priority(original)
        with registry._lock:
            registry._backends.pop("xpu")
            registry._capabilities.pop("xpu")
            registry._constraints.pop(("xpu", "sol_attn"))


# --------------------------------------------------------------------------- dispatch

def test_cpu_calls_select_the_plugin(sdpa_calls):
    q, k, v = (torch.randn(1, 200, 2, D) for _ in range(3))
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == "eager"
    assert plugin.install(("cpu",)) == ("cpu",)
    assert registry._priority[0] == NAME
    status = registry.list_backends()[NAME]
    assert status["available"] and status["capabilities"] == ["sol_attn"]
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == NAME
    out = ck.sol_attn(q, k, v, topk_ratio=0.25)
    assert len(sdpa_calls) == 1 and sdpa_calls[0].q.data_ptr() == q.data_ptr()
    assert sdpa_calls[0].mode == "topk" and out.shape == q.shape and out.is_contiguous()


def test_constraints_admit_exactly_what_solattn_runs():
    q, k, v = (torch.randn(1, 130, 2, D) for _ in range(3))
    plugin.install(("xpu",))  # a CPU call is not ours
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == "eager"
    plugin.install(("cpu", "mps"))  # updates the registration in place
    assert registry.get_constraints(NAME, "sol_attn").default_devices == frozenset({"cpu", "mps"})
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = q.to(dtype)
        assert registry.validate_backend_for_call(NAME, "sol_attn", op_kwargs(t, t, t)).success
    t = q.to(torch.float64)
    assert not registry.validate_backend_for_call(NAME, "sol_attn", op_kwargs(t, t, t)).success
    # comfy-kitchen's shared rule (head_dim 128) still applies to every backend, ours included
    small = torch.randn(1, 130, 2, 64)
    with pytest.raises(NoCapableBackendError) as err:
        registry.get_capable_backend("sol_attn", op_kwargs(small, small, small))
    assert "head_dim must be 128" in err.value.failures[NAME]
    # what solattn's validation refuses falls through to comfy-kitchen's own reference
    bad = registry.validate_backend_for_call(NAME, "sol_attn", op_kwargs(q, k, v, tau=float("nan")))
    assert not bad.success and bad.failed_param == "tau" and "finite" in bad.failure_reason
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v, tau=float("nan"))) == "eager"
    head_mask = torch.zeros(1, 2, 1, 130)
    bad = registry.validate_backend_for_call(NAME, "sol_attn", op_kwargs(q, k, v, key_bias=head_mask))
    assert not bad.success and bad.failed_param == "key_bias"


def _case(name, B=2, T=64 * 12 + 37, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.ceil(T / 64)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    kw = {}
    if name == "topk":
        kw = dict(topk_ratio=0.3)
    elif name == "tau_tail":
        kw = dict(tau=0.5)
    elif name == "tau_sinks_no_tail":
        kw = dict(tau=1.0, tail=False, sink_blocks=[0, 1], sink_q=[4, 5])
    elif name == "vsa":  # top-k, no tail, zero-padded tiles, gated coarse branch
        kw = dict(topk_ratio=0.25, tail=False,
                  block_len=torch.randint(20, 65, (n,), generator=g, dtype=torch.int32),
                  coarse_gate=torch.randn(B, T, H, D, generator=g))
    elif name == "key_bias":  # bias confined to the sink blocks, as comfy-kitchen's docstring asks
        kb = torch.zeros(B, 1, 1, T)
        kb[..., :128] = torch.randn(B, 1, 1, 128, generator=g)
        kw = dict(tau=0.8, scale=0.05, key_bias=kb, sink_blocks=[0, 2])
    elif name == "bool_mask_block_len_tail":
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, 5:40] = False
        kw = dict(tau=1.0, key_bias=mask, sink_blocks=[0, 1],
                  block_len=torch.randint(30, 65, (n,), generator=g, dtype=torch.int32))
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["topk", "tau_tail", "tau_sinks_no_tail", "vsa", "key_bias",
                                  "bool_mask_block_len_tail"])
def test_agrees_with_comfy_kitchens_reference(name, dtype, sdpa_calls):
    q, k, v, kw = _case(name)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if "coarse_gate" in kw:
        kw["coarse_gate"] = kw["coarse_gate"].to(dtype)
    expected = eager_reference(q, k, v, **kw)
    assert not sdpa_calls
    plugin.install(("cpu",))
    out = ck.sol_attn(q, k, v, **kw)
    assert len(sdpa_calls) == 1
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    live = torch.ones(q.shape[1], dtype=torch.bool)
    if kw.get("block_len") is not None:  # dead rows' outputs are unspecified (finite)
        assert torch.isfinite(out).all()
        live = (torch.arange(q.shape[1]) % 64) < kw["block_len"].clamp(1, 64).repeat_interleave(64)[:q.shape[1]]
    tol = tolerance(dtype)
    assert rel_l2(out[:, live], expected[:, live]) < tol


def _planted_long_problem(T=257 * 64, H=4, seed=0):
    """q block i aims at key block perm[i] and at nothing else, so the top-1 block is unambiguous."""
    g = torch.Generator().manual_seed(seed)
    n = T // 64
    dirs = torch.nn.functional.normalize(torch.randn(H, n, D, generator=g), dim=-1)  # one per key block
    perm = torch.randperm(n, generator=g)
    blk = torch.arange(T) // 64
    k = 6.0 * dirs[:, blk].permute(1, 0, 2) + torch.randn(T, H, D, generator=g)
    q = 6.0 * dirs[:, perm[blk]].permute(1, 0, 2) + torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    return [t.unsqueeze(0).to(torch.bfloat16) for t in (q, k, v)], perm


def _spec_rows(q, k, v, i, topk_ratio):
    """SPEC.md's output for the rows of query block i of one (b, h), computed directly (fp32).
    q, k, v: (T, D) with T a multiple of 64. Returns (rows, exact block set)."""
    q, k, v = q.float(), k.float(), v.float()
    T = q.shape[0]
    n, scale = T // 64, D ** -0.5
    km, vm = k.view(n, 64, D).mean(1), v.view(n, 64, D).mean(1)
    qm = q[64 * i:64 * i + 64].mean(0)
    m = km.mean(0)
    R = scale * math.log2(math.e) * ((km - m) @ qm)
    kk = min(max(1, round(topk_ratio * n)), n - 1)
    exact = R >= R.topk(kk).values[-1]
    exact[max(i - 1, 0):i + 2] = True
    tokens = exact.repeat_interleave(64)
    e = scale * q[64 * i:64 * i + 64] @ (k[tokens] - m).T                 # (64, exact keys)
    p = (scale * ((km[~exact] - m) @ qm) + math.log(64)).expand(64, -1)   # L_j = 64 keys at the centroid
    w = torch.softmax(torch.cat([e, p], dim=1), dim=1)
    ne = e.shape[1]
    return w[:, :ne] @ v[tokens] + w[:, ne:] @ vm[~exact], exact


def test_long_sequence_where_comfy_kitchens_reference_refuses(sdpa_calls):
    # comfy-kitchen's eager reference refuses once B*H*T*T*4 bytes of fp32 scores exceed 4 GiB;
    # (1, 4, 16384) is exactly 4 GiB and is admitted (then needs several such tensors),
    # one more block is refused before any work
    (q, k, v), perm = _planted_long_problem()
    T, ratio = q.shape[1], 0.002  # kk = round(0.002 * 257) = 1 block by score, plus neighbours
    with pytest.raises(RuntimeError, match=r"eager reference is O\(T\^2\)"):
        eager_reference(q, k, v, topk_ratio=ratio)
    plugin.install(("cpu",))
    out = ck.sol_attn(q, k, v, topk_ratio=ratio)
    assert len(sdpa_calls) == 1 and out.shape == (1, T, 4, D) and torch.isfinite(out).all()
    for h in range(4):
        for i in (0, 100, T // 64 - 1):
            expected, exact = _spec_rows(q[0, :, h], k[0, :, h], v[0, :, h], i, ratio)
            planted = torch.zeros_like(exact)
            planted[perm[i]] = True
            planted[max(i - 1, 0):i + 2] = True
            assert torch.equal(exact, planted)  # the construction made the selection unambiguous
            assert rel_l2(out[0, 64 * i:64 * i + 64, h], expected) < 1e-2


def test_torch_compile_path(sdpa_calls):
    q, k, v = (torch.randn(1, 256, 2, D) for _ in range(3))
    expected = eager_reference(q, k, v, topk_ratio=0.25, tail=False)
    plugin.install(("cpu",))

    def attend(q, k, v):
        return ck.sol_attn(q, k, v, topk_ratio=0.25, tail=False)

    compiled = torch.compile(attend, fullgraph=True)
    out = compiled(q, k, v)
    assert len(sdpa_calls) == 1  # the compiled graph's op dispatched to the plug-in at run time
    assert rel_l2(out, expected) < 2e-5
    plugin.uninstall()  # the same compiled graph now reaches comfy-kitchen's reference
    again = compiled(q, k, v)
    assert len(sdpa_calls) == 1 and torch.equal(again, expected)


# --------------------------------------------------------------------------- idempotence and uninstall

def test_install_is_idempotent_and_uninstall_restores_dispatch(sdpa_calls):
    q, k, v = (torch.randn(1, 200, 2, D) for _ in range(3))
    before = registry_state()
    expected = ck.sol_attn(q, k, v, tau=0.7)  # comfy-kitchen's own choice (eager here)
    assert not sdpa_calls

    plugin.install(("cpu",))
    once = registry_state()
    plugin.install(("cpu",))
    plugin.install("cpu")
    assert registry_state() == once and registry._priority.count(NAME) == 1

    plugin.install(("cpu",), first=False)  # just ahead of comfy-kitchen's reference
    assert registry._priority[-2:] == [NAME, "eager"] and registry._priority.count(NAME) == 1
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == NAME
    out = ck.sol_attn(q, k, v, tau=0.7)
    assert len(sdpa_calls) == 1 and rel_l2(out, expected) < 2e-5

    assert plugin.uninstall() is True
    assert registry_state() == before and not plugin.is_installed()
    assert plugin.uninstall() is False
    assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == "eager"
    assert torch.equal(ck.sol_attn(q, k, v, tau=0.7), expected) and len(sdpa_calls) == 1


def test_uninstall_keeps_a_priority_order_changed_after_install():
    original = list(registry._priority)
    plugin.install(("cpu",))
    registry.set_priority(["eager", NAME, "cuda"])  # someone else reorders
    try:
        plugin.uninstall()
        assert registry._priority == ["eager", "cuda"] and NAME not in registry._backends
    finally:
        registry.set_priority(original)


# --------------------------------------------------------------------------- ComfyUI custom node

def import_node_folder(times=1):
    """Import the custom node folder as ComfyUI does (module named after the folder path)."""
    name = str(NODE_INIT.parent)
    try:
        for _ in range(times):  # ComfyUI may import the folder again (reload)
            spec = importlib.util.spec_from_file_location(name, NODE_INIT)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    assert spec.submodule_search_locations
    assert list(module.NODE_CLASS_MAPPINGS) == ["SolAttnModelSparseAttention"]   # the node, always
    return module


def test_comfyui_custom_node_installs_when_the_variable_asks(caplog, monkeypatch, sdpa_calls):
    monkeypatch.setenv(plugin.ENV_VAR, "auto")
    caplog.set_level(logging.INFO)
    module = import_node_folder(times=2)     # still one registration
    present = plugin.available_devices()
    assert "cpu" in present and plugin.installed_devices() == present == module.INSTALLED_DEVICES
    assert os.environ[plugin.ENV_VAR] == "auto"
    ours = [r for r in caplog.records if r.name == "solattn.comfyui"]
    lines = [r.getMessage() for r in ours]
    assert len(lines) == 2 and lines[0] == lines[1]  # one line per import
    assert lines[0].startswith("solattn: comfy_kitchen.sol_attn on " + ", ".join(present))
    assert "'sdpa'" in lines[0] and all(r.levelno == logging.INFO for r in ours)
    assert registry._priority.count(NAME) == 1
    q = k = v = torch.randn(1, 128, 1, D)
    ck.sol_attn(q, k, v)
    assert len(sdpa_calls) == 1


def test_comfyui_custom_node_without_the_variable_leaves_comfy_kitchen_alone(caplog, monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    caplog.set_level(logging.INFO)
    module = import_node_folder()
    assert module.INSTALLED_DEVICES is None and not plugin.is_installed()
    assert not [r for r in caplog.records if r.name == "solattn.comfyui"]


@pytest.mark.parametrize("value, message", [
    ("cuda", "SOLATTN_COMFY_KITCHEN received 'cuda'"),
    ("cpu", "pip install comfy-kitchen"),
], ids=["bad_value", "no_comfy_kitchen"])
def test_comfyui_custom_node_logs_plugin_errors_and_keeps_the_node(caplog, monkeypatch, value, message):
    monkeypatch.setenv(plugin.ENV_VAR, value)
    if value == "cpu":
        for name in [m for m in sys.modules if m == "comfy_kitchen" or m.startswith("comfy_kitchen.")]:
            monkeypatch.setitem(sys.modules, name, None)  # what an uninstalled package looks like
    module = import_node_folder()
    assert module.INSTALLED_DEVICES is None and not plugin.is_installed()
    assert os.environ[plugin.ENV_VAR] == value
    errors = [r.getMessage() for r in caplog.records if r.name == "solattn.comfyui" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "plug-in not installed" in errors[0] and message in errors[0]


@pytest.mark.slow
def test_comfyui_custom_node_registers_the_node_when_the_variable_is_bad():
    """A fresh process (solattn not imported yet) where the variable's value is not a device type:
    the folder still registers the node and logs the plug-in's error."""
    code = ("import importlib.util, logging, os, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(levelname)s %(message)s')\n"
            f"spec = importlib.util.spec_from_file_location('folder', {str(NODE_INIT)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "from solattn.integrations import comfy_kitchen as p\n"
            "print(sorted(m.NODE_CLASS_MAPPINGS), p.is_installed(), os.environ['SOLATTN_COMFY_KITCHEN'])\n")
    res = run_python(code, "cuda")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().split("\n")
    assert lines[-1] == "['SolAttnModelSparseAttention'] False cuda"
    assert lines[0].startswith("ERROR solattn: comfy-kitchen plug-in not installed") and "'cuda'" in lines[0]
    ok = run_python(code, "cpu")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().split("\n")[-1] == "['SolAttnModelSparseAttention'] True cpu"


# --------------------------------------------------------------------------- comfy-kitchen's contract

@pytest.mark.parametrize("bad,arg", [
    (dict(block_len=torch.full((3,), 64, dtype=torch.int64)), "block_len"),   # int32 expected
    (dict(coarse_gate=torch.zeros(1, 130, 2, D, dtype=torch.float64)), "coarse_gate"),
    (dict(tau="1.0"), "tau"),
    (dict(sink_blocks=[0.5, 1]), "sink_blocks"),
    (dict(key_bias=torch.zeros(130, dtype=torch.int32)), "key_bias"),
], ids=["int64_block_len", "fp64_gate", "str_tau", "float_sinks", "int_key_bias"])
def test_bad_arguments_raise_value_error_like_comfy_kitchens_backends(bad, arg, sdpa_calls):
    """comfy-kitchen's backends raise ValueError for every bad argument (its CUDA entry turns
    its shared call rule's failures into ValueError, wrong dtypes included) and its callers catch
    ValueError; solattn itself raises TypeError for a wrong type."""
    q, k, v = (torch.randn(1, 130, 2, D) for _ in range(3))
    plugin.install(("cpu",))
    impl = registry.get_implementation("sol_attn", backend=NAME)            # comfy-kitchen's handle
    for fn in (plugin.sol_attn, impl):
        with pytest.raises(ValueError, match=f"'{arg}'") as err:
            fn(q, k, v, **bad)
        assert not isinstance(err.value, TypeError) and "allowed" in str(err.value)
    with pytest.raises(TypeError):                                           # solattn's own API is unchanged
        solattn.sol_attn(q, k, v, **bad)
    assert not sdpa_calls                                                    # refused before any work


def test_set_backend_priority_drops_the_plugin_until_installed_again(sdpa_calls):
    """comfy-kitchen's public set_backend_priority replaces the whole list, and the registry only
    tries listed backends: the plug-in stays registered but is never chosen."""
    q, k, v = (torch.randn(1, 200, 2, D) for _ in range(3))
    original = list(registry._priority)
    plugin.install(("cpu",))
    try:
        ck.set_backend_priority(["cuda", "eager"])
        assert NAME in registry._backends and NAME not in registry._priority
        assert registry.get_capable_backend("sol_attn", op_kwargs(q, k, v)) == "eager"
        ck.sol_attn(q, k, v)
        assert not sdpa_calls                                               # dropped, silently
        plugin.install(("cpu",))                                            # the documented remedy
        assert registry._priority == [NAME, "cuda", "eager"]
        ck.sol_attn(q, k, v)
        assert len(sdpa_calls) == 1
    finally:
        plugin.uninstall()
        registry.set_priority(original)
