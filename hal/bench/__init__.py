"""hal-bench: side-by-side timing of every hal pack and the baselines over a paged (FP8) KV cache.

Modules: :mod:`shapes` (named shape sets, SPEC strings), :mod:`data` (random paged caches with
shuffled pages, the bytes an op must move), :mod:`check` (the correctness check every contender
passes before it is timed), :mod:`baselines` (plain PyTorch, FlashInfer), :mod:`prefill` (several
query tokens per sequence: SPECs, problems, FLOP count, the per-row check), :mod:`prefill_baselines`
(SDPA on dense K/V, FlashInfer's prefill wrapper, FA3), :mod:`contenders` (what is compared),
:mod:`timing` (CUDA events / perf_counter, copy bandwidth, matmul TFLOP/s), :mod:`runner` (one run)
and :mod:`report` (rich table, JSON, PNG). The command line lives in :mod:`hal.cli.bench`.
"""
