"""Command-line entry points (hal-probe, hal-bench, hal-scales, hal-eval, hal-demo); thin shims live in tools/."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def hal_log_to(console, *, level: int | None = None, show_time: bool = True):
    """While the block runs, hal's log records go to ``console`` (stderr) through rich; ``level``
    lowers the "hal" logger's threshold for the block. Both are undone afterwards."""
    from rich.logging import RichHandler

    logger = logging.getLogger("hal")
    handler = RichHandler(console=console, show_path=False, show_time=show_time)
    old = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
