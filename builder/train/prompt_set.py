"""A large, varied training prompt set for drafter data, built offline on this machine.

Three sources, mixed deterministically from a seed:

* **chat**: seed topics x request templates (explain, compare, list, advise, story, ...), and
  *meta* requests where the target writes a question, an instruction or a quiz itself;
* **docs**: documentation that installed packages ship (docstrings of the Python standard
  library and of a few site-packages), wrapped in summarize / explain / rewrite / copy / extract
  requests (the copy-heavy traffic n-gram lookup is good at and a drafter must also handle);
* **code**: short functions from the same sources wrapped in explain / document / type-hint /
  test / rewrite requests, plus code requests from templates.

Nothing is downloaded. Held-out prompts (``builder/data/heldout_*``) and the bench prompts
(``benchmarks/prompts.json``) are excluded by normalized text, and prompts naming a held-out
topic are dropped too, so measured acceptance is on prompts the drafter never saw.

The set is materialized once into the data folder (``prompts.jsonl.gz``); a resumed run reads
that file, so another machine with other package versions continues the same set.
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import random
import re
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from builder.errors import BuildSpecError

logger = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.jsonl.gz"
SITE_PACKAGES = ("numpy", "torch", "transformers", "tokenizers", "safetensors", "requests", "urllib3", "yaml",
                 "jinja2", "click", "packaging", "tqdm", "fsspec", "huggingface_hub", "pydantic", "idna", "filelock")
_SEEDS = "eagle_seeds.json"


@dataclass(frozen=True)
class PromptSetConfig:
    size: int = 12000
    chat_share: float = 0.5
    docs_share: float = 0.3  # the rest: code
    max_doc_chars: int = 900
    seed: int = 0

    def __post_init__(self) -> None:
        shares_ok = 0 <= self.chat_share <= 1 and 0 <= self.docs_share <= 1 - self.chat_share
        if not (1 <= self.size <= 10_000_000 and 0 < self.max_doc_chars <= 100_000 and shares_ok):
            raise BuildSpecError("prompt set: size >= 1 and chat_share + docs_share within [0, 1]")


def _seeds() -> dict:
    return json.loads((resources.files("builder") / "data" / _SEEDS).read_text())


def normalize_prompt(text: str) -> str:
    """Lower case, runs of anything but letters and digits as one space: how prompts are compared."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


_norm = normalize_prompt
HELDOUT_SPLIT = "heldout_split.json"


