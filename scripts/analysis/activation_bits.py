"""What quantizing the activations costs the int4 target's greedy tokens (the reason the compact-weight
kernel keeps 16-bit activations).

llama.cpp's Q4 dot products quantize each block of 32 activations to 8 bits. Here every linear's input
of the reference target (SmolLM2-135M-Instruct, float32: the Q4_1 GGUF's own weights, dequantized) is
quantized and dequantized per block of 32 to ``LEVELS`` (127: 8 bits; 32767: 16 bits, ours) before the
product, and the teacher-forced share of float32's greedy tokens is read on the held-out prompts, as
``bench precision`` reads ``int4_greedy_agreement``. Measured 2026-11-29: 127 -> 0.965, 32767 -> 1.000
(16 prompts x 64 tokens)::

    .venv/bin/python scripts/analysis/activation_bits.py --levels 127 --prompts 16
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from builder.eval.agreement import HELDOUT_PROMPTS, heldout_prompts, prompt_ids
    from triton_backend.core.reference_model import ensure_reference_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=127, help="largest quantized magnitude (127: 8 bits)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = ensure_reference_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    quantizing = {"on": False}

    def fake_quantized(x: torch.Tensor, block: int = 32) -> torch.Tensor:
        blocks = x.reshape(-1, x.shape[-1] // block, block)
        step = blocks.abs().amax(-1, keepdim=True) / args.levels
        q = torch.where(step > 0, torch.round(blocks / torch.where(step > 0, step, torch.ones_like(step))),
                        torch.zeros_like(blocks)).clamp(-args.levels, args.levels)
        return (q * step).reshape(x.shape)

    def hook(module: torch.nn.Module, inputs: tuple) -> tuple | None:
        return (fake_quantized(inputs[0]),) if quantizing["on"] else None

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook)
    kept = total = 0
    with torch.no_grad():
        for text in heldout_prompts(HELDOUT_PROMPTS, args.prompts):
            ids = prompt_ids(tokenizer, text)
            quantizing["on"] = False
            sequence = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)[0]
            continuation = sequence[len(ids):]
            quantizing["on"] = True
            logits = model(sequence[None, :-1]).logits[0, len(ids) - 1:]
            kept += int((logits.argmax(-1) == continuation).sum())
            total += len(continuation)
    print(f"levels {args.levels}: float32's greedy token kept at {kept / total:.4f} of {total} positions")


if __name__ == "__main__":
    main()
