"""The streamed load of a quantized target (engines/torch/streamed_loading.py): the engine it builds
gives the full load's logits bit for bit (int8, int4, tied and untied heads, a float head kept for a
drafter, a TensorRT-LLM checkpoint's linears), its decoder linears never get float storage, and
loading a model whose float32 linears are large raises the process's peak RSS by far less than them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.compact_weights import HEAD, LAYER_LINEARS
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.model_loading import load_model
from triton_backend.engines.torch.quantize_weights import quantize_int8
from triton_backend.engines.torch.streamed_loading import stream_compact_model

pytestmark = pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
IDS = [3, 17, 5, 9, 30, 1, 22, 8, 14, 2, 27, 11]


def _tiny_folder(folder: Path, *, tie: bool, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    model.save_pretrained(folder)
    return folder


def _runtime(weights: WeightPrecision, **kwargs: object) -> RuntimeConfig:
    return RuntimeConfig(weights=weights, max_batch_size=2, max_seq_len=64, **kwargs)


def _logits(engine: LlamaEngine) -> torch.Tensor:
    slot = engine.allocate()
    out = engine.forward([BatchRow(slot, 0, IDS, num_logits=len(IDS))])[0].logits
    step = engine.forward([BatchRow(slot, len(IDS), [int(out[-1].argmax())])])[0].logits
    engine.release(slot)
    return torch.cat([out, step])


def _full(folder: Path, runtime: RuntimeConfig, *, keep_head: bool = False, checkpoint: Path | None = None) -> LlamaEngine:
    from triton_backend.engines.torch.model_loading import make_torch_engine

    engine = make_torch_engine(load_model(folder, runtime), runtime=runtime, eos_token_ids=[], checkpoint=checkpoint)
    engine.release_float_linears(keep_head=keep_head)
    return engine


def _decoder_weights(engine: LlamaEngine) -> list[torch.Tensor]:
    return [layer.get_submodule(n).weight for layer in engine.model.base_model.layers for n in LAYER_LINEARS]


@pytest.mark.parametrize("weights", [WeightPrecision.INT8, WeightPrecision.INT4])
@pytest.mark.parametrize("tie", [False, True])
def test_streamed_engine_gives_the_full_loads_logits(tmp_path, weights, tie):
    folder = _tiny_folder(tmp_path / "tiny", tie=tie)
    runtime = _runtime(weights)
    streamed = stream_compact_model(folder, None, runtime)
    assert streamed is not None
    engine = LlamaEngine(streamed.model, runtime=runtime, eos_token_ids=[], compact=streamed.compact)
    full = _full(folder, runtime)
    assert engine.weights is full.weights is weights
    assert torch.equal(_logits(engine), _logits(full))
    assert all(w.is_meta for w in _decoder_weights(engine))
    assert engine.model.lm_head.weight.is_meta is (not tie)  # a tied head is the float embedding
    assert engine.resident_weight_bytes() == full.resident_weight_bytes()
    assert engine.release_float_linears() == 0  # nothing left to release


def test_a_float_head_kept_for_a_drafter_and_a_float16_head(tmp_path):
    folder = _tiny_folder(tmp_path / "tiny", tie=False)
    runtime = _runtime(WeightPrecision.INT4, quantize_lm_head=False)
    streamed = stream_compact_model(folder, None, runtime, keep_float_head=True)
    assert streamed is not None and streamed.compact[HEAD].weight.format.name == "FLOAT16"
    engine = LlamaEngine(streamed.model, runtime=runtime, eos_token_ids=[], compact=streamed.compact)
    full = _full(folder, runtime, keep_head=True)
    assert torch.equal(engine.model.lm_head.weight, full.model.lm_head.weight)
    assert torch.equal(_logits(engine), _logits(full))


def _write_w8a16_checkpoint(folder: Path, model: LlamaForCausalLM) -> Path:
    """The TensorRT-LLM checkpoint layout of ``model`` with W8A16 linears (round to nearest), 16-bit floats."""
    from safetensors.torch import save_file

    folder.mkdir()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    half = lambda t: t.to(torch.float16).contiguous()  # noqa: E731
    tensors = {"transformer.vocab_embedding.weight": half(state["model.embed_tokens.weight"]),
               "transformer.ln_f.weight": half(state["model.norm.weight"]), "lm_head.weight": half(state["lm_head.weight"])}

    def linear(name: str, weight: torch.Tensor) -> None:
        q, scales = quantize_int8(weight)
        tensors[f"{name}.weight"], tensors[f"{name}.weights_scaling_factor"] = q.contiguous(), half(scales)

    for i in range(model.config.num_hidden_layers):
        h, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        tensors[t + "input_layernorm.weight"] = half(state[h + "input_layernorm.weight"])
        tensors[t + "post_layernorm.weight"] = half(state[h + "post_attention_layernorm.weight"])
        linear(t + "attention.qkv", torch.cat([state[h + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
        for src, dst in (("attention.dense", "self_attn.o_proj"), ("mlp.fc", "mlp.gate_proj"), ("mlp.gate", "mlp.up_proj"),
                         ("mlp.proj", "mlp.down_proj")):
            linear(t + src, state[h + dst + ".weight"])
    save_file(tensors, str(folder / "rank0.safetensors"))
    config = {"architecture": "LlamaForCausalLM", "dtype": "float16", "mapping": {"tp_size": 1, "pp_size": 1},
              "quantization": {"quant_algo": "W8A16"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_checkpoints_linears_stream_without_reading_the_float_ones(tmp_path):
    folder = _tiny_folder(tmp_path / "tiny", tie=False)
    checkpoint = _write_w8a16_checkpoint(tmp_path / "ckpt", load_model(folder))
    runtime = _runtime(WeightPrecision.FLOAT32)  # the checkpoint's linears decide the precision
    streamed = stream_compact_model(folder, None, runtime, checkpoint=checkpoint)
    assert streamed is not None
    engine = LlamaEngine(streamed.model, runtime=runtime, eos_token_ids=[], compact=streamed.compact)
    full = _full(folder, runtime, checkpoint=checkpoint)
    assert engine.weights is WeightPrecision.INT8
    assert torch.equal(engine.model.model.embed_tokens.weight, full.model.model.embed_tokens.weight)
    assert torch.equal(_logits(engine), _logits(full))
    assert all(w.is_meta for w in _decoder_weights(engine)) and engine.model.lm_head.weight.is_meta


def test_what_is_not_streamed_loads_in_full(tmp_path):
    folder = _tiny_folder(tmp_path / "tiny", tie=False)
    assert stream_compact_model(folder, None, _runtime(WeightPrecision.FLOAT32)) is None  # nothing compact
    assert stream_compact_model(folder, None, _runtime(WeightPrecision.INT8, torch_engine="hf")) is None
    (folder / "model.safetensors").rename(folder / "other.bin")
    assert stream_compact_model(folder, None, _runtime(WeightPrecision.INT8)) is None  # no safetensors
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors is corrupt or truncated"):
        stream_compact_model(folder, None, _runtime(WeightPrecision.INT8))


def test_load_engine_streams_the_reference_model_with_the_full_loads_logits():
    """``load_engine`` streams a quantized target (its decoder linears have no float storage), and the
    real reference model streamed at int4 gives the full load's logits bit for bit."""
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.engines.torch.model_loading import load_engine

    # groups of 64: quantized at load (streamed); int4 in groups of 32 (or auto) serves the reference GGUF's
    # own blocks instead (model_loading.gguf_compact, tests/test_gguf_blocks.py)
    runtime = _runtime(WeightPrecision.INT4, int4_group_size=64)
    engine, _ = load_engine("smollm2-135m-instruct", runtime)
    assert all(w.is_meta for w in _decoder_weights(engine))
    assert torch.equal(_logits(engine), _logits(_full(ensure_reference_model(), runtime)))


