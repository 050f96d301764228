"""Integrations with other libraries. They live at the edge and depend inward only.

Nothing here is imported by ``import solattn`` (except the comfy-kitchen plug-in,
and only when ``SOLATTN_COMFY_KITCHEN`` is set), so optional third-party packages
stay optional. Import the submodule you need, for example::

    from solattn.integrations import comfy_kitchen
    comfy_kitchen.install(devices=("xpu",))
"""
