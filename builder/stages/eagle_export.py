"""A trained EAGLE drafter into a TensorRT-LLM EAGLE checkpoint, and its ``trtllm-build`` command.

Input: the target's TensorRT-LLM checkpoint (``config.json`` + ``rank<r>.safetensors``, as
``specbuild build`` writes it with modelopt) and a drafter file from ``specbuild train-eagle``.
Output: a checkpoint TensorRT-LLM's ``EagleForCausalLM`` loads:

* ``config.json``: the target's, with ``architecture = EagleForCausalLM``,
  ``max_draft_len``, ``num_eagle_layers`` (the draft tree's depth),
  ``max_non_leaves_per_layer`` and ``eagle_net_config`` (the drafter as a one-layer
  ``LlamaForCausalLM`` config of the target's shapes);
* per rank, the target's tensors plus ``num_eagle_layers`` copies of the drafter (TensorRT-LLM
  runs one EagleNet per tree level; they share the trained weights) under
  ``eagle_nets.<i>.drafter.`` -- ``fc.{weight,bias}``, ``vocab_embedding.weight`` (the
  target's), ``layers.0.attention.qkv.weight`` (q, k, v stacked), ``layers.0.attention.dense
  .weight``, ``layers.0.post_layernorm.weight``, ``layers.0.mlp.{fc,gate,proj}.weight``
  (gate_proj, up_proj, down_proj) -- and ``eagle_nets.<i>.lm_head.weight`` (the target's LM
  head). The EagleNet has no input norm in its first layer and no final norm (TensorRT-LLM's
  EAGLE-1 net), as the drafter here. Tensor parallelism splits like the target's layers.

The drafter's candidate vocabulary is a torch-runtime shortcut and is not exported: the
engine's EagleNet ranks the whole vocabulary. The engine command is
``trtllm-build --speculative_decoding_mode eagle --max_draft_len N``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from builder.stages.compile import EngineBuild
from builder.errors import BuildError, BuildSpecError

logger = logging.getLogger(__name__)

ARCHITECTURE = "EagleForCausalLM"


def _target_tensor(tensors: dict[str, torch.Tensor], *names: str) -> torch.Tensor:
    for name in names:
        if name in tensors:
            return tensors[name]
    raise BuildError(f"the target checkpoint has none of {list(names)}")


def eagle_net_config(config: dict[str, Any], info: Any) -> dict[str, Any]:
    """The drafter as TensorRT-LLM's ``eagle_net_config`` (one Llama layer, the target's shapes)."""
    keep = ("dtype", "logits_dtype", "vocab_size", "position_embedding_type", "max_position_embeddings", "hidden_act",
            "rotary_base", "rotary_scaling", "norm_epsilon", "mapping", "use_parallel_embedding", "embedding_sharding_dim")
    net = {k: config[k] for k in keep if k in config}
    net.update({"architecture": "LlamaForCausalLM", "num_hidden_layers": 1, "num_attention_heads": info.num_heads,
                "num_key_value_heads": info.num_kv_heads, "hidden_size": info.hidden_size,
                "intermediate_size": info.intermediate_size, "head_size": info.head_dim, "head_dim": info.head_dim,
                "norm_epsilon": info.rms_norm_eps, "rotary_base": info.rope_theta,
                "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}})
    return net


def _shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].contiguous()


def drafter_tensors(net_state: dict[str, torch.Tensor], tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's own tensors in TensorRT-LLM names (relative to ``drafter.``), rank ``rank`` of ``tp``."""
    p = "layers.0."
    s = {k: v.to(dtype) for k, v in net_state.items()}
    qkv = torch.cat([_shard(s[p + f"self_attn.{n}_proj.weight"], 0, tp, rank) for n in "qkv"], 0)
    return {
        "fc.weight": s["fc.weight"].contiguous(), "fc.bias": s["fc.bias"].contiguous(),
        p + "attention.qkv.weight": qkv,
        p + "attention.dense.weight": _shard(s[p + "self_attn.o_proj.weight"], 1, tp, rank),
        p + "post_layernorm.weight": s[p + "post_attention_layernorm.weight"].contiguous(),
        p + "mlp.fc.weight": _shard(s[p + "mlp.gate_proj.weight"], 0, tp, rank),
        p + "mlp.gate.weight": _shard(s[p + "mlp.up_proj.weight"], 0, tp, rank),
        p + "mlp.proj.weight": _shard(s[p + "mlp.down_proj.weight"], 1, tp, rank),
    }


