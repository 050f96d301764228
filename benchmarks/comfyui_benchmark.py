"""CPU timing of the node in a real ComfyUI: a tiny random model sampled, dense (no node) and through
the node, alternating in one process per size: the FastH3-shaped MiniMax-H3 for 2 steps (node on vsa
and sol-attn), or with ``--model fastwan`` a FastWan-shaped Wan2.1 (2 blocks, 2 heads of 128, its
gates) for 3 steps (node on auto, which runs vsa with the loaded file's gates).

    SOLATTN_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui_benchmark.py OUT.md [--sizes 512x256x22 ...]
    SOLATTN_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui_benchmark.py OUT.md --model fastwan

(``SOLATTN_COMFYUI_DEVICE=gpu`` runs ComfyUI on the accelerator it finds instead of ``--cpu``.)

Writes a markdown table: tokens per attention call, median sampling seconds and peak extra resident
memory per variant, and each variant's time relative to dense. A shared CPU is noisy: compare ratios
taken in the same run, not absolute times across runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "tests", "support")


def node(selection, keep=10.0, **extra):
    nested = {"sol-attn": {"selection.tau": 1.3}, "vsa": {"selection.keep_percent": keep},
              "auto": {"selection.tau": 1.3, "selection.keep_percent": keep, "selection.vsa_prefix": "exempt"}}[selection]
    return [{"class_type": "SolAttnModelSparseAttention",
             "inputs": {"selection": selection, **nested, "start_percent": 0.0, "end_percent": 1.0,
                        "min_tokens": 0, **extra}}]


VARIANTS = {"dense (no node)": [], "node vsa, keep 10%": node("vsa"), "node sol-attn, tau 1.3": node("sol-attn")}
FASTWAN_VARIANTS = {"dense (no node)": [], "node auto (vsa with the file's gates), keep 20%": node("auto", keep=20.0)}
#: per model: variants, sampling steps, default sizes (WIDTHxHEIGHTxLENGTH of the empty latent)
MODELS = {"h3": (VARIANTS, 2, ["512x256x22", "1024x512x39"]),
          "fastwan": (FASTWAN_VARIANTS, 3, ["160x96x17", "256x256x29"])}


def run(comfyui, width, height, length, repeats, model="h3"):
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "comfy")
        os.makedirs(base)
        cfg = {"comfyui": comfyui, "base": base, "result": os.path.join(tmp, "result.json"),
               "device": os.environ.get("SOLATTN_COMFYUI_DEVICE", "cpu"), "width": width,
               "height": height, "length": length, "steps": MODELS[model][1],
               "benchmark": {"variants": MODELS[model][0], "repeats": repeats}}
        if model == "fastwan":
            cfg["model"] = "fastwan"
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        stubs = os.environ.get("SOLATTN_COMFYUI_STUBS") or os.path.join(os.path.dirname(comfyui), "comfyui-stubs")
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), stubs, ROOT) if p)}
        subprocess.run([sys.executable, os.path.join(SUPPORT, "comfyui_host.py"), path], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(cfg["result"]) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", choices=sorted(MODELS), default="h3",
                        help="h3 (FastH3-shaped MiniMax-H3, default) or fastwan (FastWan-shaped Wan2.1)")
    parser.add_argument("--sizes", nargs="+", default=None,
                        help="WIDTHxHEIGHTxLENGTH of the empty latent (pixels, frames); default per model: "
                             + "; ".join(f"{m}: {' '.join(v[2])}" for m, v in MODELS.items()))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    comfyui = os.path.abspath(os.environ["SOLATTN_COMFYUI"])
    steps = MODELS[args.model][1]
    lines = [f"| tokens (video grid) | variant | sampling s (median, {steps} steps) | vs dense | peak extra RSS MiB |",
             "|---|---|---|---|---|"]
    for size in args.sizes or MODELS[args.model][2]:
        width, height, length = (int(x) for x in size.split("x"))
        result = run(comfyui, width, height, length, args.repeats, args.model)
        dense = statistics.median(result["rows"]["dense (no node)"]["seconds"])
        for name, row in result["rows"].items():
            seconds = statistics.median(row["seconds"])
            lines.append(f"| {result['tokens']} ({' x '.join(map(str, result['video_grid']))}) | {name} | "
                         f"{seconds:.2f} | {seconds / dense:.2f} | {max(row['extra_rss_bytes']) / 2**20:.0f} |")
        print("\n".join(lines[-len(result["rows"]):]), flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
