"""ComfyUI custom node folder: "Model Sparse Attention (solattn)".

Put this folder (or a symlink to it) in ``ComfyUI/custom_nodes/`` and use the node where
ComfyUI's built-in "Model Sparse Attention" node would go: MODEL in, MODEL out. It runs
MiniMax-H3 (FastH3) VSA and Sol-Attn / SLA on any model through solattn on xpu, cpu, mps and
cuda. The node logic lives in ``solattn.integrations.comfyui``.

Needs the ``solattn`` package in ComfyUI's Python environment. If it is not installed but this
folder sits inside a solattn checkout (or is a symlink into one), the checkout is used. If
solattn cannot be imported, one error line is logged and ComfyUI starts without the node.
"""

import logging
import os
import sys

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

_log = logging.getLogger("solattn.comfyui")


def _import_node_module():
    """``solattn.integrations.comfyui``, from site-packages or the enclosing checkout."""
    try:
        from solattn.integrations import comfyui as nodes
        return nodes
    except ImportError:
        # integrations/comfyui/solattn_sparse_attention/__init__.py -> the checkout root
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
        if not os.path.isfile(os.path.join(root, "solattn", "__init__.py")) or root in sys.path:
            raise
        sys.path.insert(0, root)
        from solattn.integrations import comfyui as nodes
        return nodes


try:
    _nodes = _import_node_module()
except ImportError as exc:
    _found = sys.modules.get("solattn")
    if _found is not None:   # an older solattn without the node module shadows this checkout
        _log.error("solattn: the solattn at %s has no ComfyUI node module; install this version "
                   "(pip install /path/to/solattn) to get 'Model Sparse Attention (solattn)': %s",
                   os.path.dirname(getattr(_found, "__file__", "") or "?"), exc)
    else:
        _log.error("solattn: not installed, the node 'Model Sparse Attention (solattn)' is unavailable "
                   "(pip install a solattn checkout or wheel, or symlink this folder from a checkout): %s", exc)
else:
    NODE_CLASS_MAPPINGS.update(_nodes.NODE_CLASS_MAPPINGS)
    NODE_DISPLAY_NAME_MAPPINGS.update(_nodes.NODE_DISPLAY_NAME_MAPPINGS)
