"""The pipelined exchange (head groups) on 4 and 7 Gloo processes against one device.

A worker runs every case of ``CASES`` on its shard with each ``head_groups`` value of the case
and saves output and gradient shards; ``check_exact`` (test_distributed.py) compares them with
one device: bit for bit with the single-device function on the same head slices, and within
rounding with the single-device call on all heads at once. Both runs take over 30 s on a busy
2-core machine (4 and 7 processes), hence ``slow``; test_distributed.py checks the pipelined
exchange on 2 processes in the fast run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # worker: import this checkout's package and the harness next to it
    sys.path.insert(0, str(ROOT))

import solattn.distributed as sd  # noqa: E402
from tests.distributed.test_distributed import _launch, call, case_inputs, check_exact  # noqa: E402

RUN_TIMEOUT_S = 300

CASES = {
    4: {
        # 12 heads, 3 per rank: one exchange, groups of 2+1, of one head each, and more groups
        # than heads (capped); ragged last shard (301 = 76 + 76 + 76 + 73); every gradient
        "sol_ragged_grad": dict(kind="sol", B=1, T=301, H=12, D=16, gate=True, key_bias="float2d", grad=True,
                                groups=[1, 2, 3, 5], kwargs=dict(topk_ratio=0.3, tail=True)),
        "sol_bf16_tau": dict(kind="sol", B=2, T=260, H=8, D=16, dtype=torch.bfloat16, key_bias="bool2d",
                             groups=[1, 2], kwargs=dict(tau=0.5, tail=True, sink_blocks=(0, 1))),
        "sol_mixed_dtypes": dict(kind="sol", B=1, T=200, H=8, D=32, dtype=torch.bfloat16, gate=True,
                                 gate_dtype=torch.float32, grad=True, groups=[2],
                                 kwargs=dict(topk_ratio=0.25)),
        "vsa_prefix_grad": dict(kind="vsa", B=1, T=127, H=8, D=16, gate=True, grad=True, groups=[1, 2],
                                kwargs=dict(grid=(3, 6, 5), prefix_len=[20, 17], topk=2)),
    },
    # 56 heads over 7 ranks (8 per rank, not a power-of-two group size), ragged 150 = 6 x 22 + 18
    7: {
        "heads56": dict(kind="sol", B=1, T=150, H=56, D=8, gate=True, key_bias="float1d", grad=True,
                        groups=[1, 3, 8], kwargs=dict(topk_ratio=0.4, tail=True)),
    },
}


def worker(world, rank, init_file, outdir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    for name, case in CASES[world].items():
        q, k, v, gate, kb, block_len, w = case_inputs(case)
        lens = sd.shard_lengths(case["T"], world)
        sl = slice(sum(lens[:rank]), sum(lens[:rank + 1]))
        for G in case["groups"]:
            shards = [None if x is None else x[:, sl].clone().requires_grad_(bool(case.get("grad")))
                      for x in (q, k, v, gate)]
            bias = kb
            if case.get("grad") and kb is not None and kb.dtype.is_floating_point:
                bias = kb.clone().requires_grad_()
            out = call(sd, case, *shards, bias, block_len, head_groups=G, timeout=60)
            res = {"out": out.detach()}
            if case.get("grad"):
                (out.float() * w[:, sl]).sum().backward()
                res["grads"] = [None if x is None else x.grad for x in shards]
                res["key_bias_grad"] = None if bias is None or not bias.requires_grad else bias.grad
            torch.save(res, os.path.join(outdir, f"{name}.{G}.{rank}.pt"))
    sd.destroy_and_exit(0)


def _results(world):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        _launch(lambda r: [__file__, "--worker", str(world), str(r), init_file, tmp], RUN_TIMEOUT_S,
                world=world)
        return {(name, G): [torch.load(os.path.join(tmp, f"{name}.{G}.{r}.pt")) for r in range(world)]
                for name, case in CASES[world].items() for G in case["groups"]}


@pytest.fixture(scope="module")
def results4():
    return _results(4)


@pytest.fixture(scope="module")
def results7():
    return _results(7)


def check(results, world, name):
    case = CASES[world][name]
    for G in case["groups"]:
        check_exact(case, results[(name, G)], world, G)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES[4]))
def test_pipelined_equals_one_device_4_ranks(results4, name):
    check(results4, 4, name)


@pytest.mark.slow
def test_56_heads_over_7_ranks(results7):
    check(results7, 7, "heads56")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker WORLD RANK INIT_FILE OUTDIR (started by pytest)")
