"""Dense attention with ComfyUI's override hook: a set override replaces the call and gets the
attention function as its first argument."""

import torch


def _dense(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
           skip_output_reshape=False, **kwargs):
    if skip_reshape:                                    # (B, H, N, D)
        b, _, _, dim_head = q.shape
    else:                                               # (B, N, H * D)
        b, _, inner = q.shape
        dim_head = inner // heads
        q, k, v = (t.unflatten(-1, (heads, dim_head)).transpose(1, 2) for t in (q, k, v))
    if mask is not None and mask.ndim == 2:
        mask = mask[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           scale=kwargs.get("scale"))
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def attention_pytorch(q, k, v, heads, **kwargs):
    kwargs.pop("preferred_attention", None)
    if not kwargs.pop("_inside_attn_wrapper", False):
        options = kwargs.get("transformer_options") or {}
        override = options.get("optimized_attention_override")
        if override is not None:
            return override(attention_pytorch, q, k, v, heads, _inside_attn_wrapper=True, **kwargs)
    return _dense(q, k, v, heads, **kwargs)


optimized_attention = attention_pytorch
