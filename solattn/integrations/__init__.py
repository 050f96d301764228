"""Integrations with other libraries. They live at the edge and depend inward only.

Nothing here is imported by ``import solattn``, so optional third-party packages stay
optional and importing has no side effects. Import the submodule you need and call it,
for example::

    from solattn.integrations import comfy_kitchen
    comfy_kitchen.install(devices=("xpu",))
"""
