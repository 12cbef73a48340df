"""Helpers for the build tests: tiny random Llama model folders, and an independent checker of
TensorRT-LLM checkpoints (written here from the format's definition, not from modelopt).

Checkpoint layout (Llama): ``transformer.vocab_embedding.weight``, ``lm_head.weight`` (both
split over TP along the vocabulary), and per layer ``attention.qkv`` (q, k, v rows of this
rank, concatenated), ``attention.dense`` (o_proj, split along its input), ``mlp.fc``
(gate_proj), ``mlp.gate`` (up_proj), ``mlp.proj`` (down_proj, split along its input),
``input_layernorm``, ``post_layernorm``; ``transformer.ln_f``.

Quantized linears:
* FP8: ``weight`` float8_e4m3fn, ``weights_scaling_factor`` one float32 (= amax / 448);
  W ~= fp8 * scale.
* INT4-AWQ: ``weight`` int8 [out/2, in], two signed int4 per byte (row 2i in the low nibble,
  row 2i+1 in the high nibble); ``weights_scaling_factor`` float32 [out, in/128] (one per group
  of 128 inputs, = group amax / 7); ``prequant_scaling_factor`` [in] (the activation scale AWQ
  folds out of the weight): W ~= int4 * group scale * prequant.
* INT8-SQ: ``weight`` int8 [out, in]; ``weights_scaling_factor`` float32 [out]; W ~= int8 *
  channel scale * prequant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

FP8_MAX = 448.0
GROUP = 128


def make_tiny_llama(folder: Path, tokenizer_dir: Path, *, seed: int = 0, hidden: int = 256, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 512, tie: bool = True) -> Path:
    """A random Llama sharing the reference model's tokenizer (vocabulary 49152), saved as a
    HF folder with that tokenizer: a valid draft for the reference target."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-uniform per-input-channel magnitudes: something for AWQ/SmoothQuant to smooth
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
                lin.weight.mul_(torch.linspace(0.2, 3.0, lin.weight.shape[1]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def _shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank]


def expected_linears(state: dict[str, torch.Tensor], num_layers: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Original float weights of every linear as rank ``rank`` of TP ``tp`` should hold them."""
    out = {}
    for i in range(num_layers):
        p, q = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = [_shard(state[p + f"self_attn.{n}_proj.weight"], 0, tp, rank) for n in "qkv"]
        out[q + "attention.qkv"] = torch.cat(qkv, 0)
        out[q + "attention.dense"] = _shard(state[p + "self_attn.o_proj.weight"], 1, tp, rank)
        out[q + "mlp.fc"] = _shard(state[p + "mlp.gate_proj.weight"], 0, tp, rank)
        out[q + "mlp.gate"] = _shard(state[p + "mlp.up_proj.weight"], 0, tp, rank)
        out[q + "mlp.proj"] = _shard(state[p + "mlp.down_proj.weight"], 1, tp, rank)
    return out


def expected_float_tensors(state: dict[str, torch.Tensor], num_layers: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Unquantized tensors: embedding, LM head (the embedding when tied) and norms."""
    embed = state["model.embed_tokens.weight"]
    head = state.get("lm_head.weight", embed)
    out = {"transformer.vocab_embedding.weight": _shard(embed, 0, tp, rank), "lm_head.weight": _shard(head, 0, tp, rank),
           "transformer.ln_f.weight": state["model.norm.weight"]}
    for i in range(num_layers):
        out[f"transformer.layers.{i}.input_layernorm.weight"] = state[f"model.layers.{i}.input_layernorm.weight"]
        out[f"transformer.layers.{i}.post_layernorm.weight"] = state[f"model.layers.{i}.post_attention_layernorm.weight"]
    return out


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out/2, in] bytes -> [out, in] signed int4 values (low nibble: even row)."""
    b = packed.view(torch.uint8).to(torch.int16)
    low, high = b & 0x0F, (b >> 4) & 0x0F
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1]).to(torch.float32)


@dataclass
class CheckReport:
    tensors: int = 0
    max_rel_error: dict[str, float] = field(default_factory=dict)  # per linear: max |err| / max |W|


def _within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, report: CheckReport) -> None:
    err = (got - want).abs()
    worst = float((err - bound).max())
    assert worst <= 0, f"{name}: error exceeds the format's bound by {worst:.3g} (max err {float(err.max()):.3g})"
    report.max_rel_error[name] = float(err.max() / want.abs().max())


def check_fp8(name: str, f, w: torch.Tensor, report: CheckReport, amax: float | None = None) -> None:
    """``amax``: of the tensors sharing this scale (TensorRT-LLM fuses mlp.fc and mlp.gate into
    one FP8 GEMM, so they share one scale); default the tensor's own."""
    amax = float(w.abs().max()) if amax is None else amax
    q = f.get_tensor(name + ".weight")
    scale = f.get_tensor(name + ".weights_scaling_factor")
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == tuple(w.shape), (name, q.dtype, q.shape, w.shape)
    assert scale.dtype == torch.float32 and scale.numel() == 1, (name, scale.dtype, scale.shape)
    s = float(scale)
    assert abs(s - amax / FP8_MAX) <= 1e-3 * s, f"{name}: scale {s} is not amax/448 ({amax / FP8_MAX})"
    deq = q.to(torch.float32) * s
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; subnormal spacing 2^-9 (times the scale)
    _within(name, deq, w, w.abs() * 2**-4 + s * 2**-9 + 1e-7, report)


def check_int4_awq(name: str, f, w: torch.Tensor, report: CheckReport) -> None:
    packed = f.get_tensor(name + ".weight")
    scales = f.get_tensor(name + ".weights_scaling_factor")
    pre = f.get_tensor(name + ".prequant_scaling_factor").to(torch.float32)
    out_f, in_f = w.shape
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (out_f // 2, in_f), (name, packed.dtype, packed.shape)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (out_f, in_f // GROUP), (name, scales.shape)
    assert tuple(pre.shape) == (in_f,), (name, pre.shape)
    q = unpack_int4(packed)
    assert q.min() >= -8 and q.max() <= 7
    group_scale = scales.repeat_interleave(GROUP, dim=1)  # [out, in]
    smoothed = w / pre  # the weight AWQ quantized (activations carry 1/pre)
    amax = smoothed.abs().reshape(out_f, in_f // GROUP, GROUP).amax(-1)
    assert torch.allclose(scales, amax / 7, rtol=2e-3, atol=1e-8), f"{name}: group scales are not group amax / 7"
    deq = q * group_scale * pre
    # round to nearest: |err| <= half a step, in the smoothed space; prequant is stored in 16 bits
    _within(name, deq, w, 0.5 * group_scale * pre * (1 + 2**-9) + w.abs() * 2**-9, report)


def check_int8_sq(name: str, f, w: torch.Tensor, report: CheckReport) -> None:
    q = f.get_tensor(name + ".weight")
    scales = f.get_tensor(name + ".weights_scaling_factor")
    pre = f.get_tensor(name + ".prequant_scaling_factor").to(torch.float32)
    assert q.dtype == torch.int8 and tuple(q.shape) == tuple(w.shape), (name, q.dtype, q.shape)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (w.shape[0],), (name, scales.shape)
    smoothed = w / pre
    assert torch.allclose(scales, smoothed.abs().amax(1) / 127, rtol=2e-3, atol=1e-8), f"{name}: scales not amax/127"
    deq = q.to(torch.float32) * scales[:, None] * pre
    _within(name, deq, w, 0.5 * scales[:, None] * pre * (1 + 2**-9) + w.abs() * 2**-9, report)


_CHECKERS = {"fp8": check_fp8, "int4_awq": check_int4_awq, "int8_sq": check_int8_sq}


def _shared_amax(linears: dict[str, torch.Tensor], name: str) -> float:
    """amax over the tensors that share ``name``'s FP8 scale (mlp.fc with mlp.gate)."""
    for a, b in ((".mlp.fc", ".mlp.gate"), (".mlp.gate", ".mlp.fc")):
        if name.endswith(a):
            return max(float(linears[name].abs().max()), float(linears[name[: -len(a)] + b].abs().max()))
    return float(linears[name].abs().max())


def check_checkpoint(folder: Path, state: dict[str, torch.Tensor], num_layers: int, precision: str, tp: int,
                     fp8_kv: bool) -> CheckReport:
    """Every rank's names, shapes and dtypes, and every weight against the original within
    the format's error bound. ``state``: the float32 HF state dict before quantization."""
    report = CheckReport()
    for rank in range(tp):
        with safe_open(str(folder / f"rank{rank}.safetensors"), "pt") as f:
            names = set(f.keys())
            linears = expected_linears(state, num_layers, tp, rank)
            floats = expected_float_tensors(state, num_layers, tp, rank)
            for name, want in floats.items():
                got = f.get_tensor(name)
                assert got.dtype == torch.float16 and got.shape == want.shape, (name, got.dtype, got.shape)
                assert torch.allclose(got.float(), want, rtol=2**-10, atol=1e-6), f"{name} differs from the original"
                report.tensors += 1
            for name, want in linears.items():
                if precision == "fp16":
                    got = f.get_tensor(name + ".weight")
                    assert got.dtype == torch.float16 and got.shape == want.shape, (name, got.dtype, got.shape)
                    assert torch.allclose(got.float(), want, rtol=2**-10, atol=1e-6), f"{name} differs"
                elif precision == "fp8":
                    check_fp8(name, f, want, report, _shared_amax(linears, name))
                else:
                    _CHECKERS[precision](name, f, want, report)
                report.tensors += 1
            for i in range(num_layers):
                kv_names = {f"transformer.layers.{i}.attention.{n}_cache_scaling_factor" for n in ("k", "v", "kv")}
                assert kv_names <= names if fp8_kv else not (kv_names & names), (i, sorted(kv_names & names))
            extra = names - set(floats) - _allowed_linear_names(linears, precision) - _kv_names(num_layers, fp8_kv)
            assert not extra, f"unexpected tensors in rank {rank}: {sorted(extra)[:6]}"
    return report


def _allowed_linear_names(linears: dict[str, torch.Tensor], precision: str) -> set[str]:
    suffixes = {"fp16": ("weight",), "fp8": ("weight", "weights_scaling_factor", "activation_scaling_factor"),
                "int4_awq": ("weight", "weights_scaling_factor", "prequant_scaling_factor"),
                "int8_sq": ("weight", "weights_scaling_factor", "prequant_scaling_factor", "activation_scaling_factor")}
    return {f"{name}.{s}" for name in linears for s in suffixes[precision]}


def _kv_names(num_layers: int, fp8_kv: bool) -> set[str]:
    if not fp8_kv:
        return set()
    return {f"transformer.layers.{i}.attention.{n}_cache_scaling_factor" for i in range(num_layers) for n in ("k", "v", "kv")}