# the peak is VmHWM (this process image's own high-water mark): ru_maxrss would carry the forked
# parent's (pytest's) RSS across exec
_PEAK = """
import sys, torch
from pathlib import Path
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.engines.torch.streamed_loading import stream_compact_model

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

torch.set_num_threads(1)
before = status("VmRSS")
streamed = stream_compact_model(Path(sys.argv[1]), None, RuntimeConfig(weights=WeightPrecision(sys.argv[2]), max_seq_len=64))
assert streamed is not None
print(status("VmHWM") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's RSS from /proc")
def test_loading_large_linears_raises_the_peak_by_far_less_than_their_float_copy(tmp_path):
    """Six layers of 1024-wide linears (240 MiB in float32): the streamed int4 load raises the
    process's peak RSS by less than 60% of that (measured 69-91 MiB: the int4 copies, about 34 MiB,
    one float tensor at a time and the modelling code's imports); a load that held the float32
    linears, even only until quantized, would raise it by more than all of them."""
    from safetensors.torch import save_file

    layers, hidden, inner = 6, 1024, 2048
    config = LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    folder = tmp_path / "wide"
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden), "self_attn.v_proj": (hidden, hidden),
              "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden),
              "mlp.down_proj": (hidden, inner)}
    tensors = {"model.embed_tokens.weight": torch.randn(32, hidden, generator=gen), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors.update({f"{p}{name}.weight": torch.randn(*shape, generator=gen) * 0.02 for name, shape in shapes.items()})
    tensors = {k: v.clone() for k, v in tensors.items()}  # no shared storage in the file
    float_linears = sum(v.numel() * 4 for k, v in tensors.items() if "_proj" in k)
    save_file(tensors, str(folder / "model.safetensors"))
    del tensors
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _PEAK, str(folder), "int4"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    raised = int(out.stdout.strip().splitlines()[-1])
    assert raised < 0.6 * float_linears, (raised, float_linears)


def test_quantizing_in_row_blocks_gives_the_same_bits(monkeypatch):
    from triton_backend.engines.torch import quantize_weights as qw

    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(1))
    whole = [qw.quantize_int8(w), qw.quantize_int4(w, 64), qw.quantize_fp8(w)]
    monkeypatch.setattr(qw, "BLOCK_ELEMENTS", 5 * 128)  # blocks of 5 rows, the last of 2
    for (q, s), (q2, s2) in zip(whole, [qw.quantize_int8(w), qw.quantize_int4(w, 64), qw.quantize_fp8(w)]):
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
