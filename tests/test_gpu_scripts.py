"""The scripts that carry a model to a lent GPU machine (scripts/gpu/): what unpack_weights.py
rebuilds from pack_weights.py's parts is the bfloat16 rounding of every tensor, names and shapes kept."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def test_packed_parts_unpack_to_the_bfloat16_rounding_of_every_tensor(tmp_path):
    src, stage, out = tmp_path / "model", tmp_path / "stage", tmp_path / "out"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 48, generator=gen) * 0.02, "b.bias": torch.randn(48, generator=gen),
               "c.norm": torch.ones(7) + 1e-3 * torch.randn(7, generator=gen)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"model_type": "llama"}\n')
    subprocess.run([sys.executable, str(SCRIPTS / "pack_weights.py"), str(src), str(stage), "--part-mb", "0.002"],
                   check=True, capture_output=True)
    parts = sorted(p.name for p in stage.glob("blob.part*"))
    assert len(parts) > 1  # cut into several parts, as for calls of at most 64 MiB
    subprocess.run([sys.executable, str(SCRIPTS / "unpack_weights.py"), str(stage), str(out)], check=True,
                   capture_output=True)
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(tensors) and (out / "config.json").is_file()
    for name, value in tensors.items():
        assert torch.equal(back[name], value.to(torch.bfloat16).float()), name


def test_a_missing_part_is_refused(tmp_path):
    src, stage = tmp_path / "model", tmp_path / "stage"
    src.mkdir()
    save_file({"w": torch.randn(256, 64)}, str(src / "model.safetensors"))
    subprocess.run([sys.executable, str(SCRIPTS / "pack_weights.py"), str(src), str(stage), "--part-mb", "0.005"],
                   check=True, capture_output=True)
    sorted(stage.glob("blob.part*"))[-1].unlink()
    run = subprocess.run([sys.executable, str(SCRIPTS / "unpack_weights.py"), str(stage), str(tmp_path / "out")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "incomplete" in run.stderr


def test_the_static_path_script_runs_its_whole_measure_on_cpu_with_tiny_settings(tmp_path, monkeypatch):
    """scripts/gpu/static_path.py --smoke: every section of the GPU run on CPU at tiny shapes (graph
    and compile modes recorded as unavailable there), speculative rows identical to plain, the
    issue's gpu_* figures written under --out only (a CPU file name), and refused on import."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPTS / "static_path.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "static-path.json").read_text())
    assert results.get("errors", {}) == {} and results.get("skipped", []) == []
    eager = {(b["rows"], b["tokens"]): b["step_ms"] for b in results["buckets"] if b["mode"] == "eager"}
    assert set(eager) == {(1, 1), (1, 16), (16, 1), (16, 16)} and all(v > 0 for v in eager.values())
    assert all("needs a CUDA device" in results["unavailable"][m] for m in ("graph", "compile"))
    assert set(results["section_s"]) == {"buckets", "expand_kv", "profile", "hf", "speculative", "speculative_float32",
                                      "big", "compile"}
    expanded = {(b["rows"], b["tokens"]) for b in results["buckets"] if b["mode"] == "eager+expand_kv" and b["step_ms"] > 0}
    assert expanded == {(1, 1), (1, 16), (16, 1), (16, 16)} and results["headline_mode"] in ("eager", "eager+expand_kv")
    assert results["hf"]["step_ms"] > 0 and results["big"]["floor_ms"] > 0
    assert results["env"]["dtype"] == "torch.bfloat16"  # the GPU's precision, with float32 rows beside it
    for label, drafter in itertools.product(("synthetic:smollm2-135m", "synthetic:smollm2-135m:float32"),
                                            ("ngram", "oracle")):
        spec = results["speculative"][label][drafter]
        assert spec["identical_rows"] == 2 and spec["first_difference"] is None
    assert results["speculative"]["synthetic:smollm2-135m"]["oracle"]["tokens_per_pass"] > 2
    figures = json.loads((out / "headline-cpu-smoke.json").read_text())
    assert set(figures) == {"gpu_plain_step_ms", "gpu_engine_plain_decode_x_hf", "gpu_verify_16_tokens_x_step",
                            "gpu_decode_throughput_16_over_1", "gpu_8b_step_x_bandwidth_floor"}
    assert all(isinstance(v, float) and v > 0 for v in figures.values())
    assert not (out / "headline-gpu.json").exists() and (out / "static-path.md").is_file()
    spec = importlib.util.spec_from_file_location("static_path", SCRIPTS / "static_path.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "static_path", script)  # its dataclasses resolve their module
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match="not a CUDA run"):
        script.import_results(out, "smoke")
