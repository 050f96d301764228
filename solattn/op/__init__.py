"""The operator layer: the front doors :func:`sol_attn` / :func:`plan` (:mod:`.attn`) and
:func:`video_sparse_attn` / :func:`video_plan` (:mod:`.video`), the call they make
(:mod:`.call`), how it runs (:mod:`.custom`: the fast path of :mod:`.fast` or the custom op, and
their autograd), its way to a backend (:mod:`.route`), what a forward keeps for its backward
(:mod:`.saved`) and the backward (:mod:`.backward`).
"""

from .attn import plan, sol_attn
from .video import video_plan, video_sparse_attn

__all__ = ["sol_attn", "plan", "video_sparse_attn", "video_plan"]
