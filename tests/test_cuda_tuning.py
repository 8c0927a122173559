"""The cuda pack's tuning table and partition planning (CPU; the table is data, the plan arithmetic)."""

from __future__ import annotations

import pytest
import torch

from hal.kernelpacks.cuda import tune
from hal.kernelpacks.cuda import tuning


def test_every_entry_covers_every_class_with_sane_values():
    table = tuning.tuning_table()
    entries = {k: v for k, v in table.items() if not k.startswith("_")}
    assert "default" in entries
    for name, entry in entries.items():
        assert set(entry["classes"]) == set(tuning.CLASSES), name
        for cls, p in entry["classes"].items():
            assert p["ctas_per_sm"] >= 1 and p["waves"] > 0, (name, cls)
            assert p["min_partition"] >= 64 and p["min_partition"] % 64 == 0, (name, cls)
            assert p.get("warp_rows", 0) >= 0, (name, cls)
        if name != "default":
            assert {"device", "date", "command"} <= set(entry["measured"]), name


@pytest.mark.parametrize("dtype,max_len,cls", [
    (torch.float8_e4m3fn, 1, "fp8-short"), (torch.float8_e5m2, 2048, "fp8-short"),
    (torch.float8_e4m3fn, 2049, "fp8-long"), (torch.bfloat16, 2048, "16bit-short"),
    (torch.float16, 1 << 20, "16bit-long")])
def test_shape_class(dtype, max_len, cls):
    assert tuning.shape_class(dtype, max_len) == cls


def test_unknown_arch_uses_default_and_override_wins_until_cleared():
    assert tuning.tuning_for("sm_999")["source"] == "default"
    assert tuning.tuning_for("sm_999", "fp8-long") == tuning.tuning_table()["default"]["classes"]["fp8-long"]
    cand = {"ctas_per_sm": 7, "waves": 3, "min_partition": 512}
    tuning.set_override(cand)
    try:
        assert tuning.tuning_for("sm_90", "16bit-short") == cand
    finally:
        tuning.set_override(None)
    assert tuning.tuning_for("sm_90", "16bit-short") != cand


def test_summary_names_the_source_and_every_class():
    text = tuning.summary("sm_999")
    assert text.startswith("tuning default")
    for cls in tuning.CLASSES:
        assert cls in text
    for cls, p in tuning.tuning_table()["default"]["classes"].items():
        line = next(x for x in text.splitlines() if x.startswith(cls + ":"))
        assert ("a warp per row from" in line) == (p.get("warp_rows", 0) > 0), line
    assert text.splitlines()[-2].startswith("multi-token kernel: mma.sync (csrc/prefill.cuh)")
    narrow = ("; 16-row tiles: csrc/mla_narrow.cuh over FP8 latents, csrc/mla.cuh over 16-bit ones"
              "; contexts split over the SMs on the device (csrc/mla_schedule.cu)")
    assert text.splitlines()[-1] == "MLA decode, 64-row tiles: mma.sync (csrc/mla.cuh)" + narrow
    assert tuning.summary("sm_90").splitlines()[-1] == "MLA decode, 64-row tiles: wgmma (csrc/mla_sm90.cuh)" + narrow


P = {"ctas_per_sm": 3, "waves": 2, "min_partition": 256}


@pytest.mark.parametrize("ctas,max_len,expect", [
    (1000, 4096, (4096, 1)),   # the grid already holds 792 CTAs: one pass
    (10, 200, (256, 1)),       # no longer than one partition: one pass, rounded up to 64
    (8, 32768, (384, 86)),     # 792 / 8 = 99 parts of 331 tokens, rounded up to 384: 86 parts
    (100, 4096, (512, 8)),     # 8 parts of 512
    (100, 1000, (256, 4)),     # 8 parts wanted, but partitions stay >= 256 tokens
])
def test_split(ctas, max_len, expect):
    size, parts = tuning.split(ctas, max_len, 132, P)
    assert (size, parts) == expect
    assert size % 64 == 0 and size * parts >= max_len > size * (parts - 1)


@pytest.mark.parametrize("ctas,max_len,resident,expect", [
    (8, 32768, 4, (512, 64)),    # 99 parts wanted, but one wave of 132 x 4 CTAs holds 66: 64 parts of 512
    (8, 32768, 16, (384, 86)),   # a wave holds all 792: as without the cap
    (512, 4096, 4, (4096, 1)),   # 2 parts wanted, but 1024 CTAs would be two waves of 528: one pass
    (256, 8192, 2, (8192, 1)),   # 264 resident: no split at all
    (128, 32768, 4, (8192, 4)),  # 7 parts wanted, 4 fit in a wave
    (100, 1000, 1, (1024, 1)),   # fewer resident slots than rows: one pass, never zero parts
])
def test_split_fills_at_most_one_wave(ctas, max_len, resident, expect):
    assert tuning.split(ctas, max_len, 132, P, resident) == expect


