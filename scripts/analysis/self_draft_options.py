"""The self draft's options side by side against plain float32 decoding, in one process, on
held-out chat prompts (not the bench's): where the draft's context comes from (``context``:
``draft`` prefills the prompt through the int8 draft, ``prompt`` copies the target's prefill,
``committed`` copies every verified position), layer skipping (``layers``: keep that many of the
target's layers, as the planner picks them), the confidence stop (``stop``) and the draft length
``k``. Rows run every prompt, repeats interleaved in a shuffled order; every row's greedy output is
checked against plain's. Per row: tok/s and its ratio over plain, mean TTFT, tokens per target
pass, acceptance, drafted tokens per round, and ``x cost``: the ratio over plain in pass-cost units,
which a busy machine does not disturb (every target pass after the prompt's by the new tokens it
carried, the measured table; every draft pass the same, times the drafter's measured cost per
drafted token, the draft's own prompt prefill included). Example::

    .venv/bin/python scripts/analysis/self_draft_options.py --prompts 6 --repeats 2 \\
        --rows "context=draft;context=prompt;context=committed;layers=24;stop=0.5,k=6"

A row is ``;``-separated from the next, its settings ``,``-separated ``name=value`` (``precision``,
``context``, ``layers``, ``stop``, ``k``; ``fallback=off``: always draft, the gain rule off); unset ones are :class:`SelfDraftConfig`'s defaults, k=4.
"""

from __future__ import annotations

import argparse
import logging
import random
from collections import defaultdict
from pathlib import Path

from builder.bench.config import BenchPrompt
from builder.bench.rows import OursRow, Row
from builder.plan.planner import self_draft_layers
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SpeculationConfig, SpeculationMode
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.deployment.deployment_config import DeploymentConfig, SelfDraftConfig
from triton_backend.deployment.self_draft import self_draft_engine, self_drafter
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.pass_cost import runtime_settings
from triton_backend.speculation.cost_model import current_cost_model

HELDOUT = Path(__file__).resolve().parents[2] / "builder" / "data" / "heldout_prompts.txt"


def parse_row(text: str, num_layers: int) -> tuple[str, SelfDraftConfig, int]:
    fields = dict(part.split("=", 1) for part in text.split(",") if part)
    fields.pop("fallback", None)
    layers = None
    if "layers" in fields:
        layers = self_draft_layers(num_layers, int(fields["layers"]))
    config = SelfDraftConfig(precision=WeightPrecision(fields.get("precision", "int8")), layers=layers,
                             **({"context": fields["context"]} if "context" in fields else {}),
                             **({"stop_below": float(fields["stop"])} if "stop" in fields else {}))
    return text, config, int(fields.get("k", 4))


class Meter:
    """Pass-cost units of what runs: target passes after a request's first (its prompt's), and
    draft passes priced at the drafter's cost per drafted token."""

    def __init__(self, target) -> None:
        self.units = 0.0
        self._first = True
        self.target = target  # its measured pass costs price every pass

    def start(self) -> None:
        self._first = True

    def wrap(self, engine, scale: float | None) -> None:
        forward = engine.forward

        def counted(rows):
            sizes = [len(r.tokens) for r in rows]
            if scale is not None:
                self.units += scale * current_cost_model(self.target).pass_cost(sizes)
            elif self._first:
                self._first = False
            else:
                self.units += current_cost_model(self.target).pass_cost(sizes)
            return forward(rows)

        engine.forward = counted


def build_rows(decoder: SpeculativeDecoder, specs: list[str], meter: Meter) -> list[Row]:
    target = decoder.target
    meter.wrap(target, None)
    rows: list[Row] = [OursRow("plain", decoder, SpeculationConfig(method=SpeculationMode.OFF))]
    engines = {}
    for spec in specs:
        name, config, k = parse_row(spec, int(target.model.config.num_hidden_layers))
        fields = dict(part.split("=", 1) for part in spec.split(",") if part)
        key = (config.precision, config.layers)
        if key not in engines:
            engines[key] = self_draft_engine(target.model, target.runtime, config, name=target.name,
                                             eos_token_ids=sorted(target.eos_token_ids))
            drafter = self_drafter(engines[key], target, config, settings=runtime_settings(target.runtime))
            meter.wrap(engines[key], drafter.relative_cost)  # once per engine, at its measured cost
        drafter = self_drafter(engines[key], target, config, settings=runtime_settings(target.runtime))
        own = SpeculativeDecoder(target, decoder.tokenizer, drafters={SpeculationMode.DRAFT: drafter})
        fallback = FallbackConfig(enabled=fields.get("fallback", "on") != "off")
        speculation = SpeculationConfig(method=SpeculationMode.DRAFT, draft_length=DraftLengthConfig(num_draft_tokens=k),
                                        fallback=fallback)
        rows.append(OursRow(name, own, speculation, {"cost": drafter.relative_cost}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="context=draft;context=prompt")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--skip", type=int, default=0, help="held-out prompts to skip first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    decoder = build_decoder(DeploymentConfig(runtime=RuntimeConfig(num_threads=1), ngram=False))
    meter = Meter(decoder.target)
    rows = build_rows(decoder, [s for s in args.rows.split(";") if s], meter)
    texts = [t for t in HELDOUT.read_text().splitlines() if t.strip()][args.skip:args.skip + args.prompts]
    prompts = []
    for i, text in enumerate(texts):
        templated = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=False)
        prompts.append(BenchPrompt("chat", i, templated, decoder.encode(templated)))
    for row in rows:  # warm-up
        row.run(prompts[0], 8, False)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    plain_out: dict[int, list[int]] = {}
    order = random.Random(0)
    for _ in range(args.repeats):
        for prompt in prompts:
            shuffled = list(rows)
            order.shuffle(shuffled)
            shuffled.sort(key=lambda r: r.name != "plain")  # plain first: its output is the reference
            for row in shuffled:
                meter.start()
                before = meter.units
                result = row.run(prompt, args.max_tokens, False)
                totals[row.name]["units"] += meter.units - before
                t = totals[row.name]
                if row.name == "plain":
                    plain_out[prompt.index] = result.tokens
                t["differ"] += result.tokens != plain_out[prompt.index]
                t["tokens"] += len(result.tokens)
                t["seconds"] += result.latency_s
                t["ttft"] += result.ttft_s
                t["runs"] += 1
                stats = result.stats or {}
                t["passes"] += stats.get("target_passes", 0)
                t["drafted"] += stats.get("drafted_tokens", 0)
                t["accepted"] += stats.get("accepted_tokens", 0)
                t["rounds"] += stats.get("speculative_rounds", 0)
    plain = totals["plain"]
    plain_rate = plain["tokens"] / plain["seconds"]
    print(f"{'row':42s} {'tok/s':>7s} {'x plain':>7s} {'TTFT s':>7s} {'tok/pass':>8s} {'accept':>6s} "
          f"{'k/round':>7s} {'cost':>5s} {'x cost':>6s} differ")
    for row in rows:
        t = totals[row.name]
        rate = t["tokens"] / t["seconds"]
        print(f"{row.name:42s} {rate:7.1f} {rate / plain_rate:7.3f} {t['ttft'] / t['runs']:7.3f} "
              f"{t['tokens'] / max(1, t['passes']):8.2f} {t['accepted'] / max(1, t['drafted']):6.3f} "
              f"{t['drafted'] / max(1, t['rounds']):7.2f} {row.info.get('cost', 0):5.2f} "
              f"{(t['tokens'] / t['units']) / (plain['tokens'] / plain['units']):6.3f} {int(t['differ'])}")


if __name__ == "__main__":
    main()
