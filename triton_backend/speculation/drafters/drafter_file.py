"""Reading a trained drafter's safetensors file (Medusa heads, EAGLE drafters): its metadata
and tensors, or a ModelLoadError that names the file."""

from __future__ import annotations

from pathlib import Path

import torch

from triton_backend.core.errors import ModelLoadError


def read_drafter_file(file: Path, what: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of ``file``; ``what`` names the drafter in errors ("Medusa heads")."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        raise ModelLoadError(f"could not read {what} from {file}: {exc}") from exc


__all__ = ["read_drafter_file"]
