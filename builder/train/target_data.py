"""Training data from the target itself: its own responses to prompts, with what a draft or
Medusa heads learn from.

For every prompt (chat template applied), the target generates a response (greedy by default)
in left-padded batches with one KV cache. Per sequence position ``j`` the shard keeps:

* ``topk_ids`` / ``topk_logits`` ``[n - 1, K]``: the target's K largest logits predicting
  token ``j + 1`` (knowledge distillation for a draft);
* ``input_ids`` ``[n]`` (prompt then response) and ``prompt_length``;
* ``hidden`` ``[n - 1, H]`` (optional): the target's last hidden state at ``j`` (after the
  final norm), what Medusa heads read.

Data is written as shards of ``shard_size`` prompts (``shard-00000.pt``, ...) next to a
``meta.json`` describing how it was made. A shard that exists is skipped, so an interrupted
run resumes where it stopped; a folder made with other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import torch

from builder.errors import BuildSpecError

logger = logging.getLogger(__name__)

META = "meta.json"


def default_prompts_file(name: str = "distill_prompts.txt") -> Path:
    return Path(str(resources.files("builder") / "data" / name))


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """One prompt per line (blank lines skipped); ``\\n`` inside a line stands for a newline."""
    file = Path(path)
    if not file.is_file():
        raise BuildSpecError(f"prompts file {file} not found")
    prompts = [line.replace("\\n", "\n") for line in file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise BuildSpecError(f"prompts file {file} holds no prompts")
    return prompts[:limit] if limit else prompts


@dataclass(frozen=True)
class TargetDataConfig:
    target: str
    out_dir: str
    prompts_file: str = ""  # empty: the packaged training prompts
    max_prompts: int | None = None
    max_new_tokens: int = 96
    batch_size: int = 32
    shard_size: int = 64
    top_k: int = 32
    temperature: float = 0.0  # 0: the target's greedy responses
    save_hidden: bool = True
    chat: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "shard_size", "top_k"):
            if int(getattr(self, name)) < 1:
                raise BuildSpecError(f"{name} must be >= 1")
        if self.temperature < 0:
            raise BuildSpecError("temperature must be >= 0")

    def prompts(self) -> list[str]:
        return load_prompts(self.prompts_file or default_prompts_file(), self.max_prompts)

    def identity(self, prompts: list[str]) -> dict[str, Any]:
        """What makes two runs' shards interchangeable (recorded in meta.json)."""
        fields = asdict(self)
        for key in ("out_dir", "batch_size", "max_prompts", "prompts_file", "save_hidden"):
            fields.pop(key)
        fields["prompts_sha256"] = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
        return fields


def format_prompts(tokenizer: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat and getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
    else:
        texts = prompts
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


class _Recorder:
    """Per-row outputs of one batch as it is generated."""

    def __init__(self, prompts: list[list[int]], top_k: int, save_hidden: bool) -> None:
        self.tokens = [list(p) for p in prompts]
        self.prompt_lengths = [len(p) for p in prompts]
        self.topk_ids: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.topk_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.hidden: list[list[torch.Tensor]] | None = [[] for _ in prompts] if save_hidden else None
        self.top_k = top_k

    def add(self, row: int, hidden: torch.Tensor, logits: torch.Tensor) -> None:  # [n, H], [n, V]
        values, ids = logits.float().topk(self.top_k, dim=-1)
        self.topk_ids[row].append(ids.to(torch.int32))
        self.topk_logits[row].append(values.to(torch.float16))
        if self.hidden is not None:
            self.hidden[row].append(hidden.to(torch.float16))

    def records(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for row, tokens in enumerate(self.tokens):
            n = len(tokens) - 1  # positions with a following token
            rec = {"input_ids": torch.tensor(tokens, dtype=torch.int64), "prompt_length": torch.tensor(self.prompt_lengths[row]),
                   "topk_ids": torch.cat(self.topk_ids[row])[:n], "topk_logits": torch.cat(self.topk_logits[row])[:n]}
            if self.hidden is not None:
                rec["hidden"] = torch.cat(self.hidden[row])[:n]
            out.append(rec)
        return out


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], config: TargetDataConfig, eos: set[int],
                   generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """The target's responses to ``prompts`` (one left-padded batch) and what it predicted at each position."""
    from transformers import DynamicCache

    rec = _Recorder(prompts, config.top_k, config.save_hidden)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).last_hidden_state
    head = model.get_output_embeddings()
    last_logits = []
    for row, p in enumerate(prompts):
        h = hidden[row, width - len(p):]
        logits = head(h)
        rec.add(row, h, logits)
        last_logits.append(logits[-1])
    nxt = _next_tokens(torch.stack(last_logits), config.temperature, generator)
    alive = list(range(len(prompts)))  # batch slot -> row
    last_pos = positions[:, -1]
    for _ in range(config.max_new_tokens):
        for slot, row in enumerate(alive):
            rec.tokens[row].append(int(nxt[slot]))
        keep = [s for s, row in enumerate(alive) if int(nxt[s]) not in eos]
        if not keep or _ == config.max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep)
            cache.batch_select_indices(index)
            mask, nxt, last_pos = mask[index], nxt[index], last_pos[index]
            alive = [alive[s] for s in keep]
        mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype)], 1)
        last_pos = last_pos + 1
        h = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                        past_key_values=cache, use_cache=True).last_hidden_state[:, 0]
        logits = head(h)
        for slot, row in enumerate(alive):
            rec.add(row, h[slot:slot + 1], logits[slot:slot + 1])
        nxt = _next_tokens(logits, config.temperature, generator)
    return rec.records()


