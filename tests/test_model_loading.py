"""Reference model fetching/conversion and model resolution errors."""

from __future__ import annotations

import json

import pytest

from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.model_loading import layer_skip_draft, resolve_model_path
from triton_backend.core.reference_model import SMOLLM2_135M, cache_dir, ensure_reference_model, sha256_of


def test_reference_model_is_verified_and_converted():
    path = ensure_reference_model()
    gguf = cache_dir() / "gguf" / SMOLLM2_135M.gguf_name
    assert gguf.stat().st_size == SMOLLM2_135M.size and sha256_of(gguf) == SMOLLM2_135M.sha256
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert list(path.glob("*.safetensors")) and "quantization_config" not in config


def test_unknown_sources_fail_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(ModelLoadError, match="unknown reference model"):
        ensure_reference_model("no-such-model")


def test_corrupt_weights_fail_with_the_folder_named(tmp_path):
    from triton_backend.engines.torch.model_loading import load_model

    src = ensure_reference_model()
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(tmp_path)


def test_layer_skip_draft_validation():
    from conftest import tiny_llama

    model = tiny_llama(0, layers=3)
    with pytest.raises(ValueError, match="layer 0"):
        layer_skip_draft(model, [1, 2])
    with pytest.raises(ValueError, match="drop at least one"):
        layer_skip_draft(model, [0, 1, 2])
    draft = layer_skip_draft(model, [0, 2])
    assert len(draft.model.layers) == 2 and draft.lm_head is model.lm_head
