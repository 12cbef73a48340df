"""The scripts that carry a model to a lent GPU machine (scripts/gpu/): what unpack_weights.py
rebuilds from pack_weights.py's parts is the bfloat16 rounding of every tensor, names and shapes kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
