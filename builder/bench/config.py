"""Typed benchmark configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.core.runtime_config import WeightPrecision

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts.json"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
HEADLINE_NAME = "headline.json"
SELF_DRAFT_PRECISIONS = ("int8", "int4", "float16", "bfloat16")  # cheaper than the float32 target


def headline_file(out_dir: Path, choice: Path | None = None) -> Path:
    """Where a bench run writes its headline figures: ``choice`` (``--headline FILE``) when given,
    else ``headline.json`` in the run's output folder. One rule for every key and every kind of
    run, so a bench pointed elsewhere (``--out /tmp/x``) never touches the committed file."""
    return Path(choice) if choice is not None else Path(out_dir) / HEADLINE_NAME


@dataclass(frozen=True)
class BenchConfig:
    target: str = DEFAULT_REFERENCE
    draft: str | None = None  # a draft model directory sharing the target's tokenizer
    medusa: str | None = None  # Medusa heads directory (when the runtime has Medusa)
    medusa_tree_size: int | None = 7  # the first nodes of the file's tree (7 + 1 rows fit one packed GEMM); None: all
    eagle: str | None = None  # an EAGLE drafter file or folder (adds eagle rows)
    eagle_k: tuple[int, ...] = (3,)
    eagle_tree_nodes: int = 11  # a dynamic-tree EAGLE row beside each chain row, trees of at most this many nodes; 0: none
    eagle_always_tree: tuple[int, int] | None = (4, 11)  # an EAGLE row drafting this (depth, nodes) tree every round; None: none
    prompts_file: Path = DEFAULT_PROMPTS
    workloads: tuple[str, ...] = ("chat", "code", "copy")
    prompts_per_workload: int = 5
    max_tokens: int = 96
    ignore_eos: bool = False  # True: fixed-length requests (the peer then masks EOS: its text differs after one)
    repeats: int = 3
    ngram_k: tuple[int, ...] = (4, 8)
    auto: bool = True  # an ``auto`` row (n-gram or model drafter per round) when a model drafter is deployed
    auto_k: int | None = None  # its longest draft (None: the longest n-gram k)
    auto_unmerged: bool = False  # beside it, auto without merged trees (eagle.merge_lookup off): what merging adds
    draft_k: tuple[int, ...] = (4,)
    self_draft: tuple[str, ...] = ()  # weight precisions of the target as its own draft (adds self-draft rows)
    self_draft_k: tuple[int, ...] = (4,)
    peer: bool = True  # Hugging Face generate rows
    triton: bool = False  # the same requests through a real Triton server
    compare_unpacked: bool = False  # plain and n-gram rows again without prepacked linear layers
    num_threads: int = 1
    device: str = "cpu"  # the torch runtime's device ("cpu", "cuda", "cuda:N")
    target_weights: WeightPrecision = WeightPrecision.FLOAT32  # the served target's weights: every row of ours runs on them
    out_dir: Path = DEFAULT_OUT
    plot: bool = True
    label: str = "cpu"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "target_weights", WeightPrecision(self.target_weights))
        except ValueError:
            raise ConfigError(f"target weights must be one of {[p.value for p in WeightPrecision]}, "
                              f"got {self.target_weights!r}") from None
        if self.max_tokens <= 0 or self.repeats <= 0 or self.prompts_per_workload <= 0:
            raise ConfigError("max_tokens, repeats and prompts_per_workload must be positive")
        bad = [p for p in self.self_draft if p not in SELF_DRAFT_PRECISIONS]
        if bad:
            raise ConfigError(f"self-draft precisions must be among {list(SELF_DRAFT_PRECISIONS)}, got {bad}")
        if any(k < 1 for k in self.self_draft_k):
            raise ConfigError("self-draft draft lengths must be positive")
        if not self.prompts_file.exists():
            raise ConfigError(f"prompt file {self.prompts_file} not found")

    def load_prompts(self) -> dict[str, list[str]]:
        data = json.loads(Path(self.prompts_file).read_text())
        workloads = data.get("workloads", {})
        missing = [w for w in self.workloads if w not in workloads]
        if missing:
            raise ConfigError(f"workloads {missing} not in {self.prompts_file} (has {sorted(workloads)})")
        return {w: list(workloads[w])[: self.prompts_per_workload] for w in self.workloads}


@dataclass(frozen=True)
class BenchPrompt:
    workload: str
    index: int
    text: str  # chat-templated prompt text
    ids: list[int]


@dataclass
class Sample:
    """One request of one row."""

    row: str
    workload: str
    prompt_index: int
    repeat: int
    tokens: list[int]  # empty for rows that only return text (through Triton)
    text: str
    num_tokens: int
    latency_s: float
    ttft_s: float
    stats: dict | None = None  # our GenerationStats.to_dict(); None for the peer


@dataclass
class BenchRun:
    config: BenchConfig
    samples: list[Sample] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    row_info: dict[str, dict] = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
