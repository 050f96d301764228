"""Every ```python example in the README and docs runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(doc, i, code) for doc in DOCS
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]


def test_there_are_examples():
    assert len([b for b in BLOCKS if b[0].name == "README.md"]) >= 5


@pytest.mark.parametrize("doc,i,code", BLOCKS, ids=[f"{d.name}-{i}" for d, i, _ in BLOCKS])
def test_doc_example_runs(doc, i, code):
    if "comfy_kitchen" in code:
        pytest.importorskip("comfy_kitchen")
    exec(compile(code, f"{doc.name}[{i}]", "exec"), {"__name__": "__main__"})
