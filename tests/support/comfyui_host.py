"""Run one prompt through a real ComfyUI tree with the solattn node, in this process.

    python tests/support/comfyui_host.py CONFIG.json

ComfyUI's state is global to a process, so each scenario runs in its own process (the tests in
``tests/integrations/comfyui/test_comfyui_host.py`` spawn this script). CONFIG names the ComfyUI tree, a temporary base
directory and the model-patch nodes to chain between "Load Diffusion Model" and KSampler; the
script writes a tiny random FastH3-shaped MiniMax-H3 checkpoint (or, with ``"model": "fastwan"``, a
tiny FastWan in FastWan's own layout converted to ComfyUI's Wan format), loads the solattn node folder and
``tests/support/comfyui_host_nodes`` through ComfyUI's own custom-node loader, validates and executes the
prompt with ``execution.PromptExecutor`` (which runs it under ``torch.inference_mode()``), and
writes a JSON result: success, error, log lines, the sampled latent's finiteness and, when asked,
the relative error of every DiT attention call against a direct solattn call on the same q, k, v.
"""

import asyncio
import json
import logging
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NODE_FOLDER = os.path.join(ROOT, "integrations", "comfyui", "solattn_sparse_attention")
TEST_NODES = os.path.join(HERE, "comfyui_host_nodes")

#: the tiny FastH3 shape: 3 blocks, hidden 256, 2 heads of 128, to_gate_compress present
H3_SHAPE = dict(blocks=3, hidden=256, heads=2, head_dim=128, ffn=512, text_dim=64, refiner_blocks=1,
                time_in=256, time_hidden=256, time_dim=128, rope_len=16, video_channels=24,
                audio_channels=32, gate=True)


def h3_state_dict(blocks, hidden, heads, head_dim, ffn, text_dim, refiner_blocks, time_in, time_hidden,
                  time_dim, rope_len, video_channels, audio_channels, gate, seed=0):
    """A random MiniMax-H3 state dict under the key names ComfyUI's model detection reads
    (``video_patch_proj``, ``audio_patch_proj``, ``blocks.N.attn.qkv_proj`` / ``q_norm`` /
    ``to_gate_compress``, ``final_layer.video_out`` ...). Weights are small so that activations stay
    near unit scale; norms are ones; the rope frequencies are the usual geometric ladder."""
    gen = torch.Generator().manual_seed(seed)
    inner = heads * head_dim
    patch = video_channels * 4                       # patch 1x2x2

    def lin(out_f, in_f, bias=True, gain=1.0):
        w = torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))
        return {"weight": w} if not bias else {"weight": w, "bias": torch.randn(out_f, generator=gen) * 0.02}

    sd = {}

    def put(prefix, tensors):
        sd.update({f"{prefix}.{k}": v for k, v in tensors.items()})

    def attention(prefix, with_gate):
        put(f"{prefix}.qkv_proj", lin(3 * inner, hidden, bias=False))
        put(f"{prefix}.out_proj", lin(hidden, inner, bias=False, gain=0.5))
        sd[f"{prefix}.q_norm.weight"] = torch.ones(head_dim)
        sd[f"{prefix}.k_norm.weight"] = torch.ones(head_dim)
        if with_gate:
            put(f"{prefix}.to_gate_compress", lin(inner, hidden, bias=False, gain=0.5))

    def block(prefix, with_gate):
        sd[f"{prefix}.norm1.weight"] = torch.ones(hidden)
        sd[f"{prefix}.norm2.weight"] = torch.ones(hidden)
        attention(f"{prefix}.attn", with_gate)
        put(f"{prefix}.mlp.fc1", lin(2 * ffn, hidden, bias=False))
        put(f"{prefix}.mlp.fc2", lin(hidden, ffn, bias=False, gain=0.5))

    put("video_patch_proj", lin(hidden, patch))
    put("audio_patch_proj", lin(hidden, audio_channels))
    put("condition_proj", lin(hidden, text_dim))
    put("time_embedder.proj_in", lin(time_hidden, time_in))
    put("time_embedder.proj_out", lin(time_dim, time_hidden))
    sd["rope.inv_freq"] = 1.0 / (10000.0 ** (torch.arange(rope_len, dtype=torch.float32) / rope_len))
    for i in range(refiner_blocks):
        block(f"token_refiner.blocks.{i}", False)
    sd["token_refiner.final_norm.weight"] = torch.ones(hidden)
    for i in range(blocks):
        block(f"blocks.{i}", gate)
        put(f"blocks.{i}.adaln_proj.linear", lin(6 * hidden * 3, time_dim, gain=0.1))
    sd["final_layer.norm.weight"] = torch.ones(hidden)
    put("final_layer.adaln_proj.linear", lin(2 * hidden, time_dim, gain=0.1))
    put("final_layer.video_out", lin(patch, hidden))
    put("final_layer.audio_out", lin(audio_channels, hidden))
    return {k: v.contiguous() for k, v in sd.items()}


