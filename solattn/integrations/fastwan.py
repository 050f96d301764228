"""FastWan (FastVideo's VSA-trained Wan2.1 / Wan2.2) checkpoints: their gate projections, and a
converter to ComfyUI's Wan format that keeps them.

A FastWan transformer is a Wan transformer plus one ``to_gate_compress`` linear layer per block,
``dim -> dim`` with a bias (``heads * head_dim == dim``), applied to the same modulated hidden
states as q, k and v; its output, reshaped to ``(B, S, heads, head_dim)``, gates VSA's coarse
branch as is. FastWan's diffusers-format files name the gate ``blocks.{i}.to_gate_compress``
beside diffusers' ``blocks.{i}.attn1.to_q`` and the rest. Accepted here, with any leading prefix:

- FastWan / FastVideo: ``blocks.{i}.to_gate_compress.{weight,bias}``
- diffusers module naming: ``blocks.{i}.attn1.to_gate_compress.{weight,bias}``
- ComfyUI's Wan naming (what :func:`convert_to_comfyui` writes):
  ``blocks.{i}.self_attn.to_gate_compress.{weight,bias}``

LTX-2.3 uses the name ``to_gate_compress`` for an unrelated per-head gate of shape
``(heads, head_dim)``: the shape decides, and such a tensor is refused with its key named.

Command line (reads only safetensors; writes one ComfyUI-format file)::

    python -m solattn.integrations.fastwan to-comfyui FastWan2.1-T2V-1.3B-Diffusers/transformer \\
        ComfyUI/models/diffusion_models/fastwan2.1_t2v_1.3b.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

GATE_ATTR = "to_gate_compress"
#: a Wan gate key in any of the three namings, any prefix: (block index, "weight" | "bias")
GATE_KEY = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.(?:attn1\.|self_attn\.)?to_gate_compress\.(weight|bias)$")

#: diffusers' Wan key fragments -> ComfyUI's (the original Wan release's) names, in the order tried.
#: Facts of the two formats; norm2 (diffusers' affine cross-attention norm) is ComfyUI's norm3.
_TO_COMFY = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^condition_embedder\.image_embedder\.pos_embed$", "img_emb.emb_pos"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^patch_embedding\.", "patch_embedding."),
    (r"^blocks\.(\d+)\.(?:attn1\.)?to_gate_compress\.", r"blocks.\1.self_attn.to_gate_compress."),
    (r"^blocks\.(\d+)\.attn1\.to_q\.", r"blocks.\1.self_attn.q."),
    (r"^blocks\.(\d+)\.attn1\.to_k\.", r"blocks.\1.self_attn.k."),
    (r"^blocks\.(\d+)\.attn1\.to_v\.", r"blocks.\1.self_attn.v."),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"^blocks\.(\d+)\.attn1\.norm_q\.", r"blocks.\1.self_attn.norm_q."),
    (r"^blocks\.(\d+)\.attn1\.norm_k\.", r"blocks.\1.self_attn.norm_k."),
    (r"^blocks\.(\d+)\.attn2\.to_q\.", r"blocks.\1.cross_attn.q."),
    (r"^blocks\.(\d+)\.attn2\.to_k\.", r"blocks.\1.cross_attn.k."),
    (r"^blocks\.(\d+)\.attn2\.to_v\.", r"blocks.\1.cross_attn.v."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"^blocks\.(\d+)\.attn2\.norm_q\.", r"blocks.\1.cross_attn.norm_q."),
    (r"^blocks\.(\d+)\.attn2\.norm_k\.", r"blocks.\1.cross_attn.norm_k."),
    (r"^blocks\.(\d+)\.attn2\.add_k_proj\.", r"blocks.\1.cross_attn.k_img."),
    (r"^blocks\.(\d+)\.attn2\.add_v_proj\.", r"blocks.\1.cross_attn.v_img."),
    (r"^blocks\.(\d+)\.attn2\.norm_added_k\.", r"blocks.\1.cross_attn.norm_k_img."),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
]
_TO_COMFY = [(re.compile(a), b) for a, b in _TO_COMFY]


def _fail(caller: str, arg: str, received: str, allowed: str, exc=ValueError):
    raise exc(f"{caller}: argument '{arg}' received {received}; allowed: {allowed}")


def fastwan_key(index: int, param: str = "weight") -> str:
    """The name FastWan's own files give block ``index``'s gate parameter."""
    return f"blocks.{index}.{GATE_ATTR}.{param}"


def safetensors_files(source, caller: str = "fastwan") -> List[Path]:
    """The safetensors files a path (file or folder; a pipeline folder: its ``transformer``) or a
    sequence of paths names."""
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.safetensors"))
            if not found and (p / "transformer").is_dir():
                found = sorted((p / "transformer").glob("*.safetensors"))
            if not found:
                _fail(caller, "gates", f"the folder {str(p)!r} (no *.safetensors in it or in its 'transformer')",
                      "a FastWan transformer folder, a pipeline folder holding one, a safetensors file, a list "
                      "of them, or a state dict")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            _fail(caller, "gates", repr(str(p)), "an existing safetensors file or folder, a list of them, or a "
                                                 "state dict")
    return files


def gate_tensors(gates, caller: str = "fastwan") -> Tuple[Dict[str, torch.Tensor], int]:
    """``(gate tensors by key, number of keys looked at)`` of a state dict or safetensors file(s);
    from files only the gate keys are loaded."""
    if isinstance(gates, Mapping):
        out = {}
        for key, value in gates.items():
            if GATE_KEY.match(str(key)):
                if not isinstance(value, torch.Tensor):
                    _fail(caller, "gates", f"a mapping whose {key!r} is a {type(value).__name__}",
                          "a state dict of tensors", TypeError)
                out[str(key)] = value
        return out, len(gates)
    if isinstance(gates, (str, os.PathLike)) or (isinstance(gates, (list, tuple)) and gates and all(
            isinstance(p, (str, os.PathLike)) for p in gates)):
        from .diffusers_gates import read_matching
        return read_matching(safetensors_files(gates, caller), GATE_KEY)
    _fail(caller, "gates", type(gates).__name__, "a FastWan transformer folder, a safetensors file, a list of "
                                                 "them, a state dict, or None", TypeError)


def checked_gates(gates, num_blocks: int, dim: int, heads: int, caller: str = "fastwan",
                  required: bool = True) -> Optional[Dict[int, Dict[str, torch.Tensor]]]:
    """Block index -> ``{"weight": (dim, dim)[, "bias": (dim,)]}`` from ``gates``, checked against
    a Wan model with ``num_blocks`` blocks of width ``dim`` and ``heads`` heads before anything is
    changed. A missing, duplicated or misshapen gate (an LTX-style ``(heads, head_dim)`` one
    included) is refused with its key named. With ``required=False`` a source with no gate key at
    all gives None (a Wan checkpoint that is not VSA-trained)."""
    tensors, seen = gate_tensors(gates, caller)
    if not tensors and not required:
        return None
    by_block: Dict[int, Dict[str, Tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        index, param = GATE_KEY.match(key).groups()
        slot = by_block.setdefault(int(index), {})
        if param in slot:
            _fail(caller, "gates", f"two keys for block {index}'s gate {param}: {slot[param][0]!r} and {key!r}",
                  "one key per block and parameter")
        slot[param] = (key, value)
    extra = sorted(i for i in by_block if i >= num_blocks)
    if extra:
        key = next(iter(by_block[extra[0]].values()))[0]
        _fail(caller, "gates", f"a gate for block {extra[0]} ({key!r})",
              f"gates for the model's {num_blocks} blocks (0..{num_blocks - 1}): is this checkpoint for "
              f"another model size?")
    missing = [fastwan_key(i) for i in range(num_blocks) if "weight" not in by_block.get(i, {})]
    if missing:
        hint = (f"no gate key among the {seen} keys given: is this a FastWan (VSA-trained) checkpoint? A base "
                f"Wan checkpoint has no gates" if not tensors else f"{len(tensors)} gate keys were found")
        raise ValueError(f"{caller}: argument 'gates' lacks the gate projection of {len(missing)} of {num_blocks} "
                         f"blocks; missing keys: {', '.join(missing)} (the 'blocks.{{i}}.attn1.' and "
                         f"'blocks.{{i}}.self_attn.' namings are accepted too, with any prefix); {hint}")
    with_bias = [i for i in range(num_blocks) if "bias" in by_block[i]]
    if with_bias and len(with_bias) != num_blocks:
        lacking = [fastwan_key(i, "bias") for i in range(num_blocks) if i not in with_bias]
        _fail(caller, "gates", f"gate biases for {len(with_bias)} of {num_blocks} blocks; missing keys: "
                               f"{', '.join(lacking)}", "a bias for every block or for none")
    head_dim = dim // heads
    out = {}
    for i in range(num_blocks):
        entry = {}
        for param, shape in (("weight", (dim, dim)), ("bias", (dim,))):
            if param not in by_block[i]:
                continue
            key, value = by_block[i][param]
            got = tuple(value.shape)
            if got != shape or not value.is_floating_point():
                ltx = (" (a per-head gate of shape (heads, head_dim), as LTX-2.3 names 'to_gate_compress': "
                       "not a FastWan VSA gate)" if got == (heads, head_dim) else "")
                _fail(caller, "gates", f"{key!r} of shape {got} and dtype {value.dtype}{ltx}",
                      f"a float tensor of shape {shape} (FastWan's Linear(dim, dim) gate, dim {dim} = "
                      f"{heads} heads x {head_dim})")
            entry[param] = value
        out[i] = entry
    return out


def comfyui_key(key: str) -> str:
    """The ComfyUI (original Wan) name of one key of a diffusers / FastWan Wan transformer;
    keys already in that naming are returned unchanged."""
    for pattern, replacement in _TO_COMFY:
        new, n = pattern.subn(replacement, key)
        if n:
            return new
    return key


def convert_to_comfyui(source, destination, dtype: Optional[torch.dtype] = None) -> Dict[str, int]:
    """Write the FastWan transformer ``source`` (its diffusers-format folder, file(s) or a state
    dict) as one safetensors file in ComfyUI's Wan format, gates included as
    ``blocks.{i}.self_attn.to_gate_compress.*``. ComfyUI's "Load Diffusion Model" loads it as a
    Wan model (it sets the gate keys aside); solattn's node reads the gates from the same file.
    ``dtype``: cast floating tensors (e.g. ``torch.bfloat16``); default: kept.
    Returns counts: ``{"tensors": ..., "gates": ...}``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    caller = "convert_to_comfyui"
    if isinstance(source, Mapping):
        sd = dict(source)
    else:
        sd = {}
        for path in safetensors_files(source, caller):
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    sd[key] = handle.get_tensor(key)
    if "head.modulation" in sd or any(k.endswith(".self_attn.q.weight") for k in sd):
        _fail(caller, "source", "a checkpoint already in ComfyUI's Wan naming ('head.modulation')",
              "a FastWan transformer in diffusers format (its 'scale_shift_table', 'blocks.{i}.attn1.*' keys)")
    if "scale_shift_table" not in sd or not any(".attn1." in k for k in sd):
        _fail(caller, "source", f"{len(sd)} tensors without 'scale_shift_table' and 'blocks.{{i}}.attn1.*' "
                                f"(e.g. {sorted(sd)[:3]})", "a Wan transformer in diffusers format (FastWan's "
                                                            "'transformer' folder)")
    out, seen = {}, {}
    for key, value in sd.items():
        new = comfyui_key(key)
        if new in seen:
            _fail(caller, "source", f"two keys for {new!r}: {seen[new]!r} and {key!r}", "one key per tensor")
        seen[new] = key
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[new] = value.contiguous()
    gates = sum(1 for k in out if GATE_KEY.match(k))
    Path(destination).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(destination), metadata={"format": "pt", "solattn": json.dumps({"gates": gates})})
    return {"tensors": len(out), "gates": gates}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m solattn.integrations.fastwan",
                                     description="FastWan checkpoints for ComfyUI (gates kept).")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("to-comfyui", help="convert a FastWan diffusers-format transformer to ComfyUI's Wan "
                                             "format, keeping the to_gate_compress gates")
    conv.add_argument("source", help="the FastWan 'transformer' folder (or the pipeline folder, or .safetensors)")
    conv.add_argument("destination", help="the .safetensors file to write (ComfyUI/models/diffusion_models/...)")
    conv.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep")
    args = parser.parse_args(argv)
    dtype = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    counts = convert_to_comfyui(args.source, args.destination, dtype)
    print(f"wrote {args.destination}: {counts['tensors']} tensors, {counts['gates']} gate tensors "
          f"(blocks.{{i}}.self_attn.to_gate_compress)")
    if not counts["gates"]:
        print("note: the source has no to_gate_compress gates (not a VSA-trained FastWan checkpoint)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
