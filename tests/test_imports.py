"""``import solattn`` has no side effects: the environment does not install integrations."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a Python without comfy-kitchen looks like, whether or not it is installed here
NO_COMFY_KITCHEN = "import sys; sys.modules['comfy_kitchen'] = None\n"


def run_python(code: str, env_value: str):
    env = dict(os.environ, SOLATTN_COMFY_KITCHEN=env_value)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", ["auto", pytest.param("cpu", marks=pytest.mark.slow),
                                   pytest.param("cuda", marks=[pytest.mark.slow, pytest.mark.gpu])])
def test_import_ignores_the_comfy_kitchen_variable(value):
    res = run_python("import sys, solattn\n"
                     "from solattn.integrations import comfy_kitchen as p\n"
                     "print(p.is_installed(), sorted(m for m in sys.modules if m.startswith('comfy_kitchen')))",
                     value)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False []"


def test_command_line_runs_with_the_variable_and_without_comfy_kitchen():
    res = run_python(NO_COMFY_KITCHEN + "import runpy; sys.argv = ['solattn', 'info']\n"
                     "runpy.run_module('solattn', run_name='__main__')", "auto")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "backends on cpu" in res.stdout and "sdpa" in res.stdout


def test_explicit_install_without_comfy_kitchen_says_how_to_get_it():
    res = run_python(NO_COMFY_KITCHEN + "from solattn.integrations import comfy_kitchen as p\n"
                     "try:\n    p.install_from_env()\nexcept ImportError as e:\n    print('ImportError', e)",
                     "auto")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ImportError") and "pip install comfy-kitchen" in res.stdout