def _check_meta(out: Path, identity: dict[str, Any], save_hidden: bool) -> None:
    """Refuse to mix shards made with other settings; remember whether hidden states are kept."""
    meta = out / META
    if meta.exists():
        previous = json.loads(meta.read_text())
        had_hidden = previous.pop("save_hidden", False)
        if save_hidden and not had_hidden:
            raise BuildSpecError(f"{out} was made without hidden states (Medusa training needs them); use another folder")
        if previous != identity:
            changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
            raise BuildSpecError(f"{out} holds data made with other settings ({', '.join(changed)}); "
                                 "use another folder or delete it")
    else:
        out.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({**identity, "save_hidden": save_hidden}, indent=2, sort_keys=True) + "\n")


def generate_target_data(config: TargetDataConfig, *, progress: bool = True) -> Path:
    """Write (or complete) the shards in ``config.out_dir``; returns that folder."""
    from tqdm.auto import tqdm

    from triton_backend.engines.torch.model_loading import eos_ids, load_model, load_tokenizer

    prompts = config.prompts()
    out = Path(config.out_dir)
    _check_meta(out, config.identity(prompts), config.save_hidden)
    shards = [prompts[i:i + config.shard_size] for i in range(0, len(prompts), config.shard_size)]
    todo = [i for i in range(len(shards)) if not (out / f"shard-{i:05d}.pt").exists()]
    logger.info("%d prompts in %d shards; %d to generate", len(prompts), len(shards), len(todo))
    if not todo:
        return out
    tokenizer = load_tokenizer(config.target)
    model = load_model(config.target).eval()
    eos = set(eos_ids(model, tokenizer))
    with tqdm(total=sum(len(shards[i]) for i in todo), desc="target data", unit="prompt", disable=not progress) as bar:
        for index in todo:
            generator = torch.Generator().manual_seed(config.seed * 100_003 + index)
            encoded = format_prompts(tokenizer, shards[index], config.chat)
            records = []
            for start in range(0, len(encoded), config.batch_size):
                batch = encoded[start:start + config.batch_size]
                records += generate_batch(model, batch, config, eos, generator)
                bar.update(len(batch))
            tmp = out / f"shard-{index:05d}.pt.tmp"
            torch.save(records, tmp)
            tmp.rename(out / f"shard-{index:05d}.pt")  # a shard is complete or absent
    return out


def iter_records(data_dir: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    folder = Path(data_dir)
    files = sorted(folder.glob("shard-*.pt"))
    if not files:
        raise BuildSpecError(f"{folder} holds no data shards; run the data generation first")
    for file in files:
        yield from torch.load(file, weights_only=True)


def data_meta(data_dir: str | Path) -> dict[str, Any]:
    meta = Path(data_dir) / META
    if not meta.is_file():
        raise BuildSpecError(f"{data_dir} has no {META}: not a target-data folder")
    return json.loads(meta.read_text())