def _prompt_texts(prompt: object) -> list[str]:
    """The user text of a prompt: a string, or every user turn of a message list."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [m["content"] for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return [json.dumps(prompt)]


def heldout_split_file() -> Path:
    """The held-out split (chat, code, multiturn, grounded, arithmetic): measured on, never trained or tuned on."""
    return Path(str(resources.files("builder") / "data" / HELDOUT_SPLIT))


def heldout_texts(repo_root: Path | None = None) -> set[str]:
    """Normalized held-out and bench prompts (never to be trained on)."""
    data = resources.files("builder") / "data"
    texts = [line for line in (data / "heldout_prompts.txt").read_text().splitlines() if line.strip()]
    copy = json.loads((data / "heldout_copy_prompts.json").read_text())
    texts += [p for key, value in copy.items() if isinstance(value, list) for p in value]
    if (data / HELDOUT_SPLIT).is_file():  # the held-out split: every user turn of every workload
        split = json.loads((data / HELDOUT_SPLIT).read_text())
        texts += [t for prompts in split["workloads"].values() for p in prompts for t in _prompt_texts(p)]
    root = repo_root or Path(__file__).resolve().parents[2]
    bench = root / "benchmarks" / "prompts.json"
    if bench.is_file():
        for prompts in json.loads(bench.read_text()).get("workloads", {}).values():
            texts += [t for p in prompts for t in _prompt_texts(p)]
    return {_norm(t) for t in texts}


def heldout_topics() -> set[str]:
    """Topics the held-out chat prompts are about (their last noun phrase), to keep out of training."""
    seeds = _seeds()
    held = " ".join(_norm(t) for t in heldout_texts())
    return {t for t in seeds["topics"] if f" {_norm(t)} " in f" {held} "}


def _chat(rng: random.Random, seeds: dict, topics: list[str]) -> str:
    topic = rng.choice(topics)
    if rng.random() < 0.15:
        return rng.choice(seeds["meta_templates"]).format(topic=topic)
    other = rng.choice(topics)
    return rng.choice(seeds["chat_templates"]).format(topic=topic, other=other, n=rng.choice((2, 3, 4, 5)))


def _source_files() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    purelib = Path(sysconfig.get_paths()["purelib"])
    roots += [purelib / name for name in SITE_PACKAGES if (purelib / name).is_dir()]
    files: list[Path] = []
    for root in roots:
        files += sorted(p for p in root.rglob("*.py") if "test" not in p.as_posix().lower() and "site-packages" not in
                        p.relative_to(root).as_posix())
    return files


def _snippets(files: list[Path], rng: random.Random, want: int, max_chars: int) -> Iterator[tuple[str, str, str]]:
    """``(kind, name, text)``: docstrings (kind ``doc``) and short function sources (``code``)."""
    order = list(range(len(files)))
    rng.shuffle(order)
    made = 0
    per_file = 4  # at most this many snippets from one file: variety over depth
    for i in order:
        taken = 0
        try:
            source = files[i].read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                continue
            doc = ast.get_docstring(node)
            if taken >= per_file:
                break
            if doc and 120 <= len(doc) <= max_chars:
                yield "doc", getattr(node, "name", files[i].stem), doc.strip()
                made, taken = made + 1, taken + 1
            if isinstance(node, ast.FunctionDef) and node.end_lineno and 4 <= node.end_lineno - node.lineno <= 30:
                code = ast.get_source_segment(source, node)
                if code and len(code) <= max_chars and "\t" not in code:
                    yield "code", node.name, code
                    made, taken = made + 1, taken + 1
            if made >= want:
                return


def build_prompt_set(config: PromptSetConfig) -> list[dict[str, str]]:
    """``[{"kind": chat|docs|code, "prompt": text}]``, deduplicated, free of held-out prompts and topics."""
    seeds = _seeds()
    rng = random.Random(config.seed)
    banned_topics = heldout_topics()
    held = [f" {_norm(t)} " for t in banned_topics]
    topics = [t for t in seeds["topics"] if not any(h in f" {_norm(t)} " for h in held)]
    banned = heldout_texts()
    n_chat = int(config.size * config.chat_share)
    n_docs = int(config.size * config.docs_share)
    n_code = config.size - n_chat - n_docs
    out: list[dict[str, str]] = []
    seen: set[str] = set()

    def add(kind: str, text: str) -> None:
        key = _norm(text)
        if key and key not in seen and key not in banned:
            seen.add(key)
            out.append({"kind": kind, "prompt": text})

    tries = 0
    while len(out) < n_chat and tries < n_chat * 20:
        add("chat", _chat(rng, seeds, topics))
        tries += 1
    docs, codes = [], []
    for kind, name, text in _snippets(_source_files(), rng, (3 * (n_docs + n_code)) // 2, config.max_doc_chars):
        (docs if kind == "doc" else codes).append((name, text))
    rng.shuffle(docs)
    rng.shuffle(codes)
    for name, text in docs[:n_docs]:
        add("docs", rng.choice(seeds["doc_templates"]).format(name=name, text=text))
    for name, text in codes[:max(0, n_code - n_code // 4)]:
        add("code", rng.choice(seeds["code_templates"]).format(name=name, text=text))
    while len(out) < config.size and tries < config.size * 40:
        add("code", rng.choice(seeds["code_requests"]).format(topic=rng.choice(topics), name=rng.choice(seeds["code_nouns"])))
        tries += 1
    rng.shuffle(out)
    logger.info("prompt set: %d prompts (%s); %d held-out topics excluded", len(out),
                ", ".join(f"{k} {sum(p['kind'] == k for p in out)}" for k in ("chat", "docs", "code")), len(banned_topics))
    return out


def save_prompt_set(prompts: list[dict[str, str]], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    tmp.replace(path)


def load_prompt_set(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise BuildSpecError(f"prompt set {path} not found")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompts_from_file(path: Path) -> list[dict[str, Any]]:
    """A user's prompts: one per line (``\\n`` stands for a newline), all of kind ``user``; or a
    JSON file of ``{"workloads": {name: [prompt or message list, ...]}}`` (the bench's and the
    held-out split's layout), each prompt of its workload's kind."""
    if path.suffix == ".json":
        workloads = json.loads(path.read_text()).get("workloads")
        if not isinstance(workloads, dict) or not workloads:
            raise BuildSpecError(f"{path}: a JSON prompts file needs a non-empty \"workloads\" object")
        return [{"kind": kind, "messages": p} if isinstance(p, list) else {"kind": kind, "prompt": str(p)}
                for kind, prompts in workloads.items() for p in prompts]
    lines = [line.replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise BuildSpecError(f"prompts file {path} holds no prompts")
    return [{"kind": "user", "prompt": line} for line in lines]


__all__ = ["HELDOUT_SPLIT", "PROMPTS_FILE", "heldout_split_file", "normalize_prompt", "PromptSetConfig", "build_prompt_set", "heldout_texts", "heldout_topics",
           "load_prompt_set", "prompts_from_file", "save_prompt_set"]
