"""Where KV-cache scales live: the kinds of source, the JSON schema, and one table of the key
spellings FP8 checkpoints use.

Every exporter spells the same two numbers differently, and an engine that does not know a spelling
drops the scale and runs at 1.0 without a word (sglang #39942, vllm #25047). So the spellings live
here, in one table, each with the exporter it comes from, and :func:`is_scale_like` lets the loader
report any key that looks like a KV scale but matches no row, instead of ignoring it.

A key is ``<prefix>layers.<N>.<suffix>``: the prefix places the decoder stack (multimodal models nest
it under ``language_model``), the suffix says which scale it is. ``role`` is ``"k"``, ``"v"`` or
``"kv"`` (one legacy scale used for both caches). ``latent`` marks MLA spellings: DeepSeek-style
attention caches one compressed latent, so a k scale alone is the whole cache's scale.

The readers of the sources live in :mod:`hal.scale_files`.
"""

from __future__ import annotations

import dataclasses
import logging
import re



__all__ = ["Spelling", "SPELLINGS", "PREFIXES", "KeyMatch", "match", "is_scale_like", "example_key"]

log = logging.getLogger("hal")


@dataclasses.dataclass(frozen=True)
class Spelling:
    suffix: str
    role: str  # "k" | "v" | "kv"
    origin: str
    latent: bool = False


_CT = "compressed-tensors / llm-compressor (Llama, Mixtral, Qwen, Gemma, ...)"
_VLLM = "vLLM's attention-module names (re-exported checkpoints)"
_MO = "NVIDIA ModelOpt"
_QKV = "fused QKV projection (Phi-3, ModelOpt on fused-QKV models)"
_QUARK = "AMD Quark and older compressed-tensors (k_proj/v_proj output quantisation)"
_LEGACY = "AutoFP8 (legacy: one kv_scale for both caches)"
_MISTRAL = "Mistral consolidated format"
_MLA = "MLA latent cache (DeepSeek V2/V3/R1, Kimi K2, GLM MoE, Mistral Large 3)"

SPELLINGS: tuple[Spelling, ...] = (
    Spelling("self_attn.k_scale", "k", _CT),
    Spelling("self_attn.v_scale", "v", _CT),
    Spelling("self_attn.attn.k_scale", "k", _VLLM),
    Spelling("self_attn.attn.v_scale", "v", _VLLM),
    Spelling("self_attn.k_proj.k_scale", "k", _MO),
    Spelling("self_attn.v_proj.v_scale", "v", _MO),
    Spelling("self_attn.qkv_proj.k_scale", "k", _QKV),
    Spelling("self_attn.qkv_proj.v_scale", "v", _QKV),
    Spelling("self_attn.k_proj.output_scale", "k", _QUARK),
    Spelling("self_attn.v_proj.output_scale", "v", _QUARK),
    Spelling("self_attn.kv_scale", "kv", _LEGACY),
    Spelling("self_attn.attn.kv_scale", "kv", _LEGACY),
    Spelling("attention.k_fake_quantizer.qscale_act", "k", _MISTRAL),
    Spelling("attention.v_fake_quantizer.qscale_act", "v", _MISTRAL),
    Spelling("self_attn.kv_a_proj_with_mqa.k_scale", "k", _MLA, latent=True),
    Spelling("self_attn.kv_a_proj_with_mqa.v_scale", "v", _MLA, latent=True),
    Spelling("self_attn.mla_attn.k_scale", "k", _MLA, latent=True),
    Spelling("self_attn.mla_attn.v_scale", "v", _MLA, latent=True),
    Spelling("self_attn.mla_attn.mla_attn.k_scale", "k", _MLA, latent=True),
    Spelling("self_attn.mla_attn.mla_attn.v_scale", "v", _MLA, latent=True),
    Spelling("self_attn.attn_mqa.k_scale", "k", _MLA, latent=True),
    Spelling("self_attn.attn_mqa.v_scale", "v", _MLA, latent=True),
)

# Where the decoder stack sits. Text models use "model."; multimodal ones nest it (Llama 4, Mllama,
# Gemma 3, LLaVA: "language_model.model."; transformers >= 4.52: "model.language_model."; Qwen2.5-Omni:
# "thinker.model."). "" is the bare Mistral consolidated layout. Vision towers are deliberately absent:
# their layers would collide with the decoder's layer numbers.
PREFIXES: tuple[str, ...] = (
    "model.", "language_model.model.", "model.language_model.", "language_model.",
    "model.text_model.", "text_model.", "thinker.model.", "",
)

_BY_SUFFIX = {s.suffix: s for s in SPELLINGS}
# The table lists k rows directly before their v rows; each is the other's partner.
_PARTNER = {a: b for x, y in zip(SPELLINGS, SPELLINGS[1:]) if (x.role, y.role) == ("k", "v")
            for a, b in ((x, y), (y, x))}
_KEY = re.compile(
    r"^(?P<prefix>" + "|".join(re.escape(p) for p in sorted(PREFIXES, key=len, reverse=True)) + r")"
    r"layers\.(?P<layer>\d+)\.(?P<suffix>" + "|".join(re.escape(s.suffix) for s in SPELLINGS) + r")$"
)
_SCALE_LIKE = re.compile(
    r"(?:^|[._])(?:k|v|kv)_scale(?:$|[._])|[kv]_fake_quantizer|[kv]_proj\.output_scale"
)


@dataclasses.dataclass(frozen=True)
class KeyMatch:
    key: str
    layer: int
    prefix: str
    spelling: Spelling


def match(key: str) -> KeyMatch | None:
    """The table row a checkpoint key matches, with its layer index; None if it is not a KV scale."""
    m = _KEY.match(key)
    if m is None:
        return None
    return KeyMatch(key, int(m["layer"]), m["prefix"], _BY_SUFFIX[m["suffix"]])


def is_scale_like(key: str) -> bool:
    """True for a key that looks like a KV-cache scale (k_scale, v_scale, kv_scale, a k/v fake
    quantiser, k_proj/v_proj output scales), whether or not the table maps it."""
    return _SCALE_LIKE.search(key) is not None


def example_key(layer: int, role: str, like: KeyMatch | None = None) -> str:
    """The key a layer's ``role`` scale would have, spelled like ``like`` (another layer's key) when
    given, else in the compressed-tensors spelling."""
    if like is None:
        return f"model.layers.{layer}.self_attn.{role}_scale"
    spelling = like.spelling
    if spelling.role != "kv" and role != spelling.role:
        spelling = _PARTNER.get(spelling, spelling)
    return f"{like.prefix}layers.{layer}.{spelling.suffix}"
