"""solattn.distributed's argument checks and helpers that need no process group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import solattn.distributed as sd
from solattn.distributed.agree import check_local
from solattn.distributed.exchange import head_groups


def test_shard_lengths():
    assert sd.shard_lengths(10, 4) == [3, 3, 3, 1]
    assert sd.shard_lengths(9, 4) == [3, 3, 3, 0]
    assert sd.shard_lengths(37296, 7) == [5328] * 7
    assert sd.shard_lengths(5, 1) == [5]
    with pytest.raises(ValueError, match="'world_size' received 0"):
        sd.shard_lengths(5, 0)


def test_errors_without_a_process_group():
    q = torch.randn(1, 64, 2, 16)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        sd.sol_attn(q, q, q)
    with pytest.raises(RuntimeError, match="destroy_and_exit: .*init_process_group"):
        sd.destroy_and_exit(0)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(device_type="mps"), ValueError, r"'device_type' received 'mps'; allowed: None, 'cuda', 'xpu', 'cpu'"),
    (dict(device_type=0), TypeError, r"'device_type' received 0"),
    (dict(device_type="cpu", timeout=60), TypeError, r"'timeout' received 60 of type int"),
])
def test_init_from_env_argument_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        sd.init_from_env(**kwargs)
    assert not torch.distributed.is_initialized()          # raised before starting anything


def test_gate_dtype_message_names_the_dtypes_allowed():
    q = torch.randn(1, 64, 2, 16)
    with pytest.raises(TypeError, match=r"'coarse_gate' received .*float64.*allowed: .*"
                                        r"torch\.bfloat16, torch\.float16 or torch\.float32"):
        check_local("sol_attn", q, q, q, q.double(), "coarse_gate", 1)


def test_destroy_and_exit_argument_error():
    with pytest.raises(TypeError, match=r"'code' received 1.5 of type float; allowed: an int"):
        sd.destroy_and_exit(1.5)


def test_head_groups():
    assert head_groups(3, 1) == [(0, 3)]
    assert head_groups(3, 2) == [(0, 2), (2, 3)]
    assert head_groups(3, 5) == [(0, 1), (1, 2), (2, 3)]
    assert head_groups(28, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25), (25, 28)]


@pytest.mark.parametrize("timeout, exc, pattern", [
    (0, ValueError, r"'timeout' received 0; allowed: None .* positive"),
    ("3", TypeError, r"'timeout' received '3' of type str"),
    (float("nan"), ValueError, r"'timeout' received nan"),
])
def test_timeout_argument_errors(timeout, exc, pattern):
    from solattn.distributed.group import _check_timeout

    with pytest.raises(exc, match=pattern):
        _check_timeout("solattn.distributed.sol_attn", timeout)
    assert _check_timeout("f", 2.5) == timedelta(seconds=2.5)
    assert _check_timeout("f", None) is None


@pytest.mark.parametrize("groups, exc, pattern", [
    (0, ValueError, r"'head_groups' received 0; allowed: None or an int >= 1"),
    (2.0, TypeError, r"'head_groups' received 2.0 of type float"),
    (True, TypeError, r"'head_groups' received True of type bool"),
])
def test_head_groups_argument_errors(groups, exc, pattern):
    from solattn.distributed.ops import _check_groups
    from solattn.distributed.pipeline import DEFAULT_HEAD_GROUPS

    with pytest.raises(exc, match=pattern):
        _check_groups("solattn.distributed.sol_attn", groups)
    assert _check_groups("f", None) == DEFAULT_HEAD_GROUPS and _check_groups("f", 3) == 3


def test_value_checksum_follows_in_place_writes():
    from solattn.distributed.agree import checksum

    t = torch.randn(100)
    first = checksum(t)
    assert checksum(t) == first == checksum(t.clone())
    t[3] += 1                                       # bumps the version: computed again
    assert checksum(t) != first and checksum(t) == checksum(t.clone())
    assert checksum(torch.tensor([1.0, 2.0])) != checksum(torch.tensor([2.0, 1.0]))   # order counts
    with torch.inference_mode():
        inf = torch.ones(10)                        # no version counter: never cached
    assert checksum(inf) == checksum(torch.ones(10))
