"""Custom nodes for the real-ComfyUI tests only (loaded from a temporary ``custom_nodes``).

No text encoder runs in the test environment, so conditioning is built here: zero text states of
the shape MiniMax-H3's ``condition_proj`` takes. The sampled latent is written to a file by an
output node, so the test process can read it after the executor finished.
"""

import torch


class SolAttnTestZeroConditioning:
    """CONDITIONING of ``tokens`` zero text states of width ``dim`` (MiniMax-H3: its text_dim)."""

    CATEGORY = "testing"
    FUNCTION = "make"
    RETURN_TYPES = ("CONDITIONING",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tokens": ("INT", {"default": 77, "min": 1, "max": 4096}),
                             "dim": ("INT", {"default": 64, "min": 1, "max": 8192})}}

    def make(self, tokens, dim):
        return ([[torch.zeros(1, tokens, dim), {}]],)


class SolAttnTestSaveLatent:
    """Writes the latent's tensors (a nested video/audio latent is saved as its list) to ``path``."""

    CATEGORY = "testing"
    FUNCTION = "save"
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "path": ("STRING", {"default": ""})}}

    def save(self, samples, path):
        s = samples["samples"]
        tensors = list(s.unbind()) if getattr(s, "is_nested", False) else [s]
        torch.save([t.detach().clone().float() for t in tensors], path)
        return ()


class SolAttnTestPreferredAttention:
    """Gives every MiniMax-H3 DiT block an attention choice of its own, as a checkpoint's attention
    configuration does (``attn.comfy_attention.function``, which ComfyUI passes to the attention
    call as ``preferred_attention=``): ComfyUI's SDPA attention, counting its calls in ``calls``."""

    CATEGORY = "testing"
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    calls = 0

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def patch(self, model):
        from comfy.ldm.modules import attention

        def counted(q, k, v, heads, **kwargs):
            SolAttnTestPreferredAttention.calls += 1
            return attention.attention_pytorch(q, k, v, heads, **kwargs)

        function = attention.wrap_attn(counted)
        for block in model.get_model_object("diffusion_model").blocks:
            block.attn.comfy_attention.function = function
        return (model,)


class SolAttnTestDeepClone:
    """A clone of the model holding a fresh copy of it (``clone(force_deepcopy=True)``: what
    ComfyUI's multi-GPU clones and non-dynamic delegates do); the source model's Wan
    self-attention weights are then set to NaN, so a sample that still runs them is not finite."""

    CATEGORY = "testing"
    FUNCTION = "clone"
    RETURN_TYPES = ("MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def clone(self, model):
        copy = model.clone(force_deepcopy=True)
        assert copy.model is not model.model
        with torch.no_grad():
            for block in model.model.diffusion_model.blocks:
                block.self_attn.q.weight.fill_(float("nan"))
        return (copy,)


NODE_CLASS_MAPPINGS = {
    "SolAttnTestDeepClone": SolAttnTestDeepClone,
    "SolAttnTestPreferredAttention": SolAttnTestPreferredAttention,
    "SolAttnTestZeroConditioning": SolAttnTestZeroConditioning,
    "SolAttnTestSaveLatent": SolAttnTestSaveLatent,
}
