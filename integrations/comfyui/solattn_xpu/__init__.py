"""ComfyUI custom node folder: route ``comfy_kitchen.sol_attn`` through solattn on XPU, MPS and CPU.

Put this folder (or a symlink to it) in ``ComfyUI/custom_nodes/``. ComfyUI imports it at
start-up; the import installs solattn's comfy-kitchen plug-in for the device types present
(``xpu`` and ``mps`` when available, and ``cpu``) and logs one line saying so. It adds no
nodes: models that call ``comfy_kitchen.sol_attn`` (VSA / Sol-Attn checkpoints) pick the
plug-in up on those devices, while CUDA and ROCm calls keep comfy-kitchen's own kernels.

``cpu`` is included because comfy-kitchen's only CPU implementation of ``sol_attn`` is
its O(T^2) reference, which refuses long videos; solattn computes the same operator in
bounded memory. Set ``SOLATTN_COMFY_KITCHEN`` (e.g. ``xpu``) before starting ComfyUI to
choose the devices yourself: solattn then installs the plug-in at import, and this
folder keeps that choice.

Needs the ``solattn`` and ``comfy-kitchen`` packages in ComfyUI's Python environment. If
solattn is not installed but this folder sits inside a solattn checkout (or is a symlink
into one), the checkout is used. If something is missing, one error line is logged and
ComfyUI starts normally.
"""

import logging
import os
import sys

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

_log = logging.getLogger("solattn.comfyui")


def _import_plugin():
    """``solattn.integrations.comfy_kitchen``, from site-packages or the enclosing checkout."""
    try:
        from solattn.integrations import comfy_kitchen as plugin
        return plugin
    except ImportError:
        # integrations/comfyui/solattn_xpu/__init__.py -> the checkout root, symlinks resolved
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
        if not os.path.isfile(os.path.join(root, "solattn", "__init__.py")) or root in sys.path:
            raise
        sys.path.insert(0, root)
        from solattn.integrations import comfy_kitchen as plugin
        return plugin


def _setup():
    try:
        plugin = _import_plugin()
    except ImportError as exc:
        _log.error("solattn: not installed, comfy_kitchen.sol_attn keeps its own backends "
                   "(install solattn from a checkout or a wheel: pip install -e /path/to/solattn; it is not on PyPI; or symlink this folder from a solattn checkout): %s", exc)
        return None
    try:
        # SOLATTN_COMFY_KITCHEN, if set, already installed it during `import solattn`
        devices = plugin.installed_devices() or plugin.install(plugin.available_devices())
    except (ImportError, RuntimeError, ValueError) as exc:
        _log.error("solattn: comfy-kitchen plug-in not installed: %s", exc)
        return None
    _log.info("solattn: comfy_kitchen.sol_attn on %s now runs solattn's '%s' backend "
              "(comfy-kitchen backend '%s', first in priority)",
              ", ".join(devices), plugin.SOLATTN_BACKEND, plugin.BACKEND_NAME)
    return devices


INSTALLED_DEVICES = _setup()
