"""The node in a real ComfyUI: its own custom-node loader, model detection and executor.

Set ``SOLATTN_COMFYUI`` to a ComfyUI tree (CI: ``../shared/third_party/comfyui``). Each scenario
runs ``tests/comfyui_host.py`` in a fresh process (ComfyUI's state is global) with a temporary base
directory: a tiny random FastH3-shaped MiniMax-H3 checkpoint is saved, loaded by "Load Diffusion
Model", patched by the node and sampled by KSampler for 2 steps through
``execution.PromptExecutor``, which runs the prompt under ``torch.inference_mode()``.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMFYUI = os.environ.get("SOLATTN_COMFYUI", "")

pytestmark = pytest.mark.skipif(
    not COMFYUI or not os.path.isfile(os.path.join(COMFYUI, "execution.py")),
    reason=("SOLATTN_COMFYUI is not set to a ComfyUI tree (a folder with execution.py); "
            f"got {COMFYUI!r}. Set it, e.g. to ../shared/third_party/comfyui, to run the node in ComfyUI"))

NODE = "SolAttnModelSparseAttention"
PREFIX = "solattn.comfyui: Model Sparse Attention (solattn): "
#: the tiny model's video is a (7, 8, 16) grid: 2 x 2 x 4 = 16 cubes; keep 25 % -> 4 per query cube
KEEP = 25.0


def run_host(tmp_path, **cfg):
    """Run one prompt in a fresh process; the result JSON of tests/comfyui_host.py."""
    base = tmp_path / "comfy"
    base.mkdir()
    result = tmp_path / "result.json"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"comfyui": COMFYUI, "base": str(base), "result": str(result), **cfg}))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    stubs = os.path.join(os.path.dirname(os.path.abspath(COMFYUI)), "comfyui-stubs")
    if os.path.isdir(stubs) and stubs not in paths:
        paths.append(stubs)          # torchvision / torchaudio stand-ins that sit beside the fixture
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(paths + [ROOT])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "comfyui_host.py"), str(config)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert result.exists(), f"the ComfyUI process failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    out = json.loads(result.read_text())
    print(json.dumps({k: v for k, v in out.items() if k not in ("log", "traceback")}, indent=1))
    print("\n".join(line for line in out["log"] if line.startswith("solattn")))
    return out


def node_lines(result):
    return [line[len(PREFIX):] for line in result["log"] if line.startswith(PREFIX)]


def assert_completed(result):
    assert result["valid"], result.get("validation")
    assert result["success"], f"{result['error']}\n{result.get('traceback', '')}"
    assert result["latent_finite"] is True


def solattn_node(method, **inputs):
    values = {"method": method, "tau": 1.3, "keep_percent": KEEP, "start_percent": 0.0, "end_percent": 1.0,
              "min_tokens": 0}
    return {"class_type": NODE, "inputs": {**values, **inputs}}


@pytest.mark.parametrize("method, extra", [("vsa", {}), ("vsa", {"vsa_prefix": "compete"}),
                                           ("sol-attn", {}), ("sla", {})],
                         ids=["vsa", "vsa-compete", "sol-attn", "sla"])
def test_prompt_runs_sparse_and_each_block_equals_solattn(tmp_path, method, extra):
    result = run_host(tmp_path, patches=[solattn_node(method, **extra)],
                      capture={"method": method, "keep_percent": KEEP, "tau": 1.3, **extra})
    assert_completed(result)
    lines = node_lines(result)
    sparse = [line for line in lines if line.startswith(f"{method} on ")]
    assert sparse, lines
    assert not [line for line in lines if line.startswith("dense")], lines
    # every DiT attention call of both steps: the node's output is solattn's on the same q, k, v, gate
    calls = result["captures"]
    assert len(calls) == 2 * 3, calls
    for call in calls:
        assert call["rel_err_vs_direct"] < 1e-5, call
        assert call["rel_diff_vs_dense"] > 1e-3, call       # selection is real: not the dense result
