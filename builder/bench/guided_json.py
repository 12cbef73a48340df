"""``specbuild bench json``: structured output's cost and gain on extraction and tool-call prompts.

Each prompt of ``benchmarks/json_prompts.json`` comes with a JSON schema: an extraction prompt
names its schema; a tool-call prompt lists OpenAI ``tools`` and a ``tool_choice``, and is shown
to the model and decoded exactly as the OpenAI front decodes a forced call
(:mod:`triton_backend.serving.front.openai.tools`: the definitions in a system message, the call's schema as the
guide). The rows, on the same weights in one process, interleaved in a shuffled order per
prompt and repeated:

- ``unconstrained plain``: plain greedy decoding of the same prompt, no guide;
- ``constrained plain``: plain greedy decoding under the schema, no forced drafts;
- ``constrained plain + forced``: the grammar's forced tokens proposed as free drafts;
- ``constrained ngram k=K + forced``: n-gram prompt lookup, and the forced tokens where the
  grammar decides the next bytes.

Every constrained row's output is checked token for token against constrained plain and parsed
and validated against its schema (``jsonschema``). Summary and headline figures:
:mod:`builder.bench.guided_json_report`.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.bench.config import DEFAULT_OUT
from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import DEFAULT_REFERENCE

logger = logging.getLogger(__name__)

DEFAULT_JSON_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "json_prompts.json"
KINDS = ("extraction", "tool_call")


@dataclass(frozen=True)
class JsonBenchConfig:
    target: str = DEFAULT_REFERENCE
    prompts_file: Path = DEFAULT_JSON_PROMPTS
    max_tokens: int = 128
    repeats: int = 3
    ngram_k: int = 4
    forced_tokens: int = 16  # the speculative rows' forced-draft limit (speculation.draft_length.forced_tokens)
    num_threads: int = 1
    out_dir: Path = DEFAULT_OUT
    label: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.repeats <= 0:
            raise ConfigError("max_tokens and repeats must be positive")
        if not 1 <= self.ngram_k <= 64 or not 1 <= self.forced_tokens <= 64:
            raise ConfigError("ngram_k and forced_tokens must be in [1, 64]")
        if not Path(self.prompts_file).is_file():
            raise ConfigError(f"JSON prompt file {self.prompts_file} not found")


@dataclass(frozen=True)
class JsonPrompt:
    name: str
    kind: str  # extraction | tool_call
    messages: tuple[dict[str, str], ...]  # the chat as the model sees it
    schema: dict[str, Any]  # what the output is decoded under and validated against


@dataclass(frozen=True)
class JsonRow:
    name: str
    constrained: bool
    method: str  # off | ngram
    forced_tokens: int = 0
    k: int | None = None

    @property
    def speculative(self) -> bool:
        return self.constrained and (self.method != "off" or self.forced_tokens > 0)


@dataclass
class JsonSample:
    row: str
    prompt: str  # JsonPrompt.name
    repeat: int
    tokens: list[int]
    text: str
    latency_s: float
    decode_s: float  # the request's time after its first token (its prefill)
    target_passes: int
    finish_reason: str


@dataclass
class JsonBenchRun:
    config: JsonBenchConfig
    prompts: list[JsonPrompt]
    rows: list[JsonRow]
    samples: list[JsonSample] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)


def rows_for(config: JsonBenchConfig) -> list[JsonRow]:
    return [JsonRow("unconstrained plain", False, "off"), JsonRow("constrained plain", True, "off"),
            JsonRow("constrained plain + forced", True, "off", config.forced_tokens),
            JsonRow(f"constrained ngram k={config.ngram_k} + forced", True, "ngram", config.forced_tokens, config.ngram_k)]


def _prompt(entry: Any, i: int, path: Path) -> JsonPrompt:
    from triton_backend.serving.front.openai.openai_errors import OpenAIError
    from triton_backend.serving.front.openai.tools import ToolCallPlan, parse_tools

    where = f"{path} prompts[{i}]"
    if not isinstance(entry, dict) or entry.get("kind") not in KINDS or not isinstance(entry.get("text"), str):
        raise ConfigError(f"{where}: needs 'kind' ({' or '.join(KINDS)}) and 'text'")
    name = str(entry.get("name") or f"prompt-{i}")
    user = {"role": "user", "content": entry["text"]}
    if entry["kind"] == "extraction":
        if not isinstance(entry.get("schema"), dict):
            raise ConfigError(f"{where}: an extraction prompt needs a 'schema' object")
        return JsonPrompt(name, "extraction", (user,), entry["schema"])
    try:
        plan = parse_tools({"tools": entry.get("tools"), "tool_choice": entry.get("tool_choice", "required")})
    except OpenAIError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    if not isinstance(plan, ToolCallPlan):  # none, or auto (the model may answer in text)
        raise ConfigError(f"{where}: a tool_call prompt needs tools and a tool_choice that forces a call "
                          f"('required' or a named function), not {entry.get('tool_choice', 'required')!r}")
    return JsonPrompt(name, "tool_call", ({"role": "system", "content": plan.instructions()}, user), plan.schema())


def load_json_prompts(path: Path) -> list[JsonPrompt]:
    """The prompts of a JSON prompt file: ``{"prompts": [{"name", "kind", "text", "schema" |
    "tools" + "tool_choice"}, ...]}``; every schema must compile."""
    from triton_backend.core.errors import InvalidRequestError
    from triton_backend.core.grammar import check_guide
    from triton_backend.core.guide import Guide, GuideType

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the JSON prompt file {path}: {exc}") from None
    entries = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} must hold {{'prompts': [...]}} with at least one prompt")
    prompts = [_prompt(entry, i, Path(path)) for i, entry in enumerate(entries)]
    for prompt in prompts:
        try:
            check_guide(Guide(GuideType.JSON_SCHEMA, json.dumps(prompt.schema)))
        except InvalidRequestError as exc:
            raise ConfigError(f"{path} prompt {prompt.name!r}: {exc}") from None
    if len({p.name for p in prompts}) != len(prompts):
        raise ConfigError(f"{path}: prompt names must be unique")
    return prompts


def _sample(decoder: Any, row: JsonRow, prompt: JsonPrompt, ids: list[int], repeat: int, max_tokens: int) -> JsonSample:
    from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig
    from triton_backend.core.guide import Guide, GuideType

    guide = Guide(GuideType.JSON_SCHEMA, json.dumps(prompt.schema)) if row.constrained else None
    lengths = DraftLengthConfig(forced_tokens=row.forced_tokens, **({"num_draft_tokens": row.k} if row.k else {}))
    started = time.perf_counter()
    result = decoder.generate(ids, SamplingParams(max_tokens=max_tokens, guide=guide),
                              SpeculationConfig(method=row.method, draft_length=lengths))
    latency = time.perf_counter() - started
    stats = result.stats
    return JsonSample(row.name, prompt.name, repeat, list(result.token_ids), result.text, latency,
                      max(0.0, stats.total_time_s - stats.time_to_first_token_s), stats.target_passes,
                      getattr(result.finish_reason, "value", str(result.finish_reason)))


def run_json_bench(config: JsonBenchConfig) -> JsonBenchRun:
    import torch
    from tqdm import tqdm

    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.deployment.torch_deployment import build_decoder

    prompts = load_json_prompts(config.prompts_file)
    decoder = build_decoder(DeploymentConfig(target=config.target, runtime=RuntimeConfig(num_threads=config.num_threads)))
    ids = {p.name: decoder.encode(decoder.tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True,
                                                                        tokenize=False)) for p in prompts}
    rows = rows_for(config)
    run = JsonBenchRun(config, prompts, rows)
    run.environment = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "threads": getattr(decoder.target, "threads", torch.get_num_threads()), "label": config.label}
    for row in rows:  # warm-up (the grammar's tokenizer map, caches), not recorded
        _sample(decoder, row, prompts[0], ids[prompts[0].name], -1, 8)
    order = random.Random(0)
    jobs = [(repeat, prompt) for repeat in range(config.repeats) for prompt in prompts]
    with tqdm(total=len(jobs) * len(rows), desc="bench json", unit="req") as bar:
        for repeat, prompt in jobs:
            shuffled = list(rows)
            order.shuffle(shuffled)  # no row always runs first
            for row in shuffled:
                run.samples.append(_sample(decoder, row, prompt, ids[prompt.name], repeat, config.max_tokens))
                bar.update(1)
    return run


__all__ = ["DEFAULT_JSON_PROMPTS", "JsonBenchConfig", "JsonBenchRun", "JsonPrompt", "JsonRow", "JsonSample",
           "load_json_prompts", "rows_for", "run_json_bench"]
