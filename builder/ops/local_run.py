"""``specbuild run``: build the deployment in-process and generate once, with statistics."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from triton_backend.core.config import (DraftLengthConfig, FallbackConfig, MedusaConfig, SamplingParams,
                                        SpeculationConfig)
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.core.drafter_format import detect_eagle_format
from triton_backend.deployment.deployment_config import DeploymentConfig, SelfDraftConfig
from triton_backend.speculation.decoding import GenerationResult
from triton_backend.core.reference_model import DEFAULT_REFERENCE

# a request the reference model (SmolLM2-135M-Instruct) visibly does: greedy, it writes a correct
# is_even with example calls and their right outputs (the past-tense rewrite used before came back unchanged)
DEFAULT_PROMPT = "Write a Python function that checks whether a number is even, and show an example call."


def parse_layers(text: str) -> tuple[int, ...]:
    """'0-5,28,29' -> (0, 1, 2, 3, 4, 5, 28, 29)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return tuple(out)


SELF = "self"  # --draft self: the target as its own draft


def draft_fields(draft: str | None, precision: str | None, layers: tuple[int, ...] | None) -> dict[str, Any]:
    """The :class:`DeploymentConfig` draft fields of ``--draft`` / ``--draft-precision`` /
    ``--draft-layers``: ``--draft self`` is a :class:`SelfDraftConfig` (int8 unless given)."""
    if draft == SELF:
        return {"self_draft": SelfDraftConfig(precision=precision or WeightPrecision.INT8, layers=layers)}
    if precision is not None:
        raise ConfigError("--draft-precision is the precision of --draft self (a draft model runs at --weights)")
    return {"draft": draft, "draft_layers": layers}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_REFERENCE, help="reference model name, HF directory or .gguf")
    p.add_argument("--draft", default=None, help="draft model (HF directory or .gguf) sharing the target's tokenizer, "
                   "or 'self': the target as its own draft at --draft-precision (docs/quantized-weights.md)")
    p.add_argument("--draft-precision", default=None, choices=["float32", "float16", "bfloat16", "int8", "int4"],
                   help="with --draft self: the draft's weight precision (default int8)")
    p.add_argument("--draft-layers", type=parse_layers, default=None, help="self-speculative draft from target layers, "
                   "e.g. 0-5 (with --draft self: the quantized draft keeps only these layers)")
    p.add_argument("--medusa", default=None, help="Medusa heads file (.safetensors from `specbuild train-medusa`)")
    p.add_argument("--tree-acceptance", default="exact", choices=["exact", "typical"],
                   help="Medusa tree verification when sampling: exact (distribution-preserving) or typical")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--raw", action="store_true", help="send the prompt as is (default: apply the chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter: an EAGLE-1 file or folder (`specbuild train-eagle`) or "
                   "an EAGLE-3 folder (`specbuild train-eagle3`, published EAGLE-3 checkpoints; told apart by its config.json)")
    p.add_argument("--drafter-weights", default="int8",
                   choices=["stored", "float32", "float16", "bfloat16", "int8", "int4", "fp8"],
                   help="precision of an EAGLE-3 drafter's weights (stored: as its file keeps them; "
                        "docs/drafting-strategy.md)")
    p.add_argument("--speculation", default="auto", help="auto, draft, medusa, eagle, ngram or off")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--adaptive", action="store_true", help="adapt the draft length to the running acceptance")
    p.add_argument("--no-fallback", action="store_true", help="never fall back to plain decoding")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on small CPUs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights", default="float32", choices=["float32", "float16", "bfloat16", "int8", "int4", "fp8"],
                   help="precision of the slot engine's linear weights, quantized at load (docs/quantized-weights.md)")
    p.add_argument("--checkpoint", default=None,
                   help="a TensorRT-LLM checkpoint folder whose linear weights the target serves (from `specbuild build`)")


@dataclass(frozen=True)
class LocalRunConfig:
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str = DEFAULT_PROMPT
    chat: bool = True

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "LocalRunConfig":
        speculation = SpeculationConfig(method=a.speculation,
                                        draft_length=DraftLengthConfig(num_draft_tokens=a.num_draft_tokens,
                                                                       adaptive=a.adaptive),
                                        fallback=FallbackConfig(enabled=not a.no_fallback),
                                        medusa=MedusaConfig(tree_acceptance=a.tree_acceptance))
        runtime = RuntimeConfig(device=a.device, num_threads=a.threads, weights=a.weights,
                                drafter_weights=a.drafter_weights)
        deployment = DeploymentConfig(**draft_fields(a.draft, a.draft_precision, a.draft_layers), target=a.target,
                                      medusa=a.medusa, eagle=a.eagle,
                                      eagle_format=detect_eagle_format(a.eagle) if a.eagle else None,
                                      target_checkpoint=a.checkpoint, runtime=runtime, speculation=speculation)
        sampling = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                  top_p=a.top_p, seed=a.seed, stop=tuple(a.stop))
        return cls(deployment=deployment, sampling=sampling, prompt=a.prompt, chat=not a.raw)


def run_local(config: LocalRunConfig) -> GenerationResult:
    decoder = build_decoder(config.deployment)
    prompt = config.prompt
    if config.chat and getattr(decoder.tokenizer, "chat_template", None):
        prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=False)
    return decoder.generate(prompt, config.sampling)
