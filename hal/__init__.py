"""hal: one call for paged attention over a scaled-FP8 KV cache, dispatched to the best kernel pack
for the silicon it runs on.

    import hal
    hal.target()                    # what this process runs on
    hal.packs()                     # every pack, with availability and reasons
    hal.cache_kv(k, v, key_cache, value_cache, slot_mapping, k_scale=ks, v_scale=vs)
    out = hal.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, k_scale=ks, v_scale=vs)
    print(hal.explain(q, key_cache, value_cache, block_tables, seq_lens).text())
    p = hal.plan("paged_attention", q, key_cache, value_cache, block_tables, seq_lens, k_scale=ks, v_scale=vs)
    out = p.run(q, key_cache, value_cache, k_scale=ks, v_scale=vs)   # per layer: no validation, no dispatch
"""

from __future__ import annotations

import logging

from hal import env

# Unknown HAL_* names warn, a value hal cannot parse raises EnvValueError: at import, not at a first use
# that may never come. First, so a refusal leaves only a few light modules imported (hal_launch, the
# console scripts' entry, turns it into one line and hal-probe retries without the variable).
env.check()

from hal import fp8  # noqa: E402
from hal.api import cache_kv, cache_mla, explain, mla_decode, paged_attention  # noqa: E402
from hal.diagnostics import (  # noqa: E402
    EnvironmentWarning, FallbackWarning, HalWarning, MissingScaleWarning, PackLoadWarning)
from hal.dispatch import Decision, NotSupportedError  # noqa: E402
from hal.env import EnvValueError  # noqa: E402
from hal.observer import KVScaleObserver  # noqa: E402
from hal.pack import Availability, CallKey, OpSupport, Pack  # noqa: E402
from hal.planning import Plan, plan  # noqa: E402
from hal.scales import KVScaleError, KVScales, load_kv_scales  # noqa: E402
from hal.targets import Target, target  # noqa: E402
from hal.validate import ArgumentError  # noqa: E402

logging.getLogger("hal").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "Availability", "CallKey", "Decision", "EnvValueError", "EnvironmentWarning", "FallbackWarning",
    "HalWarning", "KVScaleError", "KVScaleObserver", "KVScales", "MissingScaleWarning", "NotSupportedError",
    "OpSupport", "Pack", "PackLoadWarning", "Plan", "Target", "cache_kv", "cache_mla", "env", "explain", "fp8",
    "load_kv_scales", "mla_decode", "packs", "paged_attention", "plan", "target",
]


def packs() -> tuple[Pack, ...]:
    """Every pack hal knows, in dispatch order; each has ``.availability`` (ok, reasons, build info)
    and ``.SUPPORTS`` (its declaration per op)."""
    from hal import registry

    env.check_unknown()
    return registry.packs()
