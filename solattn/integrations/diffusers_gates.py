"""FastH3's gate projections (``to_gate_compress``) for diffusers' MiniMax-H3: reading them from a
state dict or safetensors files, checking them against the model, and building the modules.

A FastH3 checkpoint (FastVideo's VSA-trained MiniMax-H3) carries one bias-free linear layer per
transformer block, ``hidden_size -> heads * head_dim``, whose output gates VSA's coarse branch.
Two namings are accepted, with any leading prefix (``transformer.``, ``model.diffusion_model.``):

- diffusers / FastVideo: ``transformer_blocks.{i}.attn.to_gate_compress.weight``
- ComfyUI:              ``blocks.{i}.attn.to_gate_compress.weight``

Only the gate keys are read from safetensors files (the rest of a 100 GB checkpoint is never
loaded). Nothing here imports diffusers; accelerate is imported only for a model whose weights
accelerate's sequential offload already moved off the module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

GATE_ATTR = "to_gate_compress"
_KEY = re.compile(r"^(?:.*\.)?(?:transformer_blocks|blocks)\.(\d+)\.attn\.to_gate_compress\.(weight|bias)$")


def _fail(arg: str, received: str, allowed: str, exc=ValueError):
    raise exc(f"enable_fasth3: argument '{arg}' received {received}; allowed: {allowed}")


def diffusers_key(index: int, param: str = "weight") -> str:
    """The diffusers-style name of block ``index``'s gate parameter."""
    return f"transformer_blocks.{index}.attn.{GATE_ATTR}.{param}"


def _safetensors_files(source) -> List[Path]:
    """The safetensors files a path (file or folder) or a sequence of paths names."""
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.safetensors"))
            if not found and (p / "transformer").is_dir():      # a pipeline folder: its transformer
                found = sorted((p / "transformer").glob("*.safetensors"))
            if not found:
                _fail("gates", f"the folder {str(p)!r}", "a folder holding *.safetensors files (the FastH3 "
                      "transformer), a file, a list of files, or a state dict")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            _fail("gates", repr(str(p)), "an existing safetensors file or folder, a list of them, or a state dict")
    return files


def read_matching(files, pattern: "re.Pattern") -> Tuple[Dict[str, torch.Tensor], int]:
    """The tensors of the safetensors ``files`` whose keys match ``pattern`` (lazily: only those are
    loaded) and the number of keys seen."""
    from safetensors import safe_open

    tensors, seen = {}, 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            keys = list(handle.keys())
            seen += len(keys)
            for key in keys:
                if pattern.match(key):
                    tensors[key] = handle.get_tensor(key)
    return tensors, seen


def gate_tensors(gates) -> Tuple[Dict[str, torch.Tensor], int, List[str]]:
    """``(gate tensors by key, number of keys looked at, a few of the other keys)`` of ``gates``."""
    if isinstance(gates, Mapping):
        bad = [k for k, v in gates.items() if _KEY.match(str(k)) and not isinstance(v, torch.Tensor)]
        if bad:
            _fail("gates", f"a mapping whose {bad[0]!r} is {type(gates[bad[0]]).__name__}",
                  "a state dict of tensors", TypeError)
        matched = {str(k): v for k, v in gates.items() if _KEY.match(str(k))}
        others = [str(k) for k in gates if not _KEY.match(str(k))][:3]
        return matched, len(gates), others
    if isinstance(gates, (str, os.PathLike)) or (isinstance(gates, (list, tuple)) and gates
                                                  and all(isinstance(p, (str, os.PathLike)) for p in gates)):
        tensors, seen = read_matching(_safetensors_files(gates), _KEY)
        return tensors, seen, []
    _fail("gates", f"{type(gates).__name__}", "a state dict, a safetensors file or folder, a list of "
          "safetensors files, or None (no gates: the fine stage only)", TypeError)


