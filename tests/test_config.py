"""Tuning as scoped configuration: values per kind, process-wide or per block, in cache keys."""

from __future__ import annotations

import asyncio
import threading

import pytest

from solattn import config
from solattn.backends.triton import BackwardConfig, KernelConfig, TritonTuning
from solattn.routing.fused import FusedPlanTuning


@pytest.fixture(autouse=True)
def _defaults():
    config.reset_tuning()
    yield
    config.reset_tuning()


def test_defaults_process_wide_and_scoped_values():
    assert config.current_tuning(TritonTuning) == TritonTuning() and config.tuning_key() == ()
    wide = TritonTuning(tma_min_programs=1)
    config.set_tuning(wide)
    assert config.current_tuning(TritonTuning) is wide
    inner, other = TritonTuning(tma_in_graphs=False), FusedPlanTuning(dot_precision="ieee")
    with config.tuning(inner, other):
        assert config.current_tuning(TritonTuning) is inner and config.current_tuning(FusedPlanTuning) is other
        with config.tuning(TritonTuning(forward=KernelConfig(8, 2))):
            assert config.current_tuning(TritonTuning).forward == KernelConfig(8, 2)
            assert config.current_tuning(FusedPlanTuning) is other          # other kinds untouched
        assert config.current_tuning(TritonTuning) is inner
    assert config.current_tuning(TritonTuning) is wide
    config.reset_tuning(TritonTuning)
    assert config.current_tuning(TritonTuning) == TritonTuning()


def test_the_cache_key_follows_the_settings_in_force():
    base = config.tuning_key()
    with config.tuning(TritonTuning(tma_min_programs=0)):
        scoped = config.tuning_key()
        with config.tuning(FusedPlanTuning(block_i=32)):
            both = config.tuning_key()
    assert len({base, scoped, both}) == 3 and config.tuning_key() == base
    with config.tuning(TritonTuning(tma_min_programs=0)):
        assert config.tuning_key() == scoped                              # equal values, equal keys
    hash(both)


def test_a_scope_binds_only_its_own_thread_and_task():
    seen = []
    with config.tuning(TritonTuning(tma_min_programs=7)):
        worker = threading.Thread(target=lambda: seen.append(config.current_tuning(TritonTuning)))
        worker.start()
        worker.join()

    async def scoped():
        with config.tuning(TritonTuning(tma_min_programs=9)):
            await asyncio.sleep(0)
            return config.current_tuning(TritonTuning).tma_min_programs

    async def plain():
        await asyncio.sleep(0)
        return config.current_tuning(TritonTuning).tma_min_programs

    async def main():
        return await asyncio.gather(scoped(), plain())

    assert seen == [TritonTuning()] and asyncio.run(main()) == [9, 4096]


@pytest.mark.parametrize("make,exc,pattern", [
    (lambda: TritonTuning(tma_min_programs=-1), ValueError, r"'tma_min_programs' received -1"),
    (lambda: TritonTuning(tma_in_graphs=1), TypeError, r"'tma_in_graphs' received 1"),
    (lambda: TritonTuning(forward=(4, 3)), TypeError, r"'forward' received tuple"),
    (lambda: TritonTuning(backward=None), TypeError, r"'backward' received NoneType"),
    (lambda: BackwardConfig(dq_warps=3), ValueError, r"'dq_warps' received 3; allowed: 2, 4, 8"),
    (lambda: BackwardConfig(dkdv_stages=0), ValueError, r"'dkdv_stages' received 0; allowed: 1, 2, 3, 4, 5"),
    (lambda: FusedPlanTuning(dot_precision="tf16"), ValueError, r"'dot_precision' received 'tf16'"),
    (lambda: FusedPlanTuning(block_i=0), ValueError, r"'block_i' received 0; allowed: None or an int >= 1"),
    (lambda: FusedPlanTuning(rb=2.0), TypeError, r"'rb' received 2.0 of type float"),
    (lambda: FusedPlanTuning(scores_here=1), TypeError, r"'scores_here' received 1"),
    (lambda: config.tuning(KernelConfig()).__enter__(), TypeError, r"argument 0 received KernelConfig"),
    (lambda: config.set_tuning(TritonTuning(), TritonTuning()), ValueError, r"two values of one kind"),
])
def test_bad_settings_are_refused_naming_the_argument(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_fused_plan_overrides_are_the_fields_set():
    assert FusedPlanTuning().overrides() == {}
    assert FusedPlanTuning(block_i=32, scores_here=False, pool_dot="tf32", dot_precision="ieee").overrides() == \
        {"block_i": 32, "scores_here": False, "pool_dot": "tf32"}
