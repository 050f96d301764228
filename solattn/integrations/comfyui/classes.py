"""The node classes ComfyUI registers: a node API v3 node whose inputs carry the built-in "Model
Sparse Attention" node's names (``selection`` shown as "method", ``tau`` / ``keep_percent`` under it,
``extra_tokens``, ``verbose`` ...), so swapping the two nodes keeps a workflow's values, and the
classic node with the same values as flat inputs for a ComfyUI without ``comfy_api``'s
``DynamicCombo``. Both call :func:`.node.apply`."""

from __future__ import annotations

from .node import apply
from .settings import DEFAULT_MIN_TOKENS, DISPLAY_NAME, METHODS, NODE_ID, SINK_MODES, VSA_PREFIX_MODES
from .wan import FROM_MODEL_FILE, NO_GATES

CATEGORY = "model/patch"
DESCRIPTION = ("Block-sparse attention through solattn on any device (xpu, cpu, mps, cuda). Put it where "
               "ComfyUI's 'Model Sparse Attention' node would go (its inputs have the same names). auto: vsa "
               "on a FastH3 (MiniMax-H3 with to_gate_compress) or FastWan (Wan with gates, see vsa_gates) "
               "checkpoint, sol-attn on any other model. Outside "
               "start/end_percent, dense_blocks and under min_tokens the attention that was there before runs.")
TIPS = {
    "method": ("auto: vsa on FastH3 and FastWan checkpoints, sol-attn elsewhere (one log line says which). sol-attn: "
               "training-free adaptive threshold (tau). sla: fixed fraction of key blocks (keep_percent; for "
               "weights trained for it). vsa: FastVideo's video sparse attention with the learned coarse gate "
               "(keep_percent; MiniMax-H3 and Wan)."),
    "tau": "sol-attn: threshold in score sigmas; higher is sparser.",
    "keep_percent": ("sla / vsa: percent of key blocks (vsa: video cubes) each query block keeps. FastH3 was "
                     "trained at 10."),
    "vsa_prefix": ("vsa: exempt: conditioning key tiles are always attended on top of the video top-k "
                   "(FastVideo's default). compete: they compete in one top-k with the video cubes."),
    "start_percent": "Sampling progress where sparse attention begins; before it attention stays dense.",
    "end_percent": "Sampling progress where sparse attention ends; after it attention is dense again.",
    "dense_blocks": ("Transformer blocks that always run dense, e.g. '0, 1, 47-49'; in models with two block "
                     "families, 'double:0-2, single:5' (a bare index matches both)."),
    "min_tokens": "Sequences shorter than this stay dense.",
    "extra_tokens": ("Accepted so the built-in node's value carries over. solattn keeps whole key blocks, so "
                     "it has no effect (a log line says so when it is not 0)."),
    "sink_conditioning": ("MiniMax-H3 with sol-attn / sla. exact_kv: every query attends the packed text / "
                          "audio / reference rows exactly. exact_kv_and_rows: also runs the target-audio query "
                          "rows dense. vsa always treats those rows as FastVideo does."),
    "verbose": "Log once per sampling run whether each attention shape ran sparse or why it stayed dense.",
    "vsa_gates": ("Wan models: where FastWan's to_gate_compress gates come from. from_model_file: the file 'Load "
                  "Diffusion Model' loaded (convert FastWan with 'python -m solattn.integrations.fastwan "
                  "to-comfyui', which keeps them). none: no gates. Or a file in models/diffusion_models. auto "
                  "picks vsa on a Wan model when gates are found."),
}
DEFAULTS = dict(tau=1.3, keep_percent=10.0, vsa_prefix="exempt", start_percent=0.2, end_percent=1.0,
                dense_blocks="", min_tokens=DEFAULT_MIN_TOKENS, extra_tokens=0,
                sink_conditioning="exact_kv_and_rows", verbose=True, vsa_gates=FROM_MODEL_FILE)


def gate_choices():
    """The vsa_gates options: the model's own file, none, and the files in models/diffusion_models."""
    try:
        import folder_paths
        files = list(folder_paths.get_filename_list("diffusion_models"))
    except Exception:   # outside ComfyUI, or its folders unreadable: the two fixed choices
        files = []
    return [FROM_MODEL_FILE, NO_GATES] + files


