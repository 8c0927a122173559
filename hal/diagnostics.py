"""What a user must see goes through ``warnings`` (visible by default, filterable as usual by
category); ``logging`` (logger ``hal``) keeps the detail. One category per kind of problem, all
subclasses of :class:`HalWarning`::

    import warnings, hal
    warnings.simplefilter("error", hal.FallbackWarning)    # fail instead of falling back
    warnings.simplefilter("ignore", hal.MissingScaleWarning)
"""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger("hal")


class HalWarning(UserWarning):
    """Base of every warning hal issues."""


class FallbackWarning(HalWarning):
    """A call runs on the emu pack although the target has a native pack (every reason is given)."""


class MissingScaleWarning(HalWarning):
    """An FP8 cache was written or read without k_scale/v_scale: 1.0 is used."""


class EnvironmentWarning(HalWarning):
    """A HAL_* variable hal does not know (usually a typo)."""


class PackLoadWarning(HalWarning):
    """A pack failed to import or to probe its device; it is listed as unavailable with the reason."""


def warn(message: str, category: type[HalWarning] = HalWarning, *, stacklevel: int = 3) -> None:
    """Show ``message`` to the user (a warning) and record it in hal's log."""
    log.debug("%s: %s", category.__name__, message)
    warnings.warn(message, category, stacklevel=stacklevel)
