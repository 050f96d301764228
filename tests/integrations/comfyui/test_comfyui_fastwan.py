"""FastWan through a real ComfyUI: a tiny FastWan-shaped Wan in FastWan's own key layout
(tests/support/fastwan_tiny.py) converted by ``solattn.integrations.fastwan``, loaded by "Load Diffusion
Model", patched by the node and sampled by KSampler through ComfyUI's executor
(tests/support/comfyui_host.py, one fresh process per scenario). Each block's self-attention is compared
with FastVideo's VSA definition computed in float64 from the call's q, k, v and the file's gates.
"""

import os

import pytest

from tests.integrations.comfyui.test_comfyui_host import COMFYUI, DEVICE, NODE, assert_completed, node_lines, run_host, sparse_node  # noqa: E402

pytestmark = pytest.mark.skipif(
    not COMFYUI or not os.path.isfile(os.path.join(COMFYUI, "execution.py")),
    reason=f"SOLATTN_COMFYUI is not set to a ComfyUI tree (a folder with execution.py); got {COMFYUI!r}")

#: latent 17 frames x 96 x 160 -> Wan grid (5, 6, 10) after the (1, 2, 2) patch: 2 x 2 x 3 = 12
#: cubes, the edge ones partial; keep 25 % -> top-k 3
KEEP = 25.0
GRID = [5, 6, 10]


def fastwan_node(method="auto", **inputs):
    node = sparse_node(method, keep_percent=KEEP, **inputs)
    return node


def test_auto_runs_vsa_with_the_gates_of_the_loaded_file_and_each_block_equals_the_definition(tmp_path):
    result = run_host(tmp_path, model="fastwan", patches=[fastwan_node("auto")],
                      capture={"keep_percent": KEEP})
    assert_completed(result)
    lines = node_lines(result)
    assert "method auto chose vsa: a Wan model with FastWan to_gate_compress gates (from " \
           "fastwan_tiny_comfy.safetensors)" in lines, lines
    assert any(line.startswith("vsa on cpu: Wan grid (5, 6, 10) (12 cubes, top-k 3)") and "gated coarse" in line
               for line in lines), lines
    calls = result["captures"]
    assert len(calls) == 2 * 2                       # 2 steps x 2 blocks (cfg 1: one batch per step)
    tol = 1e-5 if DEVICE == "cpu" else 2e-2
    for call in calls:
        assert call["grid"] == GRID and call["tokens"] == 300
        assert call["rel_err_vs_definition"] <= tol, call
        assert call["rel_diff_vs_zero_gate"] > 1e-3 and call["rel_diff_vs_dense"] > 1e-3, call


@pytest.mark.slow
def test_without_gates_auto_keeps_sol_attn_and_forced_vsa_runs_the_fine_stage(tmp_path):
    result = run_host(tmp_path, model="fastwan", fastwan_gates="drop", patches=[fastwan_node("auto")])
    assert_completed(result)
    assert any("method auto chose sol-attn: a Wan model without FastWan to_gate_compress gates" in line
               for line in node_lines(result)), node_lines(result)
    (tmp_path / "forced").mkdir()
    result = run_host(tmp_path / "forced", model="fastwan", patches=[fastwan_node("vsa", vsa_gates="none")],
                      capture={"keep_percent": KEEP})
    assert_completed(result)
    for call in result["captures"]:
        assert call["rel_diff_vs_zero_gate"] <= 1e-5, call            # FastVideo's zero gate: fine only


@pytest.mark.slow
def test_schedule_window_keeps_early_steps_dense(tmp_path):
    result = run_host(tmp_path, model="fastwan", patches=[fastwan_node("auto", start_percent=0.4)],
                      capture={"keep_percent": KEEP})
    assert_completed(result)
    assert any(line.startswith("dense: sigma 1 is outside the start/end window") for line in node_lines(result))
    first, second = result["captures"][:2], result["captures"][2:]
    assert all(c["rel_diff_vs_dense"] < 1e-5 for c in first), first
    assert all(c["rel_err_vs_definition"] <= 1e-5 for c in second), second


@pytest.mark.slow
def test_an_ltx_style_gate_is_refused_naming_the_key(tmp_path):
    result = run_host(tmp_path, model="fastwan", fastwan_gates="ltx", patches=[fastwan_node("auto")])
    assert result["valid"] and not result["success"]
    assert "blocks.1.self_attn.to_gate_compress.weight" in result["error"], result["error"]
    assert "per-head gate" in result["error"] and "(2, 128)" in result["error"]


@pytest.mark.slow
def test_node_lists_the_gate_choices(tmp_path):
    result = run_host(tmp_path, model="fastwan", patches=[fastwan_node("auto", vsa_gates="none")])
    assert_completed(result)
    assert any("method auto chose sol-attn" in line for line in node_lines(result))
    assert NODE in result["node_types"]


@pytest.mark.slow
def test_a_deep_copy_of_the_patched_model_runs_its_own_modules(tmp_path):
    # ComfyUI's multi-GPU clones and non-dynamic delegates copy the object patches onto a fresh copy
    # of the model: the patches must run that copy's self-attention, not the first model's
    result = run_host(tmp_path, model="fastwan", patches=[fastwan_node("auto"),
                                                          {"class_type": "SolAttnTestDeepClone", "inputs": {}}],
                      capture={"keep_percent": KEEP})
    assert_completed(result)
    assert result["latent_finite"], result["latent_norm"]
    assert result["captures"] and all(c["rel_err_vs_definition"] <= 1e-5 for c in result["captures"])