def test_split_never_below_min_partition():
    size, parts = tuning.split(1, 1 << 20, 132, {"ctas_per_sm": 4, "waves": 6, "min_partition": 1024})
    assert size >= 1024 and parts == -(-(1 << 20) // size)


def test_tune_score_is_relative_to_the_best_per_shape():
    times = {"a": [1.0, 2.0, 1.0], "b": [4.0, 2.0, 2.0]}
    s = tune.score(times, 3)
    assert s[2] == pytest.approx(1.0)                    # best on both shapes
    assert s[0] == pytest.approx((1.0 * 2.0) ** 0.5)     # best on a, 2x on b
    assert s[1] == pytest.approx((2.0 * 1.0) ** 0.5)


def test_candidates_are_valid_entries():
    for c in tune.candidates():
        assert c["min_partition"] % 64 == 0 and c["ctas_per_sm"] * c["waves"] >= 1


def test_tune_candidate_grid_from_the_command_line(capsys):
    from hal.kernelpacks.cuda import tune
    assert tune.candidates((3,), (1, 1.5), (1024,), (0,)) == [
        {"ctas_per_sm": 3, "waves": 1, "min_partition": 1024, "warp_rows": 0},
        {"ctas_per_sm": 3, "waves": 1.5, "min_partition": 1024, "warp_rows": 0}]
    assert tune._numbers("1, 1.5,2") == (1, 1.5, 2)
    assert tune.main(["--min-partition", "100"]) == 2
    assert "multiples of 64" in capsys.readouterr().out
    assert tune.main(["--waves", "x"]) == 2


def test_warp_rows_from_the_entry():
    p = {"ctas_per_sm": 3, "waves": 1, "min_partition": 1024, "warp_rows": 2}
    assert tuning.warp_rows(2 * 132 * 3, 132, p)          # 2 x the target CTA count of rows
    assert not tuning.warp_rows(2 * 132 * 3 - 1, 132, p)
    assert not tuning.warp_rows(10**6, 132, {**p, "warp_rows": 0})
    assert not tuning.warp_rows(10**6, 132, {k: v for k, v in p.items() if k != "warp_rows"})


def test_tune_rejects_negative_warp_rows(capsys):
    from hal.kernelpacks.cuda import tune
    assert tune.main(["--warp-rows", "-1"]) == 2
    assert "--warp-rows expects numbers >= 0" in capsys.readouterr().out


def test_tune_stamp_keeps_the_commands_of_classes_it_did_not_retune():
    old = {"command": "tools/tune", "classes": ["fp8-long", "fp8-short"]}
    new = tune._stamp_with_history({"command": "tools/tune --classes fp8-short", "classes": ["fp8-short"]}, old)
    assert new["earlier"] == [old]
    again = tune._stamp_with_history({"command": "tools/tune", "classes": ["fp8-long", "fp8-short"]}, new)
    assert "earlier" not in again
    legacy = tune._stamp_with_history({"command": "b", "classes": ["fp8-short"]}, {"command": "a"})
    assert legacy["earlier"] == [{"command": "a"}]     # a stamp without classes covered them all
    # A (all classes), then B (fp8-short), then C (the other three): A accounts for nothing any more.
    a = {"command": "A", "classes": list(tuning.CLASSES)}
    b = tune._stamp_with_history({"command": "B", "classes": ["fp8-short"]}, a)
    c = tune._stamp_with_history({"command": "C", "classes": ["fp8-long", "16bit-short", "16bit-long"]}, b)
    assert [st["command"] for st in c["earlier"]] == ["B"]


def test_prefill_kernel_choice_needs_a_geomean_win_and_no_shape_lost_beyond_the_margin():
    from hal.kernelpacks.cuda import tune_prefill
    times = {
        64: {"a": {"mma": 1.0, "wgmma": 1.05}, "b": {"mma": 1.0, "wgmma": 1.06}},     # slower
        128: {"a": {"mma": 1.3, "wgmma": 1.0}, "b": {"mma": 1.0, "wgmma": 1.01}},     # wins, loses 1 %
        192: {"a": {"mma": 2.0, "wgmma": 1.0}, "b": {"mma": 1.0, "wgmma": 1.2}},      # wins, loses 17 %
    }
    picked, why = tune_prefill.choose(times, 0.02)
    assert picked == [128]
    assert why[128]["worst_speedup"] == pytest.approx(1 / 1.01)
    assert why[192]["geomean_speedup"] > 1.02 and why[192]["worst_speedup"] < 1 / 1.02


def test_prefill_mode_names_bad_head_sizes(capsys):
    from hal.kernelpacks.cuda import tune
    assert tune.main(["--prefill", "--head-sizes", "80"]) == 2
    assert "--head-sizes expects some of 64, 128, 192" in capsys.readouterr().out
