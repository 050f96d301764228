"""Every ```python example in the README and docs runs as written. An example that needs what a
test machine lacks (a download, a real checkpoint) is fenced ```python no-run: shown, compiled,
not run."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(doc, i, code) for doc in DOCS
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]
SHOWN = [(doc, i, code) for doc in DOCS
         for i, code in enumerate(re.findall(r"```python no-run\n(.*?)```", doc.read_text(), re.S))]


def test_there_are_examples():
    assert len([b for b in BLOCKS if b[0].name == "README.md"]) >= 4


#: optional packages (pyproject.toml extras) an example may import: skipped where one is absent
OPTIONAL = ("diffusers", "comfy_kitchen", "accelerate", "matplotlib")


# an example that compiles takes about 15 s of CPU: it runs with the slow tests
@pytest.mark.parametrize("doc,i,code", [pytest.param(*b, marks=[pytest.mark.slow] if "torch.compile" in b[2] else [])
                                        for b in BLOCKS], ids=[f"{d.name}-{i}" for d, i, _ in BLOCKS])
def test_doc_example_runs(doc, i, code):
    if "comfy_kitchen" in code:
        pytest.importorskip("comfy_kitchen")
    for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", code, re.M):
        if name in OPTIONAL:
            pytest.importorskip(name, reason=f"the example needs the optional package {name}, not installed here")
    exec(compile(code, f"{doc.name}[{i}]", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("doc,i,code", SHOWN, ids=[f"{d.name}-no-run-{i}" for d, i, _ in SHOWN])
def test_shown_example_is_valid_python(doc, i, code):
    compile(code, f"{doc.name}[no-run {i}]", "exec")


# solattn is not on PyPI: `pip install solattn` / `solattn[extra]` (a bare name, not a path, a
# wheel or `solattn @ git+...`) would fetch nothing, or someone else's package
_PYPI_INSTALL = re.compile(r"pip install\s+(-U\s+|--upgrade\s+)?[\"']?solattn(\[[^\]]*\])?[\"']?(?!\s*@)(?=[\s`)\"',.;]|$)")


def test_no_doc_or_message_installs_solattn_from_pypi():
    """A command that would fetch solattn from PyPI appears only on a line saying that it finds nothing."""
    files = DOCS + sorted((ROOT / "solattn").rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}: {line.strip()!r}" for path in files
             for line in path.read_text().splitlines()
             if _PYPI_INSTALL.search(line) and "finds nothing" not in line]
    assert found == [], found


def test_pypi_install_pattern():
    for bad in ('pip install solattn', 'pip install "solattn[comfy]"', "`pip install solattn`."):
        assert _PYPI_INSTALL.search(bad), bad
    for good in ('pip install -e .', 'pip install "solattn @ git+https://x/solattn"', 'pip install /path/to/solattn',
                 'pip install -e "/path/to/solattn[comfy]"', 'pip install solattn-0.1.0-py3-none-any.whl'):
        assert not _PYPI_INSTALL.search(good), good


def test_readme_head_dims_are_the_backends():
    """The README's backend table gives each backend's head dims as the code accepts them."""
    from solattn import dispatch
    text = (ROOT / "README.md").read_text().split("## Backends and devices", 1)[1]
    rows = re.findall(r"^\| `(\w+)`[^|]*\|.*\| ([^|]+) \|$", text.split("\n\n## ", 1)[0], re.M)
    assert {name for name, _ in rows} >= {"sdpa", "triton", "flex", "reference"}, rows
    for name, cell in rows:
        dims = dispatch.get_backend(name).head_dims
        assert cell == ("any" if dims is None else ", ".join(map(str, sorted(dims)))), (name, cell)


def test_no_clone_into_a_folder_named_like_the_package():
    """A checkout in a folder named ``solattn``, run from its parent folder, is imported as an empty
    namespace package (the parent is on ``sys.path`` first): no doc clones into such a folder."""
    clones = [(doc.name, line.strip()) for doc in DOCS for line in doc.read_text().splitlines()
              if re.search(r"\bgit clone\b", line)]
    assert clones
    for doc, line in clones:
        words = re.sub(r"<[^>]*>", "URL", line).split("&&")[0].split("#")[0].split()
        target = words[words.index("clone") + 2:]            # after `git clone URL`; none: the repo's name
        assert target and target[0].rstrip("/").replace("\\", "/").split("/")[-1] != "solattn", (doc, line)
