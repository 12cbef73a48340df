"""An EAGLE-3 drafter exported for TensorRT-LLM 1.x's Eagle3 speculative config: the drafter
folder under EAGLE-3's tensor names and config keys, the LLM-API options file's keys, the
trtllm-serve command line, mismatched drafters refused (checked without TensorRT-LLM)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from builder.errors import BuildSpecError
from builder.stages.eagle3_export import export_eagle3, llm_api_options
from triton_backend.speculation.drafters.eagle3_model import Eagle3Info, Eagle3Net, save_eagle3

NAMES = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
         "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
         "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def _drafter(folder, layers=(1, 5, 8)):
    info = Eagle3Info(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=40,
                      draft_vocab_size=16, capture_layers=layers)
    net = Eagle3Net(info)
    net.set_vocab(torch.arange(0, 32, 2))
    return save_eagle3(folder, net)


def test_export_layout_options_and_serve_line(tmp_path):
    _drafter(tmp_path / "d")
    export = export_eagle3(tmp_path / "d", tmp_path / "out", target="my-target", num_target_layers=12,
                           target_hidden_size=32, target_vocab_size=40, max_draft_len=4)
    with safe_open(str(export.drafter / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == NAMES
        assert tuple(f.get_tensor("fc.weight").shape) == (32, 96)  # 3 x hidden in, fused features
        assert tuple(f.get_tensor("midlayer.self_attn.q_proj.weight").shape) == (32, 64)  # reads [embed; hidden]
        assert tuple(f.get_tensor("lm_head.weight").shape) == (16, 32)
        d2t = f.get_tensor("d2t")
        assert (torch.arange(16) + d2t).tolist() == list(range(0, 32, 2))  # target id = draft id + d2t
    cfg = json.loads((export.drafter / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 16
    assert cfg["num_hidden_layers"] == 1 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]
    spec = yaml.safe_load(export.options.read_text())["speculative_config"]
    assert spec == {"decoding_type": "Eagle", "max_draft_len": 4, "speculative_model_dir": "eagle3",
                    "eagle3_one_model": True}  # default capture set for 12 layers: not repeated
    assert export.serve_argv == ["trtllm-serve", "my-target", "--backend", "pytorch", "--port", "8000",
                                 "--extra_llm_api_options", "extra_llm_api_options.yaml"]
    assert (export.folder / "serve.sh").read_text().rstrip().endswith(export.serve_shell())


def test_other_capture_layers_are_written_and_mismatches_refused(tmp_path):
    _drafter(tmp_path / "d", layers=(2, 6, 9))
    export = export_eagle3(tmp_path / "d", tmp_path / "out", target="t", num_target_layers=12, target_hidden_size=32,
                           target_vocab_size=40)
    assert yaml.safe_load(export.options.read_text())["speculative_config"]["eagle3_layers_to_capture"] == [2, 6, 9]
    with pytest.raises(BuildSpecError, match="hidden size"):
        export_eagle3(tmp_path / "d", tmp_path / "o2", target="t", num_target_layers=12, target_hidden_size=64,
                      target_vocab_size=40)
    with pytest.raises(BuildSpecError, match="exceed"):
        export_eagle3(tmp_path / "d", tmp_path / "o3", target="t", num_target_layers=8, target_hidden_size=32,
                      target_vocab_size=40)
    with pytest.raises(BuildSpecError, match="config.json"):
        export_eagle3(tmp_path / "missing", tmp_path / "o4", target="t", num_target_layers=12, target_hidden_size=32,
                      target_vocab_size=40)
    with pytest.raises(BuildSpecError):
        llm_api_options(0, "eagle3", (1, 5, 8), 12)