def _v3_node():
    """The node on ComfyUI's node API v3, or None where that API (with DynamicCombo) is missing."""
    try:
        from comfy_api.latest import io
    except ImportError:
        return None
    if not hasattr(io, "DynamicCombo"):
        return None

    def tau():
        return io.Float.Input("tau", default=DEFAULTS["tau"], min=0.0, max=4.0, step=0.05, tooltip=TIPS["tau"])

    def keep():
        return io.Float.Input("keep_percent", default=DEFAULTS["keep_percent"], min=0.5, max=95.0, step=0.5,
                              tooltip=TIPS["keep_percent"])

    def prefix():
        # optional: the built-in node's values (which have no vsa_prefix) validate unchanged
        return io.Combo.Input("vsa_prefix", options=list(VSA_PREFIX_MODES), default=DEFAULTS["vsa_prefix"],
                              optional=True, tooltip=TIPS["vsa_prefix"])

    class SolAttnModelSparseAttention(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category=CATEGORY, description=DESCRIPTION,
                search_aliases=["Block Sparse Attention", "solattn", "VSA", "FastH3", "FastWan"],
                inputs=[
                    io.Model.Input("model", tooltip="The model to patch."),
                    io.DynamicCombo.Input("selection", display_name="method", tooltip=TIPS["method"], options=[
                        io.DynamicCombo.Option("auto", [tau(), keep(), prefix()]),
                        io.DynamicCombo.Option("sol-attn", [tau()]),
                        io.DynamicCombo.Option("sla", [keep()]),
                        io.DynamicCombo.Option("vsa", [keep(), prefix()]),
                    ]),
                    io.Float.Input("start_percent", default=DEFAULTS["start_percent"], min=0.0, max=1.0, step=0.01,
                                   tooltip=TIPS["start_percent"]),
                    io.Float.Input("end_percent", default=DEFAULTS["end_percent"], min=0.0, max=1.0, step=0.01,
                                   tooltip=TIPS["end_percent"]),
                    io.String.Input("dense_blocks", default="", advanced=True, optional=True,
                                    tooltip=TIPS["dense_blocks"]),
                    io.Int.Input("min_tokens", default=DEFAULT_MIN_TOKENS, min=0, max=1 << 20, step=512,
                                 advanced=True, optional=True, tooltip=TIPS["min_tokens"]),
                    io.Int.Input("extra_tokens", default=0, min=0, max=256, step=64, advanced=True, optional=True,
                                 tooltip=TIPS["extra_tokens"]),
                    io.Combo.Input("sink_conditioning", options=list(SINK_MODES),
                                   default=DEFAULTS["sink_conditioning"], advanced=True, optional=True,
                                   tooltip=TIPS["sink_conditioning"]),
                    io.Boolean.Input("verbose", default=True, advanced=True, optional=True, tooltip=TIPS["verbose"]),
                    io.Combo.Input("vsa_gates", options=gate_choices(), default=FROM_MODEL_FILE, advanced=True,
                                   optional=True, tooltip=TIPS["vsa_gates"]),
                ],
                outputs=[io.Model.Output(display_name="model", tooltip="The model with solattn sparse attention.")],
            )

        @classmethod
        def execute(cls, model, selection, start_percent, end_percent, dense_blocks="",
                    min_tokens=DEFAULT_MIN_TOKENS, extra_tokens=0, sink_conditioning="exact_kv_and_rows",
                    verbose=True, vsa_gates=FROM_MODEL_FILE) -> io.NodeOutput:
            # an option's missing or optional input arrives as None: its default then
            nested = {k: DEFAULTS[k] if selection.get(k) is None else selection[k]
                      for k in ("tau", "keep_percent", "vsa_prefix")}
            return io.NodeOutput(apply(model, method=selection["selection"], start_percent=start_percent,
                                       end_percent=end_percent, dense_blocks=dense_blocks, min_tokens=min_tokens,
                                       extra_tokens=extra_tokens, sink_conditioning=sink_conditioning,
                                       verbose=verbose, vsa_gates=vsa_gates, **nested))

    return SolAttnModelSparseAttention


class ClassicNode:
    """The node on the classic node API (flat inputs), for a ComfyUI without v3's DynamicCombo."""

    CATEGORY = CATEGORY
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    DESCRIPTION = DESCRIPTION

    @classmethod
    def INPUT_TYPES(cls):
        def opt(name, **extra):
            return {"default": DEFAULTS[name], "tooltip": TIPS[name], **extra}

        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to patch."}),
                "method": (list(METHODS), {"default": "auto", "tooltip": TIPS["method"]}),
                "tau": ("FLOAT", opt("tau", min=0.0, max=4.0, step=0.05)),
                "keep_percent": ("FLOAT", opt("keep_percent", min=0.5, max=95.0, step=0.5)),
                "start_percent": ("FLOAT", opt("start_percent", min=0.0, max=1.0, step=0.01)),
                "end_percent": ("FLOAT", opt("end_percent", min=0.0, max=1.0, step=0.01)),
            },
            "optional": {
                "dense_blocks": ("STRING", opt("dense_blocks")),
                "min_tokens": ("INT", opt("min_tokens", min=0, max=1 << 20, step=512)),
                "extra_tokens": ("INT", opt("extra_tokens", min=0, max=256, step=64)),
                "sink_conditioning": (list(SINK_MODES), opt("sink_conditioning")),
                "vsa_prefix": (list(VSA_PREFIX_MODES), opt("vsa_prefix")),
                "verbose": ("BOOLEAN", opt("verbose")),
                "vsa_gates": (gate_choices(), opt("vsa_gates")),
            },
        }

    def patch(self, model, method, tau, keep_percent, start_percent, end_percent, **optional):
        return (apply(model, method=method, tau=tau, keep_percent=keep_percent, start_percent=start_percent,
                      end_percent=end_percent, **optional),)


#: the node ComfyUI registers here: v3 where available, else the classic one
SolAttnModelSparseAttention = _v3_node() or ClassicNode
NODE_CLASS_MAPPINGS = {NODE_ID: SolAttnModelSparseAttention}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: DISPLAY_NAME}
