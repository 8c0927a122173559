"""The package's float64 reference (hal.reference: the probe's and the benchmark's check) agrees with
the tests' independent one (tests/reference.py, decoding with ml_dtypes) on the same bytes."""

import numpy as np
import pytest
import torch

import hal.reference
from cases import FP8, alibi_slopes, make_case

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("cache_dtype", (*FP8, torch.bfloat16), ids=str)
def test_package_reference_matches_the_tests_reference(cache_dtype):
    case = make_case(seq_lens=[0, 1, 37, 130], cache_dtype=cache_dtype, per_head_scales=True,
                     alibi_slopes=alibi_slopes(8), logits_soft_cap=3.0, sliding_window=100)
    ours = hal.reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale, **case.kwargs)
    theirs = case.reference()
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-12, atol=1e-14)
    subset = hal.reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                           case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale,
                                           sequences=[2], **case.kwargs)
    assert torch.equal(subset[2], ours[2]) and not subset[3].any()
