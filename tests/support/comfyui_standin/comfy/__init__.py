"""Test stand-in for the ComfyUI interfaces the solattn node touches (see ../README.md)."""
