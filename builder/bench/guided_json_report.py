"""The JSON workload's table and headline figures (``specbuild bench json``).

Per row: tokens, target passes, tokens per pass, wall-clock tok/s and its ratio to constrained
plain (the median of the per-repeat ratios), ``decode tok/s`` (tokens after each request's
first over the time after it: rows whose outputs differ in length compare per decoding step),
whether every output equals constrained plain's token for token, and how many outputs parse
and are valid for their schema.

Headline (merged into the run's headline file, :func:`builder.bench.config.headline_file`):

- ``guided_json_x_plain``: the best speculative constrained row over constrained plain,
  wall-clock tok/s (written only when every constrained output equals constrained plain's);
- ``guided_plain_x_unconstrained``: constrained plain over unconstrained plain, decode tok/s;
- ``guided_valid_share``: the share of constrained outputs valid for their schema.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from builder.bench.guided_json import JsonBenchRun, JsonSample
from builder.bench.writer import ReportTarget
from builder.headline import update_headline
from builder.report_paths import portable

logger = logging.getLogger(__name__)

CONSTRAINED_PLAIN = "constrained plain"
UNCONSTRAINED_PLAIN = "unconstrained plain"


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    """``text`` is one JSON value valid for ``schema`` (checked by ``jsonschema``, not the grammar)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _rates(samples: list[JsonSample]) -> dict[int, tuple[float, float]]:
    """Per repeat: (wall-clock tok/s, decode tok/s)."""
    tokens, seconds, steps, decode = (defaultdict(float) for _ in range(4))
    for s in samples:
        tokens[s.repeat] += len(s.tokens)
        seconds[s.repeat] += s.latency_s
        steps[s.repeat] += max(0, len(s.tokens) - 1)
        decode[s.repeat] += s.decode_s
    return {r: (tokens[r] / seconds[r] if seconds[r] else 0.0, steps[r] / decode[r] if decode[r] else 0.0)
            for r in tokens}


def _median_ratio(rates: dict[int, tuple[float, float]], base: dict[int, tuple[float, float]], i: int) -> float | None:
    ratios = [rates[r][i] / base[r][i] for r in rates if r in base and base[r][i] > 0]
    return statistics.median(ratios) if ratios else None


def summarize_json(run: JsonBenchRun) -> dict[str, Any]:
    schemas = {p.name: p.schema for p in run.prompts}
    by_row: dict[str, list[JsonSample]] = defaultdict(list)
    for s in run.samples:
        by_row[s.row].append(s)
    reference = {(s.prompt, s.repeat): s.tokens for s in by_row[CONSTRAINED_PLAIN]}
    rates = {row.name: _rates(by_row[row.name]) for row in run.rows}
    table = []
    for row in run.rows:
        samples = by_row[row.name]
        if not samples:
            continue
        tokens, passes = sum(len(s.tokens) for s in samples), sum(s.target_passes for s in samples)
        valid = sum(is_valid(s.text, schemas[s.prompt]) for s in samples)
        entry = {"row": row.name, **{k: v for k, v in asdict(row).items() if k != "name"}, "speculative": row.speculative, "requests": len(samples),
                 "tokens": tokens, "target_passes": passes, "tokens_per_target_pass": tokens / passes if passes else 0.0,
                 "tokens_per_s": statistics.median(r[0] for r in rates[row.name].values()),
                 "decode_tokens_per_s": statistics.median(r[1] for r in rates[row.name].values()),
                 "x_constrained_plain": _median_ratio(rates[row.name], rates.get(CONSTRAINED_PLAIN, {}), 0),
                 "decode_x_unconstrained_plain": _median_ratio(rates[row.name], rates.get(UNCONSTRAINED_PLAIN, {}), 1),
                 "valid": valid, "length_stops": sum(s.finish_reason == "length" for s in samples)}
        if row.constrained:
            entry["identical_to_constrained_plain"] = all(reference.get((s.prompt, s.repeat)) == s.tokens
                                                          for s in samples)
        table.append(entry)
    return {"environment": run.environment, "config": portable(asdict(run.config)),
            "prompts": [{"name": p.name, "kind": p.kind} for p in run.prompts], "rows": table,
            "headline": json_headline(table)}


def json_headline(table: list[dict[str, Any]]) -> dict[str, float]:
    """The headline figures of a summary's rows (see the module doc); only what was measured."""
    constrained = [e for e in table if e["constrained"]]
    figures: dict[str, float] = {}
    requests = sum(e["requests"] for e in constrained)
    if requests:
        figures["guided_valid_share"] = sum(e["valid"] for e in constrained) / requests
    exact = all(e.get("identical_to_constrained_plain") for e in constrained)
    if not exact:
        logger.error("a constrained row's output differs from constrained plain decoding: no speed figure written")
    speculative = [e["x_constrained_plain"] for e in constrained if e["speculative"] and e["x_constrained_plain"]]
    if speculative and exact:
        figures["guided_json_x_plain"] = max(speculative)
    plain = next((e for e in table if e["row"] == CONSTRAINED_PLAIN), None)
    if plain is not None and plain["decode_x_unconstrained_plain"] is not None:
        figures["guided_plain_x_unconstrained"] = plain["decode_x_unconstrained_plain"]
    return figures


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def json_markdown(summary: dict[str, Any]) -> str:
    env, cfg = summary["environment"], summary["config"]
    kinds = defaultdict(int)
    for p in summary["prompts"]:
        kinds[p["kind"]] += 1
    lines = [f"Machine: {env.get('processor', '?')} (torch {env.get('torch', '?')}, {env.get('threads', '?')} thread(s)); "
             f"{kinds['extraction']} extraction and {kinds['tool_call']} tool-call prompts, up to {cfg['max_tokens']} "
             f"tokens, {cfg['repeats']} interleaved repeats; greedy, float32.", "",
             "| row | requests | tokens | target passes | tokens/pass | tok/s | x constrained plain | decode tok/s "
             "| decode x unconstrained | identical | valid | cut at max_tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary["rows"]:
        lines.append(f"| {e['row']} | {e['requests']} | {e['tokens']} | {e['target_passes']} "
                     f"| {_fmt(e['tokens_per_target_pass'])} | {_fmt(e['tokens_per_s'], '.1f')} "
                     f"| {_fmt(e['x_constrained_plain'])} | {_fmt(e['decode_tokens_per_s'], '.1f')} "
                     f"| {_fmt(e['decode_x_unconstrained_plain'])} | {_fmt(e.get('identical_to_constrained_plain'))} "
                     f"| {e['valid']}/{e['requests']} | {e['length_stops']} |")
    lines.append("")
    lines += [f"- `{key}`: {value:.3f}" for key, value in sorted(summary["headline"].items())]
    return "\n".join(lines) + "\n"


def write_json_report(summary: dict[str, Any], target: ReportTarget) -> dict[str, Path]:
    """``guided-json-<label>.json`` / ``.md`` in ``target.out_dir``; the headline figures merged into
    ``target.headline`` (None: not written)."""
    out_dir, label, headline = target.out_dir, target.label, target.headline
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"guided-json-{label}.json", "markdown": out_dir / f"guided-json-{label}.md"}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["markdown"].write_text(json_markdown(summary))
    if headline is not None and summary["headline"]:
        update_headline(summary["headline"], headline)
        paths["headline"] = headline
    return paths


__all__ = ["is_valid", "json_headline", "json_markdown", "summarize_json", "write_json_report"]