def write_checkpoint(path, seed=0, **shape):
    from safetensors.torch import save_file
    save_file(h3_state_dict(**{**H3_SHAPE, **shape}, seed=seed), path)


class _Server:
    """What PromptExecutor needs of ComfyUI's server: no client, events dropped."""
    client_id = None
    last_node_id = None
    last_prompt_id = None
    sockets_metadata = {}

    def send_sync(self, event, data, sid=None):
        pass

    def queue_updated(self):
        pass


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def start_comfyui(comfyui, base, device="cpu"):
    """Import ComfyUI with base directory ``base`` and its arguments parsed: on the CPU
    (``--cpu``), or with ``device`` "gpu" on the accelerator ComfyUI finds."""
    for sub in ("models/diffusion_models", "custom_nodes", "input", "output", "temp", "user"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    sys.argv = [sys.argv[0]] + (["--cpu"] if device == "cpu" else []) + ["--base-directory", base]
    sys.path.insert(0, comfyui)
    if ROOT not in sys.path:
        sys.path.insert(1, ROOT)
    import comfy.options
    comfy.options.enable_args_parsing()
    import folder_paths  # noqa: F401  (reads the base directory)
    import nodes
    import execution
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    return nodes, execution


def load_node_folders(nodes, base, folders):
    """Symlink each folder into ``base/custom_nodes`` and load it with ComfyUI's own loader."""
    for folder in folders:
        link = os.path.join(base, "custom_nodes", os.path.basename(folder))
        if not os.path.lexists(link):
            os.symlink(folder, link, target_is_directory=True)
        if not asyncio.run(nodes.load_custom_node(link)):
            raise RuntimeError(f"ComfyUI could not load the custom node folder {folder}")


def write_fastwan_checkpoint(base, cfg):
    """A tiny FastWan transformer in FastWan's own key layout (tests/support/fastwan_tiny.py), converted to
    ComfyUI's Wan format by solattn's converter into models/diffusion_models; returns its name.
    ``cfg["fastwan_gates"]``: "keep" (default), "drop" (a converted file without gates), or
    "ltx" (block 1's gate weight replaced by a per-head (heads, head_dim) tensor)."""
    sys.path.insert(0, HERE)
    from fastwan_tiny import SHAPE, fastwan_state_dict, write_fastwan
    from solattn.integrations import fastwan
    sd = fastwan_state_dict(**SHAPE)
    mode = cfg.get("fastwan_gates", "keep")
    if mode == "drop":
        sd = {k: v for k, v in sd.items() if "to_gate_compress" not in k}
    elif mode == "ltx":
        sd["blocks.1.to_gate_compress.weight"] = torch.randn(SHAPE["heads"], SHAPE["head_dim"])
    folder = write_fastwan(os.path.join(base, "FastWan-tiny-Diffusers", "transformer"), state_dict=sd)
    name = "fastwan_tiny_comfy.safetensors"
    fastwan.convert_to_comfyui(folder, os.path.join(base, "models", "diffusion_models", name))
    return name


def build_wan_prompt(cfg, ckpt_name, latent_path):
    """:func:`build_prompt` on an empty Wan latent (16 channels) with a small zero conditioning."""
    return build_prompt(cfg, ckpt_name, latent_path,
                        {"class_type": "SolAttnTestZeroConditioning", "inputs": {"tokens": 8, "dim": 4096}},
                        {"class_type": "EmptyHunyuanLatentVideo",
                         "inputs": {"width": cfg.get("width", 160), "height": cfg.get("height", 96),
                                    "length": cfg.get("length", 17), "batch_size": 1}})


class WanAttentionCapture:
    """Records each Wan self-attention call of the real ComfyUI code: its input x (what the gate
    reads), the roped q, k, v and the output of the attention call, by wrapping
    ``WanSelfAttention.forward`` and the Wan module's ``optimized_attention``."""

    def __init__(self):
        import comfy.ldm.wan.model as wan
        self.calls = []
        self._x = None
        forward, optimized, capture = wan.WanSelfAttention.forward, wan.optimized_attention, self

        def wrapped_forward(module, x, freqs, transformer_options={}):
            capture._x = x.detach().clone()
            try:
                return forward(module, x, freqs, transformer_options=transformer_options)
            finally:
                capture._x = None

        def attention(q, k, v, heads, **kwargs):
            out = optimized(q, k, v, heads, **kwargs)
            if capture._x is not None and q.shape == k.shape:
                opts = kwargs.get("transformer_options") or {}
                capture.calls.append({"block": opts.get("block_index"), "x": capture._x, "heads": heads,
                                      "grid": [int(n) for n in opts.get("grid_sizes")],
                                      "sigma": float(opts["sigmas"].reshape(-1)[0]) if "sigmas" in opts else None,
                                      "qkv": [t.detach().clone() for t in (q, k, v)], "out": out.detach().clone()})
            return out

        wan.WanSelfAttention.forward = wrapped_forward
        wan.optimized_attention = attention


def fastwan_reference(call, keep_percent):
    """One captured Wan self-attention call against FastVideo's VSA computed in float64 from the
    call's q, k, v and the gate of the FastWan file's own weights: errors vs VSA, vs VSA with the
    gate zeroed, vs dense attention."""
    from fastwan_tiny import SHAPE, dense_reference, fastwan_state_dict, rel, vsa_reference
    sd = fastwan_state_dict(**SHAPE)
    heads, i = call["heads"], call["block"]
    q, k, v = (t.unflatten(-1, (heads, -1)) for t in call["qkv"])
    x = call["x"].double()
    gate = (x @ sd[f"blocks.{i}.to_gate_compress.weight"].double().T
            + sd[f"blocks.{i}.to_gate_compress.bias"].double()).unflatten(-1, (heads, -1))
    grid, sparsity = tuple(call["grid"]), (100.0 - keep_percent) / 100.0
    out = call["out"].unflatten(-1, (heads, -1))
    return {"block": i, "sigma": call["sigma"], "grid": list(grid), "dtype": str(q.dtype), "tokens": q.shape[1],
            "rel_err_vs_definition": rel(out, vsa_reference(q, k, v, gate, grid, sparsity)),
            "rel_diff_vs_zero_gate": rel(out, vsa_reference(q, k, v, None, grid, sparsity)),
            "rel_diff_vs_dense": rel(out, dense_reference(q, k, v))}


def build_prompt(cfg, ckpt_name, latent_path, conditioning=None, latent=None):
    """UNETLoader -> cfg['patches'] (in order) -> KSampler -> save; ``conditioning`` and ``latent``
    are the two model-specific nodes (default: MiniMax-H3's zero text conditioning and empty AV latent)."""
    if conditioning is None:
        conditioning = {"class_type": "SolAttnTestZeroConditioning",
                        "inputs": {"tokens": cfg.get("text_tokens", 77), "dim": H3_SHAPE["text_dim"]}}
    if latent is None:
        latent = {"class_type": "EmptyMiniMaxH3LatentAV",
                  "inputs": {"width": cfg.get("width", 512), "height": cfg.get("height", 256),
                             "length": cfg.get("length", 22)}}
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": ckpt_name, "weight_dtype": "default"}}}
    model = ["1", 0]
    for i, node in enumerate(cfg.get("patches", [])):
        nid = str(10 + i)
        prompt[nid] = {"class_type": node["class_type"], "inputs": {"model": model, **node["inputs"]}}
        model = [nid, 0]
    prompt["2"], prompt["3"] = conditioning, latent
    prompt["4"] = {"class_type": "KSampler",
                   "inputs": {"model": model, "seed": 1, "steps": cfg.get("steps", 2), "cfg": 1.0,
                              "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 0],
                              "negative": ["2", 0], "latent_image": ["3", 0], "denoise": 1.0}}
    prompt["5"] = {"class_type": "SolAttnTestSaveLatent", "inputs": {"samples": ["4", 0], "path": latent_path}}
    return prompt


class AttentionCapture:
    """Records every DiT attention call of MiniMax-H3 (q, k, v, the attention input x and the
    output the call returned), by wrapping ``Attention.forward`` and the model module's
    ``optimized_attention`` of the real ComfyUI code."""

    def __init__(self):
        import comfy.ldm.minimax.model as h3
        self.h3 = h3
        self.calls = []
        self._x = None
        attention_forward = h3.Attention.forward
        optimized = h3.optimized_attention
        capture = self

        def forward(module, x, rope_freqs=None, transformer_options={}):
            capture._x = (module, x.detach().clone())
            try:
                return attention_forward(module, x, rope_freqs=rope_freqs, transformer_options=transformer_options)
            finally:
                capture._x = None

        def attention(q, k, v, heads, **kwargs):
            opts = kwargs.get("transformer_options") or {}
            layout = opts.get("minimax_h3_layout")
            record = None
            tensors = [t.peek() if isinstance(t, h3.AttentionTensorContainer) else t for t in (q, k, v)]
            if layout is not None and capture._x is not None and tensors[0].shape[2] == layout.seq_len:
                module, x = capture._x
                record = {"block": opts.get("block_index"), "module": module, "x": x, "layout": layout,
                          "sigma": float(opts["sigmas"].reshape(-1)[0]) if "sigmas" in opts else None,
                          "qkv": [t.detach().clone() for t in tensors]}
            out = optimized(q, k, v, heads, **kwargs)
            if record is not None:
                record["out"] = out.detach().clone()
                capture.calls.append(record)
            return out

        h3.Attention.forward = forward
        h3.optimized_attention = attention


def direct_solattn(call, method, keep_percent=10.0, tau=1.3, sink_conditioning="exact_kv_and_rows",
                   vsa_prefix="exempt"):
    """The attention of one captured call computed by solattn directly, in ComfyUI's returned
    layout ``(1, S, H * D)``; grid, prefix segments and sinks are derived here from the layout."""
    import solattn
    q, k, v = (t.transpose(1, 2) for t in call["qkv"])            # (1, H, S, D) -> (1, S, H, D)
    layout = call["layout"]
    segments = layout.segments
    video = [(a, b) for a, b, kind in segments if kind == "video"][0]
    with torch.inference_mode(False), torch.no_grad():
        if method == "vsa":
            _, lat_t, lat_h, lat_w, _ = layout.signature
            grid = (lat_t, lat_h // 2, lat_w // 2)
            prefix = [b - a for a, b, kind in segments if kind != "video" and b > a]
            gate = call["module"].to_gate_compress(call["x"].clone()).view(q.shape)
            out = solattn.video_sparse_attn(q, k, v, grid, sparsity=(100.0 - keep_percent) / 100.0, gate=gate,
                                            prefix_len=prefix, prefix_mode=vsa_prefix)
        else:
            sink_blocks = sink_q = None
            if sink_conditioning != "off":
                sink_blocks = [0, -(-video[0] // 64)]
                audio = [a for a, b, kind in segments if kind == "audio"]
                if sink_conditioning == "exact_kv_and_rows":
                    sink_q = [audio[0] // 64, sink_blocks[1]] if audio else list(sink_blocks)
            out = solattn.sol_attn(q, k, v, tau=tau, sink_blocks=sink_blocks, sink_q=sink_q,
                                   topk_ratio=0.0 if method == "sol-attn" else keep_percent / 100.0)
        dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    return out.flatten(2), dense.transpose(1, 2).flatten(2)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inspect_node_folder(nodes):
    """What ComfyUI reads of the node folder besides its code: the registry entry (pyproject.toml,
    through ComfyUI's own parser) and each example workflow checked against the node definitions
    of this ComfyUI: every node type exists, every link joins an output and an input of its type."""
    from comfy_config import config_parser
    conf = config_parser.extract_node_configuration(NODE_FOLDER)
    result = {"project": {"name": conf.project.name, "version": conf.project.version,
                          "license": conf.project.license.text, "description": conf.project.description},
              "comfy": {"publisher_id": conf.tool_comfy.publisher_id, "display_name": conf.tool_comfy.display_name},
              "workflows": {}}
    folder = os.path.join(NODE_FOLDER, "example_workflows")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            workflow = json.load(f)
        problems, by_id = [], {n["id"]: n for n in workflow["nodes"]}
        for n in workflow["nodes"]:
            if n["type"] not in nodes.NODE_CLASS_MAPPINGS:
                problems.append(f"node {n['id']}: no node type {n['type']!r} in this ComfyUI")
        for lid, a, a_slot, b, b_slot, kind in workflow["links"]:
            src, dst = by_id[a], by_id[b]
            if src["type"] not in nodes.NODE_CLASS_MAPPINGS or dst["type"] not in nodes.NODE_CLASS_MAPPINGS:
                continue
            outputs = nodes.NODE_CLASS_MAPPINGS[src["type"]].RETURN_TYPES
            spec = nodes.NODE_CLASS_MAPPINGS[dst["type"]].INPUT_TYPES()
            inputs = {**spec.get("required", {}), **spec.get("optional", {})}
            want = inputs.get(dst["inputs"][b_slot]["name"], ("?",))[0]
            if a_slot >= len(outputs) or outputs[a_slot] != kind or want != kind:
                problems.append(f"link {lid}: {src['type']} output {a_slot} "
                                f"({outputs[a_slot] if a_slot < len(outputs) else None}) -> {dst['type']} input "
                                f"{dst['inputs'][b_slot]['name']!r} ({want}); the link says {kind}")
        result["workflows"][name] = {"node_types": sorted({n["type"] for n in workflow["nodes"]}),
                                     "problems": problems}
    return result


def benchmark(cfg, nodes, execution, ckpt, latent_path):
    """Sampling time and extra resident memory of each variant (``cfg["benchmark"]["variants"]``: name
    -> patch nodes), run alternately in one process, ``repeats`` times each, through one executor.
    Time covers ``comfy.sample.sample`` (the denoising loop) only; memory is the peak resident set
    above the one at its start, sampled every 2 ms."""
    import threading
    import comfy.sample
    import psutil
    proc = psutil.Process()
    sample, timings = comfy.sample.sample, []

    def timed(*args, **kwargs):
        start_rss, peak, done = proc.memory_info().rss, [0], threading.Event()

        def watch():
            while not done.wait(0.002):
                peak[0] = max(peak[0], proc.memory_info().rss)
        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            done.set()
            watcher.join()
            timings.append((seconds, max(peak[0], proc.memory_info().rss) - start_rss))

    comfy.sample.sample = timed
    executor = execution.PromptExecutor(_Server(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 16.0, "ram_inactive": 16.0})
    bench = cfg["benchmark"]
    rows = {name: [] for name in bench["variants"]}
    for repeat in range(bench.get("repeats", 2) + 1):           # the first round warms up, not kept
        for name, patches in bench["variants"].items():
            prompt = (build_wan_prompt if cfg.get("model") == "fastwan" else build_prompt)(
                {**cfg, "patches": patches}, ckpt, latent_path)
            prompt["4"]["inputs"]["seed"] = 100 + repeat         # a new seed: the executor runs it again
            valid = asyncio.run(execution.validate_prompt(name, prompt, None))
            if not valid[0]:
                raise RuntimeError(f"{name}: the prompt does not validate: {valid[1:]}")
            executor.execute(prompt, name, {}, valid[2])
            if not executor.success:
                raise RuntimeError(f"{name}: {executor.status_messages[-1]}")
            if repeat:
                rows[name].append(timings[-1])
    rows = {name: {"seconds": [t for t, _ in r], "extra_rss_bytes": [m for _, m in r]} for name, r in rows.items()}
    if cfg.get("model") == "fastwan":
        grid = ((cfg.get("length", 17) - 1) // 4 + 1, cfg.get("height", 96) // 16, cfg.get("width", 160) // 16)
        return {"rows": rows, "video_grid": grid, "tokens": math.prod(grid)}
    from comfy_extras.nodes_minimax_h3 import temporal_shape
    _, latent_t, audio_t = temporal_shape(cfg.get("length", 22))
    grid = (latent_t, cfg.get("height", 256) // 32, cfg.get("width", 512) // 32)
    return {"rows": rows, "video_grid": grid, "tokens": cfg.get("text_tokens", 77) + 2 * audio_t + math.prod(grid)}


def main(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    base = cfg["base"]
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)
    nodes, execution = start_comfyui(cfg["comfyui"], base, cfg.get("device", "cpu"))
    load_node_folders(nodes, base, [NODE_FOLDER, TEST_NODES] + cfg.get("extra_node_folders", []))
    if cfg.get("inspect"):
        return inspect_node_folder(nodes), lines, cfg

    wan = cfg.get("model") == "fastwan"
    if wan:
        ckpt = write_fastwan_checkpoint(base, cfg)
        capture = WanAttentionCapture() if cfg.get("capture") else None
    else:
        ckpt = "fasth3_tiny.safetensors"
        write_checkpoint(os.path.join(base, "models", "diffusion_models", ckpt), **cfg.get("checkpoint", {}))
        capture = AttentionCapture() if cfg.get("capture") else None

    latent_path = os.path.join(base, "latent.pt")
    if cfg.get("benchmark"):
        return benchmark(cfg, nodes, execution, ckpt, latent_path), lines, cfg
    prompt = (build_wan_prompt if wan else build_prompt)(cfg, ckpt, latent_path)
    result = {"node_types": sorted(n["class_type"] for n in prompt.values())}
    valid = asyncio.run(execution.validate_prompt("p1", prompt, None))
    result["valid"] = bool(valid[0])
    if not valid[0]:
        result["validation"] = repr(valid[1:])
        return result, lines, cfg
    executor = execution.PromptExecutor(_Server(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 16.0, "ram_inactive": 16.0})
    t0 = time.perf_counter()
    executor.execute(prompt, "p1", {}, valid[2])
    result["seconds"] = time.perf_counter() - t0
    result["success"] = bool(executor.success)
    errors = [data for event, data in executor.status_messages if event == "execution_error"]
    result["error"] = (f"{errors[0].get('exception_type')}: {errors[0].get('exception_message')}"
                       if errors else None)
    if errors:
        result["traceback"] = "".join(errors[0].get("traceback", []))
    if os.path.exists(latent_path):
        tensors = torch.load(latent_path)
        result["latent_shapes"] = [list(t.shape) for t in tensors]
        result["latent_finite"] = all(bool(torch.isfinite(t).all()) for t in tensors)
        result["latent_norm"] = [float(t.double().norm()) for t in tensors]
    counted = nodes.NODE_CLASS_MAPPINGS.get("SolAttnTestPreferredAttention")
    result["preferred_attention_calls"] = getattr(counted, "calls", None)
    if capture is not None and wan:
        want = cfg["capture"]
        result["captures"] = [fastwan_reference(call, want.get("keep_percent", 25.0)) for call in capture.calls]
    elif capture is not None:
        want = cfg["capture"]
        compared = []
        for call in capture.calls:
            if want.get("block") is not None and call["block"] != want["block"]:
                continue
            out, dense = direct_solattn(call, **{k: v for k, v in want.items() if k != "block"})
            compared.append({"block": call["block"], "sigma": call["sigma"], "dtype": str(call["qkv"][0].dtype),
                             "tokens": call["qkv"][0].shape[2],
                             "rel_err_vs_direct": rel(call["out"], out),
                             "rel_diff_vs_dense": rel(call["out"], dense)})
        result["captures"] = compared
    return result, lines, cfg


if __name__ == "__main__":
    res, log_lines, config = main(sys.argv[1])
    res["log"] = log_lines.lines
    with open(config["result"], "w") as out_file:
        json.dump(res, out_file, indent=1)