def checked_gates(gates, num_blocks: int, hidden: int, inner: int) -> Dict[int, Dict[str, torch.Tensor]]:
    """Block index -> ``{"weight": (inner, hidden)[, "bias": (inner,)]}``, checked against the model
    before anything is changed; a clear error names every missing or mismatched key."""
    tensors, seen, others = gate_tensors(gates)
    by_block: Dict[int, Dict[str, Tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        index, param = _KEY.match(key).groups()
        slot = by_block.setdefault(int(index), {})
        if param in slot:
            _fail("gates", f"two keys for block {index}'s gate {param}: {slot[param][0]!r} and {key!r}",
                  "one key per block (diffusers or ComfyUI naming, not both)")
        slot[param] = (key, value)
    extra = sorted(i for i in by_block if i >= num_blocks)
    if extra:
        _fail("gates", f"gate keys for blocks {extra} (e.g. {by_block[extra[0]]['weight'][0]!r})"
              if "weight" in by_block[extra[0]] else f"gate keys for blocks {extra}",
              f"gates for the model's {num_blocks} transformer blocks (0..{num_blocks - 1}): "
              f"is this checkpoint for another model size?")
    missing = [diffusers_key(i) for i in range(num_blocks) if "weight" not in by_block.get(i, {})]
    if missing:
        hint = (f"no key matched among the {seen} keys given"
                + (f" (e.g. {', '.join(repr(k) for k in others)})" if others else "")
                + ": is this a FastH3 (VSA-trained) checkpoint? The base MiniMax-H3 has no gates; "
                  "pass gates=None to run the sparse fine stage without the coarse branch"
                if not tensors else f"{len(tensors)} gate keys were found")
        raise ValueError(f"enable_fasth3: argument 'gates' lacks the gate projection of {len(missing)} of "
                         f"{num_blocks} blocks; missing keys: {', '.join(missing)} (ComfyUI's "
                         f"'blocks.{{i}}.attn.{GATE_ATTR}.weight' naming is accepted too, with any prefix); "
                         f"{hint}")
    with_bias = sorted(i for i in by_block if "bias" in by_block[i])
    if with_bias and len(with_bias) != num_blocks:
        lacking = [diffusers_key(i, "bias") for i in range(num_blocks) if i not in with_bias]
        _fail("gates", f"gate biases for {len(with_bias)} of {num_blocks} blocks; missing keys: {', '.join(lacking)}",
              "a bias for every block or for none")
    out = {}
    for i in range(num_blocks):
        entry = {}
        for param, shape in (("weight", (inner, hidden)), ("bias", (inner,))):
            if param not in by_block[i]:
                continue
            key, value = by_block[i][param]
            if tuple(value.shape) != shape or not value.is_floating_point():
                _fail("gates", f"{key!r} of shape {tuple(value.shape)} and dtype {value.dtype}",
                      f"a float tensor of shape {shape} (heads * head_dim, hidden_size) for this model")
            entry[param] = value
        out[i] = entry
    return out


def _sequential_offload_device(module: nn.Module) -> Optional[torch.device]:
    """The execution device of accelerate's per-module offload hook on ``module``, when its weights
    were moved off it (accelerate's ``cpu_offload``, diffusers' sequential CPU offload); else None."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    for h in hooks:
        if getattr(h, "offload", False) and getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    return None


def refuse_group_offload(transformer: nn.Module, caller: str = "enable_fasth3"):
    """diffusers' group offloading records the tensors it moves when it is enabled: a gate added
    afterwards would stay behind, so refuse (enable FastH3 first, then the offloading)."""
    for name, module in transformer.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.get_hook("group_offloading") is not None:
            raise RuntimeError(f"{caller}: diffusers group offloading is active on {name or 'the model'}; "
                               f"call {caller} before enable_group_offload so the gates are offloaded too")


def build_gate(attn: nn.Module, tensors: Dict[str, torch.Tensor], reference: torch.Tensor,
               caller: str = "enable_fasth3") -> nn.Linear:
    """A ``to_gate_compress`` linear layer holding ``tensors``, on ``reference``'s device and dtype
    (the attention's own projection weight), so it moves with the module under every offload.

    Weights already moved off the module by accelerate's sequential offload (the reference is a
    ``meta`` tensor): the gate gets the same kind of hook, so it is loaded for each call too."""
    weight = tensors["weight"]
    offload_device = _sequential_offload_device(attn.to_q) if reference.device.type == "meta" else None
    device = torch.device("cpu") if reference.device.type == "meta" else reference.device
    gate = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in tensors, device="meta")
    gate.weight = nn.Parameter(weight.to(device=device, dtype=reference.dtype),
                               requires_grad=reference.requires_grad)
    if "bias" in tensors:
        gate.bias = nn.Parameter(tensors["bias"].to(device=device, dtype=reference.dtype),
                                 requires_grad=reference.requires_grad)
    if reference.device.type == "meta":
        if offload_device is None:
            raise RuntimeError(f"{caller}: the attention weights are on the meta device and no "
                               "accelerate offload hook says where they run; load the model first")
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module
        add_hook_to_module(gate, AlignDevicesHook(execution_device=offload_device, offload=True))
    return gate
