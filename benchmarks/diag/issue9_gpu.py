"""GPU diagnosis for the sdpa mask regressions (huge finite biases; bf16 tail precision)."""
import math, sys, torch, torch.nn.functional as F
import solattn
from solattn.testing import block_structured_qkv

dev = "cuda"
def rel(a, b):
    a, b = a.double(), b.double(); return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

print("torch", torch.__version__, torch.cuda.get_device_name())
print("== 1. huge finite biases, tail off, tau 0.3, T=300 H=2 D=64")
for dt in (torch.bfloat16, torch.float16):
    q, k, v = block_structured_qkv(1, 300, 2, 64, dt, dev, seed=22, spread=3.0, key_offset=4.0, normalise=True)
    one = torch.zeros(300, device=dev); one[70] = 7e4
    for name, bias in [("-1e5", torch.full((300,), -1e5, device=dev)), ("one 7e4", one),
                       ("f32min", torch.full((300,), torch.finfo(torch.float32).min, device=dev))]:
        got = solattn.sol_attn(q, k, v, tau=0.3, tail=False, key_bias=bias, backend="sdpa")
        ref = solattn.sol_attn(q, k, v, tau=0.3, tail=False, key_bias=bias, backend="reference")
        print(f"  {dt} {name:8s} sdpa err {rel(got, ref):.3e} finite {bool(torch.isfinite(got).all())} "
              f"zeros {(got == 0).all(dim=-1).float().mean().item():.3f}")
print("== 1b. raw SDPA with one additive mask value on every key (bf16/fp16 q,k,v 1x1x64x128)")
for dt in (torch.bfloat16, torch.float16):
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(4, 1, 64, 128, device=dev, generator=g).to(dt) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for val in (-torch.finfo(dt).max, -1e38, -1e30, -1e20, -1e10, -65504.0, -1e4):
        if abs(val) > torch.finfo(dt).max: continue
        m = torch.full((4, 1, 64, 64 * 3), val, device=dev, dtype=dt)
        kk, vv = k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m)
        r = F.scaled_dot_product_attention(q.float(), kk.float(), vv.float(), attn_mask=m.float())
        print(f"  {dt} mask {val:.3e}: err vs fp32 {rel(o, r):.3e} finite {bool(torch.isfinite(o).all())}")
print("== 2. bf16 tail precision vs logit magnitude (B=1 T=2048 H=4 D=128, topk 0.1)")
for mult in (1, 4, 16, 64, 256):
    q, k, v = block_structured_qkv(1, 2048, 4, 128, torch.float32, dev, seed=3, spread=3.0, key_offset=4.0, normalise=True)
    q = (q * mult).to(torch.bfloat16); k = k.to(torch.bfloat16); v = v.to(torch.bfloat16)
    logit = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2) * 128 ** -0.5).abs().max().item()
    row = [f"max|logit| {logit:8.1f}"]
    for tail in (True, False):
        ref = solattn.sol_attn(q.float(), k.float(), v.float(), topk_ratio=0.1, tail=tail, backend="reference")
        for b in ("sdpa", "triton", "reference"):
            try:
                o = solattn.sol_attn(q, k, v, topk_ratio=0.1, tail=tail, backend=b)
                row.append(f"{b}{'+t' if tail else ''} {rel(o, ref):.2e}")
            except Exception as e:
                row.append(f"{b} ERR {type(e).__name__}")
    print("  " + "  ".join(row))
