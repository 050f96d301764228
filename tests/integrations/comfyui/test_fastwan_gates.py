"""Where the ComfyUI node finds FastWan's gates (solattn.integrations.comfyui.wan), without a
ComfyUI: the file a loader recorded on the ModelPatcher (``cached_patcher_init``) and, when no gates
are found, a reason the user can act on."""

from types import SimpleNamespace

import torch

from tests.support.fastwan_tiny import SHAPE, fastwan_state_dict

from solattn.integrations import fastwan
from solattn.integrations.comfyui import wan

DIM = SHAPE["heads"] * SHAPE["head_dim"]


def load_diffusion_model(unet_path, model_options={}):          # named as ComfyUI's loaders are
    raise AssertionError("not called")


def load_checkpoint_guess_config(ckpt_path, *args):
    raise AssertionError("not called")


class Patcher:
    """What the node reads of a ModelPatcher: ``cached_patcher_init`` when the loader set it."""

    def __init__(self, init=None):
        if init is not None:
            self.cached_patcher_init = init


def diffusion_model():
    return SimpleNamespace(blocks=[None] * SHAPE["blocks"], dim=DIM, num_heads=SHAPE["heads"])


def write(path, prefix="", gates=True):
    from safetensors.torch import save_file
    sd = fastwan_state_dict(**SHAPE, gate=gates)
    save_file({prefix + fastwan.comfyui_key(k): v for k, v in sd.items()}, str(path))
    return str(path)


def test_a_loader_that_records_no_file_is_named_as_the_reason():
    for patcher in (Patcher(), Patcher((lambda *a: None, ("somewhere.safetensors",)))):
        assert wan.model_file(patcher) is None
        assert wan.resolve_gates(patcher, diffusion_model(), wan.FROM_MODEL_FILE) is None
        reason = wan.no_gates_reason(patcher, wan.FROM_MODEL_FILE)
        assert "did not record which file it loaded" in reason and "choose its converted file in vsa_gates" in reason


def test_the_file_of_load_diffusion_model_or_load_checkpoint_gives_the_gates(tmp_path):
    unet = write(tmp_path / "fastwan.safetensors")
    ckpt = write(tmp_path / "fastwan_all_in_one.safetensors", prefix="model.diffusion_model.")
    want = fastwan_state_dict(**SHAPE)["blocks.1.to_gate_compress.weight"]
    for patcher in (Patcher((load_diffusion_model, (unet, {}))),
                    Patcher((load_checkpoint_guess_config, (ckpt, False, False, False, None, True, {}, {}), 0))):
        gates = wan.resolve_gates(patcher, diffusion_model(), wan.FROM_MODEL_FILE)
        assert gates is not None and torch.equal(gates.tensors[1]["weight"], want)


def test_a_recorded_file_without_gates_is_named_as_the_reason(tmp_path):
    base = write(tmp_path / "wan_base.safetensors", gates=False)
    patcher = Patcher((load_diffusion_model, (base, {})))
    assert wan.resolve_gates(patcher, diffusion_model(), wan.FROM_MODEL_FILE) is None
    reason = wan.no_gates_reason(patcher, wan.FROM_MODEL_FILE)
    assert reason.startswith("wan_base.safetensors has no to_gate_compress keys"), reason
    assert wan.no_gates_reason(patcher, wan.NO_GATES) == "vsa_gates is 'none'"


def test_gate_copies_are_released_between_runs(tmp_path):
    unet = write(tmp_path / "fastwan.safetensors")
    gates = wan.resolve_gates(Patcher((load_diffusion_model, (unet, {}))), diffusion_model(), wan.FROM_MODEL_FILE)
    x = torch.randn(1, 5, DIM, dtype=torch.bfloat16)
    sd = fastwan_state_dict(**SHAPE)
    want = torch.nn.functional.linear(x.double(), sd["blocks.0.to_gate_compress.weight"].double(),
                                      sd["blocks.0.to_gate_compress.bias"].double())
    first = gates.project(0, x)
    assert first.dtype == torch.bfloat16 and float((first.double() - want).norm() / want.norm()) < 1e-2
    assert gates._cast                                   # kept for the rest of the run
    gates.release()                                      # the run's cleanup
    assert not gates._cast
    assert torch.equal(gates.project(0, x), first)      # the next run copies them again
