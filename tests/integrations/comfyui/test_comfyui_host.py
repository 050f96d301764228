"""The node in a real ComfyUI: its own custom-node loader, model detection and executor.

Set ``SOLATTN_COMFYUI`` to a ComfyUI tree (CI: ``../shared/third_party/comfyui``). Each scenario
runs ``tests/support/comfyui_host.py`` in a fresh process (ComfyUI's state is global) with a temporary base
directory: a tiny random FastH3-shaped MiniMax-H3 checkpoint is saved, loaded by "Load Diffusion
Model", patched by the node and sampled by KSampler for 2 steps through
``execution.PromptExecutor``, which runs the prompt under ``torch.inference_mode()``.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SUPPORT = os.path.join(ROOT, "tests", "support")
COMFYUI = os.environ.get("SOLATTN_COMFYUI", "")

pytestmark = pytest.mark.skipif(
    not COMFYUI or not os.path.isfile(os.path.join(COMFYUI, "execution.py")),
    reason=("SOLATTN_COMFYUI is not set to a ComfyUI tree (a folder with execution.py); "
            f"got {COMFYUI!r}. Set it, e.g. to ../shared/third_party/comfyui, to run the node in ComfyUI"))

#: "cpu" (ComfyUI's --cpu), or "gpu": the accelerator ComfyUI finds (its default dtype, e.g. bf16)
DEVICE = os.environ.get("SOLATTN_COMFYUI_DEVICE", "cpu")
NODE = "SolAttnModelSparseAttention"
BUILTIN = "BlockSparseAttention"     # ComfyUI's own "Model Sparse Attention" node
PREFIX = "solattn.comfyui: Model Sparse Attention (solattn): "
#: the tiny model's video is a (7, 8, 16) grid: 2 x 2 x 4 = 16 cubes; keep 25 % -> 4 per query cube
KEEP = 25.0


def run_host(tmp_path, **cfg):
    """Run one prompt in a fresh process; the result JSON of tests/support/comfyui_host.py."""
    base = tmp_path / "comfy"
    base.mkdir()
    result = tmp_path / "result.json"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"comfyui": COMFYUI, "base": str(base), "result": str(result), "device": DEVICE,
                                  **cfg}))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # torchvision / torchaudio stand-ins for the ComfyUI process only: SOLATTN_COMFYUI_STUBS, else
    # a comfyui-stubs folder beside the ComfyUI tree
    stubs = os.environ.get("SOLATTN_COMFYUI_STUBS") or os.path.join(os.path.dirname(os.path.abspath(COMFYUI)),
                                                                    "comfyui-stubs")
    if os.path.isdir(stubs) and stubs not in paths:
        paths.append(stubs)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(paths + [ROOT])}
    proc = subprocess.run([sys.executable, os.path.join(SUPPORT, "comfyui_host.py"), str(config)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert result.exists(), f"the ComfyUI process failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    out = json.loads(result.read_text())
    print(json.dumps({k: v for k, v in out.items() if k not in ("log", "traceback")}, indent=1))
    print("\n".join(line for line in out["log"] if line.startswith("solattn")))
    out.setdefault("log", [])
    return out


def node_lines(result):
    return [line[len(PREFIX):] for line in result["log"] if line.startswith(PREFIX)]


def assert_completed(result):
    assert result["valid"], result.get("validation")
    assert result["success"], f"{result['error']}\n{result.get('traceback', '')}"
    assert result["latent_finite"] is True


#: the nested inputs of each method (the node's "selection", shown as "method"), as in the built-in node
NESTED = {"auto": ("tau", "keep_percent", "vsa_prefix"), "sol-attn": ("tau",), "sla": ("keep_percent",),
          "vsa": ("keep_percent", "vsa_prefix")}
BUILTIN_NESTED = {"sol-attn": ("tau",), "sla": ("keep_percent",), "vsa": ("keep_percent",)}


def sparse_node(method, class_type=NODE, **inputs):
    """A prompt entry of the node (or of the built-in one, whose inputs have the same names)."""
    values = {"tau": 1.3, "keep_percent": KEEP, "vsa_prefix": "exempt", "start_percent": 0.0,
              "end_percent": 1.0, "min_tokens": 0, **inputs}
    nested = {f"selection.{k}": values.pop(k) for k in ("tau", "keep_percent", "vsa_prefix") if k in values}
    allowed = (NESTED if class_type == NODE else BUILTIN_NESTED)[method]
    nested = {k: v for k, v in nested.items() if k.split(".")[1] in allowed}
    return {"class_type": class_type, "inputs": {"selection": method, **nested, **values}}




def sparse_lines(result, method):
    return [line for line in node_lines(result) if line.startswith(f"{method} on ")]


def assert_calls_equal_solattn(result, sparse=lambda call: True, count=2 * 3):
    """Every DiT attention call of both steps that ``sparse`` selects is solattn's output on the same
    q, k, v (and gate), and not the dense one (selection is real); every other call is dense."""
    calls = result["captures"]
    assert len(calls) == count, calls
    for call in calls:
        tol = 1e-5 if call["dtype"] == "torch.float32" else 2e-2      # bf16 / fp16 on an accelerator
        if sparse(call):
            assert call["rel_err_vs_direct"] < tol, call
            assert call["rel_diff_vs_dense"] > max(1e-3, 2 * tol), call
        else:
            assert call["rel_diff_vs_dense"] < tol, call


@pytest.mark.parametrize("method, runs, extra, checkpoint", [
    pytest.param("vsa", "vsa", {}, {}, marks=pytest.mark.slow),
    pytest.param("vsa", "vsa", {"vsa_prefix": "compete"}, {}, marks=pytest.mark.slow),
    pytest.param("sol-attn", "sol-attn", {}, {}, marks=pytest.mark.slow),
    pytest.param("sla", "sla", {}, {}, marks=pytest.mark.slow),
    ("auto", "vsa", {}, {}),
    pytest.param("auto", "sol-attn", {}, {"gate": False}, marks=pytest.mark.slow)],
    ids=["vsa", "vsa-compete", "sol-attn", "sla", "auto-fasth3", "auto-no-gate"])
def test_prompt_runs_sparse_and_each_block_equals_solattn(tmp_path, method, runs, extra, checkpoint):
    result = run_host(tmp_path, patches=[sparse_node(method, **extra)], checkpoint=checkpoint,
                      capture={"method": runs, "keep_percent": KEEP, "tau": 1.3, **extra})
    assert_completed(result)
    lines = node_lines(result)
    assert sparse_lines(result, runs), lines
    assert not [line for line in lines if line.startswith("dense")], lines
    chose = [line for line in lines if line.startswith("method auto chose")]
    assert chose == ([f"method auto chose {runs}: " + ("a MiniMax-H3 model with to_gate_compress (FastH3)"
                                                        if runs == "vsa" else
                                                        "a MiniMax-H3 model without to_gate_compress")]
                     if method == "auto" else [])
    assert_calls_equal_solattn(result)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("method, order", [("vsa", "builtin-first"), ("vsa", "builtin-after"),
                                           ("sol-attn", "builtin-after")])
@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the built-in node runs comfy-kitchen's own kernel")
def test_builtin_sparse_node_in_either_order(tmp_path, method, order):
    """ComfyUI's built-in node runs nothing sparse off CUDA. Applied before this node, its block
    patches run inside vsa's; applied after, its patches replace vsa's and its override goes on top:
    this node wraps them again before every step and says so, so the model still runs sparse."""
    ours, builtin = sparse_node(method), sparse_node(method, class_type=BUILTIN, extra_tokens=0,
                                                      dense_blocks="", sink_conditioning="exact_kv_and_rows",
                                                      verbose=True)
    patches = [builtin, ours] if order == "builtin-first" else [ours, builtin]
    result = run_host(tmp_path, patches=patches, capture={"method": method, "keep_percent": KEEP, "tau": 1.3})
    assert_completed(result)
    lines = node_lines(result)
    assert sparse_lines(result, method), lines
    replaced = [line for line in lines if "of a node applied after this one" in line or
                "installed after this node" in line]
    assert len(replaced) == (1 if order == "builtin-after" else 0), lines
    if order == "builtin-first" and method == "vsa":
        assert "vsa wraps 3 block patch(es) another node installed earlier" in " ".join(result["log"])
    assert_calls_equal_solattn(result)


@pytest.mark.slow
def test_builtin_node_values_carry_over(tmp_path):
    """The built-in node's inputs, values and all, with only the node type changed: the prompt
    validates and runs vsa at its keep_percent; verbose False keeps the per-call lines quiet and
    extra_tokens (which solattn does not compute) is reported once."""
    values = sparse_node("vsa", class_type=BUILTIN, extra_tokens=256, dense_blocks="",
                         sink_conditioning="exact_kv_and_rows", verbose=False)
    result = run_host(tmp_path, patches=[{**values, "class_type": NODE}],
                      capture={"method": "vsa", "keep_percent": KEEP})
    assert_completed(result)
    assert node_lines(result) == ["extra_tokens 256 has no effect: solattn keeps whole key blocks "
                                  "(no extra routed tokens)"]
    assert_calls_equal_solattn(result)


@pytest.mark.slow
def test_dense_blocks_and_schedule_window_are_each_logged(tmp_path):
    """dense_blocks "0, 2": one line per listed block; the window's line gives percent and sigma.
    end_percent 0.01 leaves the second step (sigma 0.92) outside the window."""
    result = run_host(tmp_path, patches=[sparse_node("vsa", dense_blocks="0, 2", end_percent=0.01)],
                      capture={"method": "vsa", "keep_percent": KEEP})
    assert_completed(result)
    lines = node_lines(result)
    assert [line for line in lines if "dense_blocks" in line] == [
        "dense: block 0 is in dense_blocks", "dense: block 2 is in dense_blocks"]
    window = [line for line in lines if "outside the start/end window" in line]
    assert len(window) == 1 and "start_percent 0 .. end_percent 0.01 = sigma " in window[0], lines
    assert_calls_equal_solattn(result, sparse=lambda call: call["block"] == 1 and call["sigma"] == 1.0)


@pytest.mark.slow
def test_dense_fallback_keeps_the_checkpoint_attention(tmp_path):
    """A call the node keeps dense runs the checkpoint's own attention choice (ComfyUI's
    preferred_attention), as it would without the node: 3 blocks x 2 steps."""
    result = run_host(tmp_path, patches=[{"class_type": "SolAttnTestPreferredAttention", "inputs": {}},
                                         sparse_node("sol-attn", dense_blocks="0-2")])
    assert_completed(result)
    assert result["preferred_attention_calls"] == 2 * 3
    assert [line for line in node_lines(result) if "dense_blocks" in line] == [
        f"dense: block {i} is in dense_blocks" for i in range(3)]


@pytest.mark.slow
def test_node_folder_registry_entry_and_example_workflow(tmp_path):
    """ComfyUI's own parser reads the folder's pyproject.toml (the custom-node registry entry), and
    the FastH3 example workflow uses only node types this ComfyUI has, linked by matching types,
    with the solattn node (method vsa) in place of the built-in one."""
    import solattn
    result = run_host(tmp_path, inspect=True)
    assert result["project"] == {
        "name": "solattn-sparse-attention", "version": solattn.__version__, "license": "Apache-2.0",
        "description": result["project"]["description"]}
    assert result["comfy"] == {"publisher_id": "solattn", "display_name": "Model Sparse Attention (solattn)"}
    assert list(result["workflows"]) == ["fasth3_text_to_video_solattn.json", "fastwan2.1_t2v_1.3b_solattn.json"]
    fastwan = result["workflows"]["fastwan2.1_t2v_1.3b_solattn.json"]
    assert fastwan["problems"] == []
    assert {NODE, "UNETLoader", "ModelSamplingSD3", "CLIPLoader", "EmptyHunyuanLatentVideo",
            "KSampler"} <= set(fastwan["node_types"]) and BUILTIN not in fastwan["node_types"]
    workflow = result["workflows"]["fasth3_text_to_video_solattn.json"]
    assert workflow["problems"] == []
    assert NODE in workflow["node_types"] and BUILTIN not in workflow["node_types"]
    assert {"UNETLoader", "MiniMaxH3ImageToVideo", "KSampler"} <= set(workflow["node_types"])
    with open(os.path.join(ROOT, "integrations", "comfyui", "solattn_sparse_attention", "example_workflows",
                           "fasth3_text_to_video_solattn.json")) as f:
        ours = [n for n in json.load(f)["nodes"] if n["type"] == NODE]
    assert [n["widgets_values"][:2] for n in ours] == [["vsa", 10.0]]     # method vsa, FastH3's keep 10 %
    with open(os.path.join(ROOT, "integrations", "comfyui", "solattn_sparse_attention", "example_workflows",
                           "fastwan2.1_t2v_1.3b_solattn.json")) as f:
        workflow = json.load(f)
    ours = [n for n in workflow["nodes"] if n["type"] == NODE]
    # auto (vsa on the gated Wan), keep 20 % (FastWan2.1-1.3B's sparsity 0.8), the gates of the loaded file
    assert [(n["widgets_values"][0], n["widgets_values"][2], n["widgets_values"][-1]) for n in ours] == [
        ("auto", 20.0, "from_model_file")]
    # placed as a user places it: the loader's model through ModelSamplingSD3, the node, into KSampler
    by_link = {lid: (a, b) for lid, a, _, b, _, _ in workflow["links"]}
    types = {n["id"]: n["type"] for n in workflow["nodes"]}
    chain = sorted((types[a], types[b]) for a, b in by_link.values() if NODE in (types[a], types[b]))
    assert chain == [("ModelSamplingSD3", NODE), (NODE, "KSampler")]
