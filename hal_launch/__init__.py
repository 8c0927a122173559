"""Where hal's console scripts start (hal-probe, hal-bench, hal-eval, hal-demo, hal-scales; the
``tools/`` shims of a checkout too).

``import hal`` checks the ``HAL_*`` variables and raises :class:`hal.EnvValueError` for a value it
cannot parse. A CLI cannot catch that itself: importing any ``hal.cli`` module runs the check first.
So each script imports its CLI here. A refused value becomes one line on stderr naming the variable,
its value and what is accepted, and exit status 2; never a traceback. hal-probe, whose job is to say
why hal misbehaves, instead reports every such value as a finding and probes on without it."""

from __future__ import annotations

import importlib
import os
import sys

CLIS = {"hal-probe": "hal.cli.probe", "hal-bench": "hal.cli.bench", "hal-eval": "hal.cli.evaluate",
        "hal-demo": "hal.cli.demo", "hal-scales": "hal.cli.scales", "hal-tune": "hal.kernelpacks.cuda.tune"}


def _import(module: str):
    """``(module, None)``, or ``(None, error)`` when hal's import refused a HAL_* value. Any other
    import failure propagates: it is a broken install, and its traceback is the report."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        env = sys.modules.get("hal.env")
        if env is None or not isinstance(exc, env.EnvValueError):
            raise
        for name in [m for m in sys.modules if m == "hal" or m.startswith("hal.")]:
            del sys.modules[name]   # the half-imported package, so a retry imports it whole
        return None, exc


def run(prog: str) -> int:
    """Import ``prog``'s CLI and run its ``main()``; the exit status."""
    module, refused = _import(CLIS[prog])
    if module is None:
        sys.stderr.write(f"{prog}: {refused}\n")
        return 2
    return module.main()


def probe() -> int:
    """hal-probe: each HAL_* value hal refuses is dropped from this process's environment and named in
    the report, so the rest of the report is what hal does without it."""
    ignored = []
    for _ in range(len(os.environ) + 1):   # each pass drops one variable, so this ends
        module, refused = _import(CLIS["hal-probe"])
        if module is not None:
            return module.main(ignored_env=ignored)
        ignored.append(str(refused))
        os.environ.pop(refused.variable, None)
    raise RuntimeError("hal-probe: the HAL_* checks at import did not settle")


def bench() -> int:
    return run("hal-bench")


def evaluate() -> int:
    return run("hal-eval")


def demo() -> int:
    return run("hal-demo")


def scales() -> int:
    return run("hal-scales")


def tune() -> int:
    return run("hal-tune")
