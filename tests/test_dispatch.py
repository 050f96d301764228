"""Backend selection: priorities, forcing, the context manager, the environment variable, errors."""

from __future__ import annotations


import pytest
import torch

import solattn
from solattn import dispatch
from solattn.backends import reference as refmod
from conftest import make_qkv


def test_backends_listing():
    infos = solattn.backends("cpu")
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
    p = solattn.validate(q, k, v)
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
    p = solattn.validate(q, k, v)
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ["reference"])
    with pytest.raises(solattn.BackendError) as ei:
        dispatch.choose(p)
    msg = str(ei.value)
    for name in dispatch.registered():
        assert f"  {name}:" in msg


def test_env_preference_and_fallback_warning(monkeypatch):
    q, k, v = make_qkv(1, 100, 2, 8)
    p = solattn.validate(q, k, v)
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
    reasons = " | ".join(NoTail().not_supported_reasons(solattn.validate(q, k, v, tail=True)))
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
