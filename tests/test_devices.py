"""The device table (solattn.devices) is the one source of every device fact: a device type
given by one entry reaches the automatic choice, the present devices, the best device,
synchronisation, the routing's top-k method and the sdpa backend's mask dtype; and the built-in
entries hold today's facts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import solattn
from solattn import devices, dispatch
from solattn.backends.sdpa import masks
from solattn.bench import memory, timing
from solattn.distributed import group
from solattn.routing import default_topk_method
from solattn.testing import device_types, make_qkv


@pytest.fixture
def fake_device(monkeypatch):
    """A fake accelerator type ``hpu`` with two devices, given by one entry of the table (run on
    the CPU: it is never asked for tensors, only for its facts)."""
    synced = []
    entry = devices.DeviceType("hpu", priority=("reference", "sdpa"), topk="sort", fp32_masks=True,
                               count=lambda: 2, synchronize=synced.append)
    monkeypatch.setitem(devices.DEVICES, "hpu", entry)
    for name in ("cuda", "xpu", "mps"):    # whatever this machine has: the fake is the only accelerator
        monkeypatch.setitem(devices.DEVICES, name, dataclasses.replace(devices.DEVICES[name], count=lambda: 0))
    return synced


def test_one_entry_reaches_every_device_path(fake_device):
    assert devices.present_devices() == ["cpu", "hpu:0", "hpu:1"]
    assert devices.best_device() == torch.device("hpu") == solattn.best_device()
    assert device_types() == ["cpu", "hpu"]
    assert dispatch.priority("hpu") == ["reference", "sdpa"]
    assert [b["name"] for b in dispatch.list_backends("hpu")][:2] == ["reference", "sdpa"]
    timing.synchronize(torch.device("hpu:1"))
    timing.flush_l2(torch.device("hpu:1"))               # no l2_flush in the entry: nothing to do
    assert fake_device == [torch.device("hpu:1")]
    assert default_topk_method(torch.device("hpu"), 100) == "sort"
    assert masks.mask_dtype(torch.device("hpu"), torch.bfloat16) == torch.float32
    assert devices.allocator(torch.device("hpu")) is None


def test_measure_peak_synchronizes_through_the_entry(fake_device):
    out, mib, basis = memory.measure_peak(lambda: 7, torch.device("hpu:0"))
    assert (out, mib, basis) == (7, None, "n/a") and fake_device == [torch.device("hpu:0")]


def test_entry_change_moves_the_automatic_choice(monkeypatch):
    """The CPU's order is its entry's: with only ``reference`` listed, a CPU call runs there."""
    q, k, v = make_qkv(1, 128, 2, 16)
    p = solattn.validation.validate(q, k, v)
    assert dispatch.choose(p).name == "sdpa"
    monkeypatch.setitem(devices.DEVICES, "cpu", dataclasses.replace(devices.DEVICES["cpu"], priority=("reference",)))
    assert dispatch.choose(p).name == "reference"


def test_built_in_facts():
    """Today's facts, each from the table: the order of preference, the priorities, the XPU top-k
    workaround, fp32 masks only on the CPU, Triton compiled for CUDA only."""
    assert list(devices.DEVICES) == ["cuda", "xpu", "mps", "cpu"]
    assert devices.accelerator_types() == ["cuda", "xpu", "mps"]
    assert {t: d.priority for t, d in devices.DEVICES.items()} == {
        "cuda": ("triton", "sdpa", "reference"), "xpu": ("flex", "sdpa", "triton", "reference"),
        "mps": ("sdpa", "reference"), "cpu": ("flex", "sdpa", "reference")}
    assert devices.entry("hpu").priority == ("sdpa", "reference")       # a type not in the table
    assert [t for t, d in devices.DEVICES.items() if d.topk == "sort"] == ["xpu"]
    assert [t for t, d in devices.DEVICES.items() if d.fp32_masks] == ["cpu"]
    assert [t for t, d in devices.DEVICES.items() if d.triton] == ["cuda"]
    assert [t for t, d in devices.DEVICES.items() if d.allocator_stats] == ["cuda", "xpu"]
    assert all(d.known_broken for t, d in devices.DEVICES.items() if t in ("cuda", "xpu"))
    for dt in (torch.bfloat16, torch.float16):
        assert masks.mask_dtype(torch.device("cpu"), dt) == torch.float32
        assert masks.mask_dtype(torch.device("cuda"), dt) == dt
        assert masks.mask_dtype(torch.device("privateuseone"), dt) == dt


def test_entry_refuses_an_unknown_topk_method():
    with pytest.raises(ValueError, match=r"'topk' received 'heap'.*\('topk', 'sort'\)"):
        devices.DeviceType("hpu", topk="heap")


def test_backend_declares_automatic():
    """Every backend answers ``automatic`` (the base class: True); flex overrides it."""
    for name in dispatch.registered():
        assert isinstance(dispatch.get_backend(name).automatic("cpu"), bool)
    assert dispatch.get_backend("reference").automatic("cuda") is True


def test_info_prints_the_known_broken_notes(fake_device, monkeypatch, capsys):
    """``python -m solattn info`` shows an entry's known-broken notes under its present device type."""
    from solattn import cli
    monkeypatch.setitem(devices.DEVICES, "hpu", dataclasses.replace(devices.DEVICES["hpu"],
                                                                    known_broken=("torch.sort is slow",)))
    assert cli.info(None) == 0
    out = capsys.readouterr().out
    assert "devices: cpu, hpu:0, hpu:1" in out
    assert "backends on hpu (priority: reference > sdpa)" in out and "known on hpu: torch.sort is slow" in out
    assert "known on cpu" not in out


def test_init_from_env_takes_the_first_present_device_with_collectives(fake_device, monkeypatch):
    """Without ``device_type``, ``init_from_env`` takes the first present device type of the table
    whose entry names a collectives backend: the fake ``hpu`` names none, so the CPU (Gloo)."""
    import torch.distributed as dist
    assert group.PROCESS_GROUP_BACKENDS == {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert group.init_from_env() == (0, 1, torch.device("cpu")) and seen == ["gloo"]
