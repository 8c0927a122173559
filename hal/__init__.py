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

from hal import env, fp8
from hal.api import cache_kv, cache_mla, explain, mla_decode, paged_attention
from hal.diagnostics import EnvironmentWarning, FallbackWarning, HalWarning, MissingScaleWarning, PackLoadWarning
from hal.dispatch import Decision, NotSupportedError
from hal.observer import KVScaleObserver
from hal.pack import Availability, CallKey, OpSupport, Pack
from hal.planning import Plan, plan
from hal.scales import KVScaleError, KVScales, load_kv_scales
from hal.targets import Target, target
from hal.validate import ArgumentError

logging.getLogger("hal").addHandler(logging.NullHandler())
env.check()  # unknown HAL_* names warn, values hal cannot parse raise: at import, not at first use

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "Availability", "CallKey", "Decision", "EnvironmentWarning", "FallbackWarning",
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
