"""ComfyUI custom node folder: "Model Sparse Attention (solattn)", and the comfy-kitchen plug-in
on request.

Put this folder (or a symlink to it) in ``ComfyUI/custom_nodes/`` and use the node where
ComfyUI's built-in "Model Sparse Attention" node would go: MODEL in, MODEL out. It runs
MiniMax-H3 (FastH3) VSA and Sol-Attn / SLA on any model through solattn on xpu, cpu, mps and
cuda. The node logic lives in ``solattn.integrations.comfyui``.

With ``SOLATTN_COMFY_KITCHEN`` set before ComfyUI starts (``xpu``, ``xpu,cpu``, ``auto``...),
the import also installs solattn's comfy-kitchen plug-in for those device types, so that
models calling ``comfy_kitchen.sol_attn`` run solattn there (``solattn.integrations.comfy_kitchen``),
and logs one line saying so. A bad value or a missing comfy-kitchen is logged as one error line;
the node is registered either way.

Needs the ``solattn`` package in ComfyUI's Python environment (and ``comfy-kitchen`` for the
plug-in). If solattn is not installed but this folder sits inside a solattn checkout (or is a
symlink into one), the checkout is used. If solattn cannot be imported, one error line is logged
and ComfyUI starts without the node.
"""

import importlib
import logging
import os
import sys

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

_log = logging.getLogger("solattn.comfyui")
_ENV_VAR = "SOLATTN_COMFY_KITCHEN"   # solattn.integrations.comfy_kitchen.ENV_VAR
_NODE = "'Model Sparse Attention (solattn)'"


def _import_integration(name):
    """``solattn.integrations.<name>``, from site-packages or the enclosing checkout."""
    try:
        return importlib.import_module("solattn.integrations." + name)
    except ImportError:
        # integrations/comfyui/solattn_sparse_attention/__init__.py -> the checkout root, symlinks resolved
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
        if not os.path.isfile(os.path.join(root, "solattn", "__init__.py")) or root in sys.path:
            raise
        sys.path.insert(0, root)
        return importlib.import_module("solattn.integrations." + name)


def _register_node():
    """Register the node; True when solattn was imported."""
    # `import solattn` would install the plug-in itself and raise on a bad value or a missing
    # comfy-kitchen, taking the node down with it: keep the variable away from that import and
    # install the plug-in afterwards (_install_plugin), where its errors are only logged
    asked = os.environ.pop(_ENV_VAR, None)
    try:
        nodes = _import_integration("comfyui")
    except ImportError as exc:
        found = sys.modules.get("solattn")
        if found is not None:   # an older solattn without the node module shadows this checkout
            _log.error("solattn: the solattn at %s has no ComfyUI node module; install this version "
                       "(pip install /path/to/solattn) to get %s: %s",
                       os.path.dirname(getattr(found, "__file__", "") or "?"), _NODE, exc)
        else:
            _log.error("solattn: not installed, the node %s is unavailable (pip install a solattn "
                       "checkout or wheel, or symlink this folder from a checkout): %s", _NODE, exc)
        return False
    finally:
        if asked is not None:
            os.environ[_ENV_VAR] = asked
    NODE_CLASS_MAPPINGS.update(nodes.NODE_CLASS_MAPPINGS)
    NODE_DISPLAY_NAME_MAPPINGS.update(nodes.NODE_DISPLAY_NAME_MAPPINGS)
    return True


def _install_plugin():
    """The comfy-kitchen plug-in as ``SOLATTN_COMFY_KITCHEN`` asks: its device types, or None."""
    if not os.environ.get(_ENV_VAR, "").strip():
        return None
    try:
        plugin = _import_integration("comfy_kitchen")
        devices = plugin.install_from_env()   # a second install with the same devices changes nothing
    except (ImportError, RuntimeError, ValueError) as exc:
        _log.error("solattn: comfy-kitchen plug-in not installed, comfy_kitchen.sol_attn keeps its own "
                   "backends: %s", exc)
        return None
    _log.info("solattn: comfy_kitchen.sol_attn on %s now runs solattn's '%s' backend "
              "(comfy-kitchen backend '%s', first in priority)",
              ", ".join(devices), plugin.SOLATTN_BACKEND, plugin.BACKEND_NAME)
    return devices


#: the device types the comfy-kitchen plug-in was installed for by this import, or None
INSTALLED_DEVICES = _install_plugin() if _register_node() else None
