"""A HAL_* value hal does not understand: ``import hal`` raises ``hal.EnvValueError`` (one type, its
message naming the variable, the value and what is accepted); every CLI says the same in one line with
no traceback, and hal-probe reports it as a finding and probes on without it (exit 0, as its --help
promises). Each case runs in a fresh process: the check happens at import."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import hal
from hal.cli import probe

pytestmark = pytest.mark.emu

ROOT = pathlib.Path(__file__).resolve().parents[1]
BAD = {  # variable: (value, words its message must hold)
    "HAL_TARGET": ("sm90", ["HAL_TARGET='sm90'", "not understood", "sm_XX", "gfxNNN"]),
    "HAL_STRICT": ("maybe", ["HAL_STRICT='maybe'", "expected 0 or 1"]),
    "HAL_DEBUG": ("2", ["HAL_DEBUG='2'", "expected 0 or 1"]),
    "HAL_CUDA_PREFILL": ("fast", ["HAL_CUDA_PREFILL='fast'", "auto, mma, wgmma, cute"]),
    "HAL_PACK": ("nope", ["HAL_PACK='nope'", "the name of a pack", "emu"]),
}
# (program, how to start it from the checkout's tools/ shim, or None where the CLI has no shim)
CLIS = [("hal-probe", "probe"), ("hal-bench", "bench"), ("hal-eval", "evaluate"), ("hal-demo", None),
        ("hal-scales", "scales")]


def _env(extra: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    return {**clean, "PYTHONPATH": path, "COLUMNS": "200", **extra}


def _run(argv: list[str], extra: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_env(extra), capture_output=True, text=True, timeout=300, cwd=str(ROOT))


def _launch(prog: str, extra: dict, *args: str) -> subprocess.CompletedProcess:
    """``prog`` as its console script runs it (hal_launch's function of that name)."""
    fn = {"hal-probe": "probe", "hal-bench": "bench", "hal-eval": "evaluate", "hal-demo": "demo",
          "hal-scales": "scales"}[prog]
    code = f"import sys, hal_launch; sys.argv = [{prog!r}, *{list(args)!r}]; sys.exit(hal_launch.{fn}())"
    return _run([sys.executable, "-c", code], extra)


@pytest.mark.parametrize("variable", list(BAD))
def test_import_hal_raises_one_documented_type(variable):
    value, words = BAD[variable]
    code = ("import json, sys\ntry:\n    import hal\nexcept Exception as e:\n"
            "    print(json.dumps([type(e).__module__, type(e).__name__, isinstance(e, ValueError), str(e),"
            " e.variable, e.value]))\n    sys.exit(3)\n")
    r = _run([sys.executable, "-c", code], {variable: value})
    assert r.returncode == 3, r.stderr
    module, name, is_value_error, message, var, val = json.loads(r.stdout)
    assert (module, name, is_value_error, var, val) == ("hal.env", "EnvValueError", True, variable, value)
    assert all(w in message for w in words), message
    assert hal.EnvValueError is hal.env.EnvValueError


@pytest.mark.parametrize("prog", [p for p, _ in CLIS if p != "hal-probe"])
def test_every_cli_says_a_refused_value_in_one_line(prog):
    r = _launch(prog, {"HAL_TARGET": "sm90"}, "--help")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{prog}: HAL_TARGET='sm90' is not understood") and "sm_XX" in lines[0]


def test_probe_reports_every_refused_value_and_exits_0():
    r = _launch("hal-probe", {"HAL_TARGET": "sm90", "HAL_STRICT": "maybe"}, "--no-smoke", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    ignored = " ".join(report["ignored_env"])
    assert "HAL_TARGET='sm90'" in ignored and "HAL_STRICT='maybe'" in ignored, ignored
    assert report["target"]["source"] != "HAL_TARGET" and "error" not in report["target"]  # probed without it
    assert report["packs"] and "error" not in report["dispatch"]
    text = _launch("hal-probe", {"HAL_TARGET": "sm90"}, "--no-smoke")
    assert text.returncode == 0 and "ignored: HAL_TARGET='sm90' is not understood" in text.stdout, text.stdout


def test_probe_in_a_process_where_hal_is_already_imported(monkeypatch, capsys):
    """A value set after ``import hal`` (no launcher in between) is reported the same way."""
    monkeypatch.setenv("HAL_TARGET", "gfx")
    monkeypatch.setenv("HAL_PACK", "cdua")
    assert probe.main(["--no-smoke", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("HAL_TARGET='gfx'" in m for m in report["ignored_env"])
    assert any("HAL_PACK='cdua'" in m and "emu" in m for m in report["ignored_env"])
    assert "error" not in report["target"] and "error" not in report["dispatch"]


@pytest.mark.parametrize("prog,shim", [c for c in CLIS if c[1]])
def test_checkout_shims_go_through_the_launcher(prog, shim):
    r = _run([sys.executable, str(ROOT / "tools" / shim), "--help"], {"HAL_DEBUG": "maybe"})
    if prog == "hal-probe":   # --help is argparse's: the probe's own report is not reached
        assert r.returncode == 0 and "Always exits 0" in " ".join(r.stdout.split())
        return
    assert r.returncode == 2 and r.stderr.strip() == (f"{prog}: HAL_DEBUG='maybe' is not understood: expected 0 or 1 "
                                                      f"(also accepted: true/false, yes/no, on/off)"), r.stderr


def test_installed_console_scripts_go_through_the_launcher():
    """The scripts pip wrote beside this interpreter (absent when hal runs from a checkout)."""
    scripts = {p: shutil.which(p, path=str(pathlib.Path(sys.executable).parent)) for p, _ in CLIS}
    if not all(scripts.values()):
        pytest.skip(f"hal's console scripts are not installed beside {sys.executable}")
    for prog, path in scripts.items():
        r = _run([path, "--help"], {"HAL_STRICT": "maybe"})
        if prog == "hal-probe":
            assert r.returncode == 0, r.stderr
            continue
        assert r.returncode == 2 and r.stderr.startswith(f"{prog}: HAL_STRICT='maybe'"), (prog, r.stderr)
