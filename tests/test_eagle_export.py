"""An EAGLE drafter into a TensorRT-LLM EAGLE checkpoint (a tiny random Llama target exported
with real modelopt): TensorRT-LLM's config keys and tensor names, the drafter's weights in
place (q/k/v stacked, tensor-parallel splits), the target's embedding and LM head shared,
bad inputs refused, and the ``trtllm-build`` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from build_fixtures import make_tiny_llama
from builder.plan.architecture import load_architecture
from builder.stages.eagle_export import eagle_engine_build, write_eagle_checkpoint
from builder.errors import BuildSpecError
from builder.stages.checkpoint_export import export_checkpoint
from builder.plan.spec import KVCacheDtype, Precision
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.speculation.drafters.eagle_model import EagleInfo, EagleNet, save_eagle
from triton_backend.engines.torch.model_loading import load_model

pytestmark = pytest.mark.slow

DRAFTER = {"fc.weight", "fc.bias", "layers.0.attention.qkv.weight", "layers.0.attention.dense.weight",
           "layers.0.post_layernorm.weight", "layers.0.mlp.fc.weight", "layers.0.mlp.gate.weight",
           "layers.0.mlp.proj.weight", "vocab_embedding.weight"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, dict[int, Path]]:
    """The tiny target and its TensorRT-LLM checkpoints at TP 1 and TP 2."""
    from triton_backend.core.reference_model import ensure_reference_model

    root = tmp_path_factory.mktemp("eagle-export")
    tiny = make_tiny_llama(root / "tiny", ensure_reference_model())
    torch.set_num_threads(1)
    checkpoints = {}
    for tp in (1, 2):
        model = load_model(str(tiny), RuntimeConfig()).eval()
        export_checkpoint(model, load_architecture(str(tiny)), Precision.FP16, KVCacheDtype.FP16, root / f"tp{tp}", tp, 1)
        checkpoints[tp] = root / f"tp{tp}"
    return tiny, checkpoints


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory) -> tuple[Path, EagleNet]:
    tiny, _ = target
    torch.manual_seed(0)
    net = EagleNet(EagleInfo.from_target_config(load_model(str(tiny), RuntimeConfig()).config))
    path = save_eagle(tmp_path_factory.mktemp("drafter") / "eagle.safetensors", net, torch.arange(100))
    return path, net


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_checkpoint_has_the_documented_eagle_layout(target, drafter, tmp_path):
    _, checkpoints = target
    path, net = drafter
    out = write_eagle_checkpoint(checkpoints[1], path, tmp_path / "eagle", max_draft_len=4, num_eagle_layers=3)
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "EagleForCausalLM"
    assert (config["max_draft_len"], config["num_eagle_layers"], config["max_non_leaves_per_layer"]) == (4, 3, 10)
    net_config = config["eagle_net_config"]
    assert net_config["num_hidden_layers"] == 1 and net_config["hidden_size"] == config["hidden_size"]
    assert net_config["num_key_value_heads"] == net.info.num_kv_heads and net_config["architecture"] == "LlamaForCausalLM"
    tensors = _tensors(out / "rank0.safetensors")
    base = _tensors(checkpoints[1] / "rank0.safetensors")
    assert all(torch.equal(tensors[k], v) for k, v in base.items())  # the target untouched
    for i in range(3):
        names = {k[len(f"eagle_nets.{i}.drafter."):] for k in tensors if k.startswith(f"eagle_nets.{i}.drafter.")}
        assert names == DRAFTER
    assert not any(k.startswith("eagle_nets.3.") for k in tensors)
    state = {k: v.half() for k, v in net.state_dict().items()}
    p = "eagle_nets.1.drafter.layers.0."
    qkv = torch.cat([state[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(tensors[p + "attention.qkv.weight"], qkv)
    assert torch.equal(tensors[p + "mlp.fc.weight"], state["layers.0.mlp.gate_proj.weight"])
    assert torch.equal(tensors[p + "mlp.gate.weight"], state["layers.0.mlp.up_proj.weight"])
    assert torch.equal(tensors["eagle_nets.2.drafter.fc.bias"], state["fc.bias"])
    head = base.get("lm_head.weight", base["transformer.vocab_embedding.weight"])
    assert torch.equal(tensors["eagle_nets.0.lm_head.weight"], head)
    assert torch.equal(tensors["eagle_nets.0.drafter.vocab_embedding.weight"], base["transformer.vocab_embedding.weight"])


def test_tensor_parallel_split(target, drafter, tmp_path):
    _, checkpoints = target
    path, net = drafter
    out = write_eagle_checkpoint(checkpoints[2], path, tmp_path / "eagle", max_draft_len=2)
    state = {k: v.half() for k, v in net.state_dict().items()}
    for rank in range(2):
        t = _tensors(out / f"rank{rank}.safetensors")
        p = "eagle_nets.0.drafter.layers.0."
        q = torch.chunk(state["layers.0.self_attn.q_proj.weight"], 2, 0)[rank]
        assert torch.equal(t[p + "attention.qkv.weight"][: q.shape[0]], q)
        assert torch.equal(t[p + "mlp.proj.weight"], torch.chunk(state["layers.0.mlp.down_proj.weight"], 2, 1)[rank])
        assert torch.equal(t[p + "attention.dense.weight"], torch.chunk(state["layers.0.self_attn.o_proj.weight"], 2, 1)[rank])
    assert json.loads((out / "config.json").read_text())["num_eagle_layers"] == 2


def test_bad_inputs_are_refused(target, drafter, tmp_path):
    tiny, checkpoints = target
    path, _ = drafter
    with pytest.raises(BuildSpecError, match="not a TensorRT-LLM checkpoint"):
        write_eagle_checkpoint(tiny / "missing", path, tmp_path / "a", max_draft_len=2)
    with pytest.raises(BuildSpecError, match="num_eagle_layers"):
        write_eagle_checkpoint(checkpoints[1], path, tmp_path / "b", max_draft_len=2, num_eagle_layers=3)
    other = save_eagle(tmp_path / "other.safetensors", EagleNet(EagleInfo(hidden_size=64, num_heads=4, num_kv_heads=2,
                                                                          head_dim=16, intermediate_size=128,
                                                                          vocab_size=49152)))
    with pytest.raises(BuildSpecError, match="does not fit"):
        write_eagle_checkpoint(checkpoints[1], other, tmp_path / "c", max_draft_len=2)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(BuildSpecError):
        write_eagle_checkpoint(checkpoints[1], tmp_path / "junk.safetensors", tmp_path / "d", max_draft_len=2)


def test_trtllm_build_command():
    build = eagle_engine_build("checkpoints/eagle", "engines/eagle", max_draft_len=4, ranks=2)
    argv = build.argv
    assert argv[:5] == ["trtllm-build", "--checkpoint_dir", "checkpoints/eagle", "--output_dir", "engines/eagle"]
    i = argv.index("--speculative_decoding_mode")
    assert argv[i + 1] == "eagle" and argv[argv.index("--max_draft_len") + 1] == "4"
    assert argv[argv.index("--workers") + 1] == "2"
    assert "--speculative_decoding_mode eagle" in build.shell()
    with pytest.raises(BuildSpecError):
        eagle_engine_build("a", "b", max_draft_len=0)


def test_export_command_writes_checkpoint_and_script(target, drafter, tmp_path, capsys):
    from builder.cli.main import main as cli_main
    from builder.stages.compile import trtllm_build_available

    _, checkpoints = target
    path, _ = drafter
    if trtllm_build_available() is not None:
        pytest.skip("trtllm-build is installed here: the command would compile")
    out = tmp_path / "out"
    assert cli_main(["export-eagle", "--checkpoint", str(checkpoints[1]), "--eagle", str(path), "--out", str(out),
                     "--max-draft-len", "3"]) == 0
    assert json.loads((out / "checkpoint" / "config.json").read_text())["max_draft_len"] == 3
    script = (out / "build_engine.sh").read_text()
    assert "--speculative_decoding_mode eagle" in script and "--max_draft_len 3" in script
    assert "NOT compiled" in capsys.readouterr().out
