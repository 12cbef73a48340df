"""Structured output on the reference model: tokens per target pass and wall time of JSON-schema
extraction prompts, unconstrained and constrained, plain and speculative, with and without the
grammar's forced tokens drafted for free. ``decode tok/s`` leaves out each request's first token
(its prefill), so rows whose outputs differ in length compare per decoding step.

Every constrained row's greedy output is checked against plain constrained decoding (token for
token) and parsed against its schema; the unconstrained rows against plain unconstrained.
Example (a few minutes on one CPU thread)::

    .venv/bin/python scripts/guided_json.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from triton_backend.core.config import (DraftLengthConfig, RuntimeConfig, SamplingParams, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.guide import Guide, GuideType
from triton_backend.engines.torch.model_loading import load_engine
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.loop import SpeculativeDecoder

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "email"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "email": {"type": "string"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["order_id", "items", "total", "paid"],
         "properties": {"order_id": {"type": "string"}, "total": {"type": "number"}, "paid": {"type": "boolean"},
                        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "additionalProperties": False,
                                                             "required": ["sku", "quantity"],
                                                             "properties": {"sku": {"type": "string"},
                                                                            "quantity": {"type": "integer"}}}}}}
CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"enum": ["get_weather", "book_flight"]},
                       "arguments": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                                     "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
PROMPTS = [
    ("Extract the person as JSON: Alice Smith, 33, lives in Paris, alice.smith@example.com.", PERSON),
    ("Extract the person as JSON: Bob Jones is 41 years old, based in Berlin; email bob@jones.de.", PERSON),
    ("Extract the order as JSON: order A-1093, 2 x SKU-77 and 1 x SKU-12, total 31.50, already paid.", ORDER),
    ("Call a tool for: what is the weather in Tokyo in celsius?", CALL),
]
ROWS = [("unconstrained plain", False, "off", 0), ("unconstrained ngram", False, "ngram", 0),
        ("constrained plain", True, "off", 0), ("constrained plain + forced", True, "off", 16),
        ("constrained ngram", True, "ngram", 0), ("constrained ngram + forced", True, "ngram", 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine, tok = load_engine("smollm2-135m-instruct", RuntimeConfig())
    decoder = SpeculativeDecoder(engine, tok, drafters={SpeculationMode.NGRAM: NgramDrafter()})
    prompts = [(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
                Guide(GuideType.JSON_SCHEMA, json.dumps(schema))) for text, schema in PROMPTS]
    decoder.generate(prompts[0][0], SamplingParams(max_tokens=4, guide=prompts[0][1]))  # warm up (tokenizer map)
    reference: dict[tuple[bool, int], list[int]] = {}
    for name, constrained, method, forced in ROWS:
        spec = SpeculationConfig(method=method, draft_length=DraftLengthConfig(forced_tokens=forced))
        tokens = passes = valid = 0
        seconds = decode_s = 0.0
        for i, (prompt, guide) in enumerate(prompts):
            params = SamplingParams(max_tokens=args.max_tokens, guide=guide if constrained else None)
            t0 = time.perf_counter()
            result = decoder.generate(prompt, params, spec)
            seconds += time.perf_counter() - t0
            decode_s += result.stats.total_time_s - result.stats.time_to_first_token_s
            want = reference.setdefault((constrained, i), result.token_ids)
            if result.token_ids != want:
                raise SystemExit(f"{name}: prompt {i} differs from plain decoding")
            tokens += len(result.token_ids)
            passes += result.stats.target_passes
            if constrained:
                try:
                    json.loads(result.text)
                    valid += 1
                except json.JSONDecodeError:
                    pass
        validity = f", valid JSON {valid}/{len(prompts)}" if constrained else ""
        print(f"{name:28s} tokens {tokens:4d}  passes {passes:4d}  tokens/pass {tokens / passes:5.2f}  "
              f"tok/s {tokens / seconds:5.1f}  decode tok/s {(tokens - len(prompts)) / decode_s:5.1f}{validity}")


if __name__ == "__main__":
    main()
