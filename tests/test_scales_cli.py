"""hal-scales (hal.cli.scales.main and the tools/scales shim): inspect prints and flags, convert
writes a JSON scale file, errors exit 1 naming the file and the key."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from hal.cli.scales import main, suspicious
from hal.scales import KVScales, load_kv_scales

pytestmark = pytest.mark.emu

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal width; keep lines whole


def _ckpt(path, k=(0.01, 0.02, 0.03, 0.04), v=(0.02, 0.02, 0.03, 0.05)):
    t = {"model.embed_tokens.weight": torch.randn(16, 8)}
    for i, (a, b) in enumerate(zip(k, v)):
        t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(a)
        t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(b)
    save_file(t, str(path))
    return path


def test_inspect_prints_every_layer(tmp_path, capsys):
    assert main(["inspect", str(_ckpt(tmp_path / "m.safetensors")), "--num-layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "m.safetensors" in out and "4 layers, per tensor, calibrated for e4m3fn" in out
    for value in ("0.01", "0.02", "0.03", "0.04", "0.05"):
        assert value in out
    assert "warning" not in out


def test_inspect_per_head(tmp_path, capsys):
    KVScales((torch.tensor([0.5, 0.25]),), (torch.tensor([1.0, 2.0]),)).to_json(tmp_path / "h.json")
    assert main(["inspect", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    assert "0.25 .. 0.5 (2 heads)" in out and "per head (2 KV heads)" in out


def test_inspect_flags_all_ones(tmp_path, capsys):
    KVScales((1.0,) * 3, (1.0,) * 3).to_json(tmp_path / "ones.json")
    assert main(["inspect", str(tmp_path / "ones.json")]) == 0
    assert "every scale is 1.0" in capsys.readouterr().out


def test_inspect_flags_identical_k_and_v(tmp_path, capsys):
    KVScales((0.1, 0.2, 0.3), (0.1, 0.2, 0.3)).to_json(tmp_path / "same.json")
    assert main(["inspect", str(tmp_path / "same.json")]) == 0
    assert "k and v scales are identical in every layer" in capsys.readouterr().out


def test_inspect_flags_outliers(tmp_path, capsys):
    path = _ckpt(tmp_path / "m.safetensors", k=(0.01, 0.012, 0.5, 0.011, 0.013), v=(0.02, 0.02, 0.02, 0.02, 0.0001))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "k is 41.7x the median k scale" in out and "v is 0.005x the median v scale" in out
    overall, per_layer = suspicious(load_kv_scales(path))
    assert overall == [] and set(per_layer) == {2, 4}


def test_convert_to_fnuz_json(tmp_path, capsys):
    src = _ckpt(tmp_path / "m.safetensors")
    out = tmp_path / "fnuz.json"
    assert main(["convert", str(src), "--to-json", str(out), "--encoding", "e4m3fnuz"]) == 0
    assert "wrote" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["kv_cache"]["dtype"] == "float8_e4m3fnuz"
    back = load_kv_scales(out)
    assert back == load_kv_scales(src).for_encoding(torch.float8_e4m3fnuz)


def test_convert_keeps_the_encoding_by_default(tmp_path):
    src = _ckpt(tmp_path / "m.safetensors")
    assert main(["convert", str(src), "--to-json", str(tmp_path / "o.json")]) == 0
    assert load_kv_scales(tmp_path / "o.json") == load_kv_scales(src)


def test_convert_refuses_e4m3_to_e5m2(tmp_path, capsys):
    src = _ckpt(tmp_path / "m.safetensors")
    assert main(["convert", str(src), "--to-json", str(tmp_path / "o.json"), "--encoding", "e5m2"]) == 1
    assert "different exponent and mantissa widths" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_errors_exit_1_naming_file_and_key(tmp_path, capsys):
    path = _ckpt(tmp_path / "m.safetensors", k=(0.01, 0.0), v=(0.02, 0.02))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "m.safetensors" in err and "model.layers.1.self_attn.k_scale" in err and "is zero" in err


def test_on_missing_one(tmp_path, capsys):
    path = _ckpt(tmp_path / "m.safetensors")
    assert main(["inspect", str(path), "--num-layers", "6"]) == 1
    assert main(["inspect", str(path), "--num-layers", "6", "--on-missing", "one"]) == 0
    captured = capsys.readouterr()
    assert "layers 4-5 of 6" in captured.err  # the fill is reported


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "x.json"])
    assert e.value.code == 2 and "--to-json" in capsys.readouterr().err


def test_tools_shim_runs_without_installing(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"COLUMNS": "200"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "scales"), "inspect", str(path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "calibrated for e4m3fn" in run.stdout
    assert os.access(ROOT / "tools" / "scales", os.X_OK)


def _one_line_error(capsys, *parts):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for p in parts:
        assert str(p) in err, f"{p!r} not in: {err}"


def test_symlink_loop_in_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
    _ckpt(tmp_path / "model.safetensors")
    (tmp_path / "kv_cache_scales.json").symlink_to("kv_cache_scales.json")
    assert main(["inspect", str(tmp_path)]) == 1
    _one_line_error(capsys, tmp_path / "kv_cache_scales.json", "symlink loop")


def test_convert_into_a_missing_folder_is_refused(tmp_path, capsys):
    src = _ckpt(tmp_path / "m.safetensors")
    out = tmp_path / "missing" / "deeper" / "o.json"
    assert main(["convert", str(src), "--to-json", str(out)]) == 1
    _one_line_error(capsys, "--to-json", tmp_path / "missing" / "deeper", "does not exist")
    assert not (tmp_path / "missing").exists()  # not created


def test_convert_to_an_unwritable_path_is_a_one_line_error(tmp_path, capsys):
    src = _ckpt(tmp_path / "m.safetensors")
    (tmp_path / "adir").mkdir()
    assert main(["convert", str(src), "--to-json", str(tmp_path / "adir")]) == 1  # a folder, not a file
    _one_line_error(capsys, tmp_path / "adir")