def write_eagle_checkpoint(target_checkpoint: str | Path, eagle: str | Path, out_dir: str | Path, *,
                           max_draft_len: int, num_eagle_layers: int | None = None,
                           max_non_leaves_per_layer: int = 10) -> Path:
    """Write the EAGLE checkpoint to ``out_dir``; returns it. ``num_eagle_layers`` defaults
    to ``max_draft_len`` (a chain of that depth)."""
    from safetensors.torch import load_file, save_file

    from triton_backend.speculation.drafters.eagle_model import load_eagle
    from triton_backend.core.errors import ModelLoadError

    src, out = Path(target_checkpoint), Path(out_dir)
    if not (src / "config.json").is_file():
        raise BuildSpecError(f"{src} is not a TensorRT-LLM checkpoint (no config.json)")
    layers = num_eagle_layers or max_draft_len
    if not 1 <= max_draft_len <= 256 or not 1 <= layers <= max_draft_len:
        raise BuildSpecError("need 1 <= num_eagle_layers <= max_draft_len <= 256")
    config = json.loads((src / "config.json").read_text())
    try:
        checkpoint = load_eagle(eagle)
    except ModelLoadError as exc:
        raise BuildSpecError(str(exc)) from None
    info = checkpoint.info
    if info.hidden_size != config.get("hidden_size") or info.vocab_size != config.get("vocab_size"):
        raise BuildSpecError(f"the drafter (hidden {info.hidden_size}, vocab {info.vocab_size}) does not fit the target "
                             f"checkpoint (hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')})")
    mapping = config.get("mapping", {})
    tp, world = int(mapping.get("tp_size", 1)), int(mapping.get("world_size", 1))
    if int(mapping.get("pp_size", 1)) != 1:
        raise BuildSpecError("TensorRT-LLM's EAGLE does not support pipeline parallelism; build with pp = 1")
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[config.get("dtype", "float16")]
    state = checkpoint.net.state_dict()
    for rank in range(world):
        tensors = load_file(str(src / f"rank{rank}.safetensors"))
        embed = _target_tensor(tensors, "transformer.vocab_embedding.weight")
        head = _target_tensor(tensors, "lm_head.weight", "transformer.vocab_embedding.weight")
        own = drafter_tensors(state, tp, rank, dtype)
        for i in range(layers):
            prefix = f"eagle_nets.{i}."
            tensors.update({prefix + "drafter." + k: v.clone() for k, v in own.items()})
            tensors[prefix + "drafter.vocab_embedding.weight"] = embed.clone()
            tensors[prefix + "lm_head.weight"] = head.clone()
        save_file(tensors, str(out / f"rank{rank}.safetensors"))
    config.update({"architecture": ARCHITECTURE, "max_draft_len": max_draft_len, "num_eagle_layers": layers,
                   "max_non_leaves_per_layer": max_non_leaves_per_layer,
                   "eagle_net_config": eagle_net_config(config, info)})
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    logger.info("EAGLE checkpoint (%d EagleNets, max_draft_len %d) written to %s", layers, max_draft_len, out)
    return out


def eagle_engine_build(checkpoint_dir: str, engine_dir: str, *, max_draft_len: int, max_batch_size: int = 8,
                       max_input_len: int = 2048, max_seq_len: int = 4096, max_num_tokens: int = 8192,
                       ranks: int = 1) -> EngineBuild:
    """The ``trtllm-build`` invocation of an EAGLE engine (target + EagleNets in one engine)."""
    if max_draft_len < 1:
        raise BuildSpecError("max_draft_len must be >= 1")
    args = ["--gemm_plugin", "auto", "--max_batch_size", str(max_batch_size), "--max_input_len", str(max_input_len),
            "--max_seq_len", str(max_seq_len), "--max_num_tokens", str(max_num_tokens),
            "--use_paged_context_fmha", "enable", "--speculative_decoding_mode", "eagle",
            "--max_draft_len", str(max_draft_len)]
    if ranks > 1:
        args += ["--workers", str(ranks)]
    return EngineBuild("target", checkpoint_dir, engine_dir, ranks, tuple(args))
