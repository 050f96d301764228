"""`python -m solattn info` and `check`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from solattn import cli


@pytest.mark.slow
def test_info_lists_torch_devices_and_backends():
    res = subprocess.run([sys.executable, "-m", "solattn", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert torch.__version__ in res.stdout
    assert "devices: cpu" in res.stdout
    for name in ("sdpa", "reference"):
        assert f"  {name}" in res.stdout
    assert "priority: sdpa" in res.stdout


# the flex backend compiles each problem on its first call (about a minute for all of them on a
# 2-core CPU): the default run checks sdpa, the slow run every backend that can run here
@pytest.mark.parametrize("backends", [["--backends", "sdpa"], pytest.param([], marks=pytest.mark.slow)],
                         ids=["sdpa", "every-backend"])
def test_check_passes_here(capsys, backends):
    assert cli.main(["check", "--device", "cpu", *backends]) == 0
    out = capsys.readouterr().out
    assert "sdpa" in out and "pass" in out and "FAIL" not in out
    if backends:
        assert {line.split()[0] for line in out.splitlines()[1:-1]} == {"sdpa"}


def test_check_fails_with_exit_code_1_when_a_backend_is_wrong(monkeypatch, capsys):
    from solattn.backends import sdpa as sdpamod
    real = sdpamod.sdpa_forward
    monkeypatch.setattr(sdpamod, "sdpa_forward", lambda p, plan, nbytes=None: real(p, plan) * 1.1)
    assert cli.main(["check", "--device", "cpu", "--backends", "sdpa"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out


def test_check_of_a_backend_that_cannot_run_here_says_why_and_fails(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["check", "--device", "cpu", "--backends", "triton"]) == 1
    out = capsys.readouterr().out
    assert "triton     not run here: " in out and "none of triton can run here" in out


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "solattn", *args], capture_output=True, text=True, timeout=120)


MISTAKES = [
    (("check", "--device", "foo"), "--device", "'foo'"),
    (("bench", "--shapes", "1,100,2"), "--shapes", "'1,100,2'"),
    (("bench", "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"), "--device", "cuda"),
    (("check", "--device", "cuda:99"), "--device", "'cuda:99'"),
    (("bench", "--ratios", "2"), "--ratios", "2"),
    (("check", "--backends", "sdpa", "reference"), "--backends", "'reference'"),
]


def assert_one_line_usage_error(args, option, value, returncode, out, err):
    assert returncode == 2, (returncode, err)
    err = err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert f"python -m solattn {args[0]}: error:" in err and option in err and value in err
    assert "allowed" in err                                     # says what would work
    if option == "--device":
        assert "a device present here: cpu" in err
    assert out == ""


@pytest.mark.parametrize("args,option,value", MISTAKES)
def test_user_mistakes_are_one_line_usage_errors(args, option, value, capsys):
    try:
        returncode = cli.main(list(args))
    except SystemExit as exc:
        returncode = exc.code
    captured = capsys.readouterr()
    assert_one_line_usage_error(args, option, value, returncode, captured.out, captured.err)


def test_a_usage_error_from_the_command_line_is_one_line():
    """The same through ``python -m solattn`` in a fresh interpreter, where an uncaught error would
    print a traceback."""
    args, option, value = MISTAKES[0]
    res = run_cli(*args)
    assert_one_line_usage_error(args, option, value, res.returncode, res.stdout, res.stderr)


def test_device_names_present_here_are_accepted():
    from solattn.bench.parsing import parse_device
    assert parse_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert parse_device("cuda:0") == torch.device("cuda:0")


def test_cpu_device_index():
    """``cpu:0`` names the one CPU device (torch accepts it); ``cpu:1`` is refused for what it is,
    not with "cpu is not available here"."""
    from solattn.bench.parsing import UsageError, parse_device
    assert parse_device("cpu:0") == torch.device("cpu")
    with pytest.raises(UsageError, match=r"received 'cpu:1': there is no cpu:1; allowed: .*cpu"):
        parse_device("cpu:1")


def _long_reason():
    return ("this reason is deliberately long so that it cannot fit on one terminal line: "
            + " ".join(f"word{i}" for i in range(40)) + " and it ends with the decisive detail")


def test_check_prints_skip_reasons_whole(monkeypatch, capsys):
    from solattn.backends import sdpa as sdpamod
    reason = _long_reason()
    monkeypatch.setattr(sdpamod.SdpaBackend, "not_supported_reasons", lambda self, p: [reason])
    monkeypatch.setenv("COLUMNS", "100")
    cli.main(["check", "--device", "cpu", "--backends", "sdpa"])
    out = capsys.readouterr().out
    assert reason in " ".join(out.split())                     # every word, in order, none cut
    assert all(len(line) <= 100 for line in out.splitlines())  # wrapped at word boundaries
    assert "skip" in out


def test_check_prints_failure_messages_whole(monkeypatch, capsys):
    from solattn.backends import sdpa as sdpamod
    reason = _long_reason()

    def boom(self, p, plan):
        raise RuntimeError(reason)

    monkeypatch.setattr(sdpamod.SdpaBackend, "forward", boom)
    assert cli.main(["check", "--device", "cpu", "--backends", "sdpa"]) == 1
    out = capsys.readouterr().out
    assert f"RuntimeError: {reason}" in " ".join(out.split()) and "FAILED" in out


def _hide_comfy_kitchen(monkeypatch):
    for name in [n for n in sys.modules if n == "comfy_kitchen" or n.startswith("comfy_kitchen.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)      # `import comfy_kitchen` raises ImportError


@pytest.mark.parametrize("value,says", [
    ("auto", "needs the comfy-kitchen package"),
    ("gpu", "allowed: 'auto' or a comma-separated list of device types"),
])
def test_info_reports_a_comfy_kitchen_plugin_it_cannot_install(monkeypatch, capsys, value, says):
    """``SOLATTN_COMFY_KITCHEN`` set without comfy-kitchen, or to a bad value: ``info`` says so in
    one line and succeeds."""
    from solattn.integrations import comfy_kitchen as plugin
    assert not plugin.is_installed()
    _hide_comfy_kitchen(monkeypatch)
    monkeypatch.setenv("SOLATTN_COMFY_KITCHEN", value)
    assert cli.main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"comfy-kitchen plug-in: SOLATTN_COMFY_KITCHEN={value!r} asks for it, but it is not installed" in out
    assert says in out and not plugin.is_installed()


def test_info_reports_the_plugin_off_or_installed(monkeypatch, capsys):
    from solattn.integrations import comfy_kitchen as plugin
    monkeypatch.delenv("SOLATTN_COMFY_KITCHEN", raising=False)
    assert cli.main(["info"]) == 0
    assert "comfy-kitchen plug-in: off (SOLATTN_COMFY_KITCHEN is unset" in capsys.readouterr().out
    pytest.importorskip("comfy_kitchen")
    monkeypatch.setenv("SOLATTN_COMFY_KITCHEN", "cpu")
    try:
        assert cli.main(["info"]) == 0
        assert "comfy-kitchen plug-in: installed for cpu" in capsys.readouterr().out
        assert plugin.installed_devices() == ("cpu",)
    finally:
        plugin.uninstall()
