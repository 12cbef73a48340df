"""A drafter's token corpus from the target itself, generated on the batched slot engine.

Every row of a batched decode pass is a training sequence: ``rows`` slots decode at once and a
finished row's slot takes the next prompt in the same pass (its prefill rides along with the
other rows' decode tokens), so the passes stay full. Each prompt's response is greedy or
sampled (``sampled_share`` of the prompts, at ``temperature``), decided per prompt from the seed
so a rerun makes the same choice; a sampled response draws from its own seeded generator.

What is kept is small: per shard (``shard_size`` prompts) one compressed ``.npz`` with the
token sequences (prompt ids then response ids, ``uint16`` where the vocabulary fits), their
prompt lengths, temperatures and prompt indices. The features a drafter learns from are
recomputed from these tokens by batched prefill (:mod:`builder.train.eagle_features`), so they
need not survive a machine change; or, with ``features=eagle3``, taken from the generation
passes themselves (no second forward): every row of a pass asks the engine for the capture
layers' outputs (``BatchRow.capture``) and its logits at each new position, a prompt's from its
prefill row, a response token's from the decode row that feeds it (a finished row rides one
more pass to feed its last token). They go to ``feat-NNNNN.pt`` beside ``shard-NNNNN.npz`` in
the layout ``eagle-features`` writes (float16; large: never committed, ``.gitignore`` keeps
them out), written before the token shard, so a shard present has its features unless it was
made without capture (the trainer then prefills it).

Resumable: a shard is written to a temporary name and renamed (complete or absent); a restart
skips the shards present. The prompt set and settings live in the folder (``prompts.jsonl.gz``,
``meta.json``); a folder made with other settings is refused. ``workers`` processes share the
shards (shard ``i`` goes to worker ``i % workers``), each on one thread; progress is logged
(positions/s and ETA) every ``log_every_s``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from builder.errors import BuildSpecError
from builder.train.eagle_features import capture_layers_for, feature_path, write_feature_file
from builder.train.prompt_set import (PROMPTS_FILE, PromptSetConfig, build_prompt_set, load_prompt_set,
                                      prompts_from_file, save_prompt_set)

logger = logging.getLogger(__name__)

META = "meta.json"


class PromptSource(str, Enum):
    TEMPLATES = "templates"  # seed topics x request templates and package docstrings (prompt_set.py)
    USERS = "users"  # user-like requests, self-instruct included (user_prompts.py, first pass)
    FOLLOWUPS = "followups"  # from a finished users corpus: its written requests and conversations
    CONVERSATIONS = "conversations"  # users' first requests from a ShareGPT-format file (chat_datasets.py)


class CorpusFeatures(str, Enum):
    NONE = "none"  # tokens only (features later by prefill)
    EAGLE3 = "eagle3"  # the EAGLE-3 capture layers' outputs and the greedy token, from the generation passes


@dataclass(frozen=True)
class CorpusConfig:
    target: str
    out_dir: str
    prompts_file: str = ""  # empty: the built prompt set (prompt_source)
    prompt_set: PromptSetConfig = field(default_factory=PromptSetConfig)
    prompt_source: PromptSource = PromptSource.TEMPLATES
    followup_from: str = ""  # followups: the first pass's corpus folder; conversations: the conversation file
    temperatures: tuple[float, ...] = ()  # sampled prompts draw one of these per prompt; empty: (temperature,)
    max_new_tokens: int = 128
    rows: int = 16  # sequences decoded together in one pass
    shard_size: int = 64
    sampled_share: float = 0.5
    temperature: float = 0.8
    max_prompt_tokens: int = 640
    chat: bool = True
    seed: int = 0
    workers: int = 1
    log_every_s: float = 30.0
    max_shards: int | None = None  # stop after this many shards (None: all)
    time_limit_s: float | None = None  # stop (between shards) after this long
    features: CorpusFeatures = CorpusFeatures.NONE
    capture_layers: tuple[int, ...] | None = None  # features=eagle3; None: the default low/mid/high set

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "prompt_source", PromptSource(self.prompt_source))
        except ValueError:
            raise BuildSpecError(f"prompt_source must be one of {', '.join(s.value for s in PromptSource)}, "
                                 f"got {self.prompt_source!r}") from None
        if (self.prompt_source in (PromptSource.FOLLOWUPS, PromptSource.CONVERSATIONS)) != bool(self.followup_from):
            raise BuildSpecError("prompt_source followups / conversations need followup_from (the first pass's "
                                 "folder / the conversation file), and only they")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if any(not 0 < t < float("inf") for t in self.temperatures):
            raise BuildSpecError("temperatures must be finite and > 0")
        try:
            object.__setattr__(self, "features", CorpusFeatures(self.features))
        except ValueError:
            raise BuildSpecError(f"features must be one of {', '.join(f.value for f in CorpusFeatures)}, "
                                 f"got {self.features!r}") from None
        if self.capture_layers is not None and (self.features is CorpusFeatures.NONE or not self.capture_layers):
            raise BuildSpecError("capture_layers needs features=eagle3 and at least one layer")
        for name in ("max_new_tokens", "rows", "shard_size", "workers", "max_prompt_tokens"):
            if int(getattr(self, name)) < 1:
                raise BuildSpecError(f"{name} must be >= 1")
        if not 0 <= self.sampled_share <= 1 or not 0 < self.temperature < float("inf"):
            raise BuildSpecError("sampled_share must lie in [0, 1] and temperature be finite and > 0")
        if self.workers > 64 or self.rows > 4096:
            raise BuildSpecError("workers must be <= 64 and rows <= 4096")
        if (self.max_shards is not None and self.max_shards < 1) or (self.time_limit_s is not None
                                                                     and not self.time_limit_s > 0):
            raise BuildSpecError("max_shards must be >= 1 and time_limit_s > 0 when given")

    def identity(self) -> dict[str, Any]:
        """Settings that make two runs' shards parts of one corpus (meta.json)."""
        keep = ("max_new_tokens", "shard_size", "sampled_share", "temperature", "max_prompt_tokens", "chat", "seed")
        out = {k: getattr(self, k) for k in keep}
        out["target"] = Path(self.target).name
        if self.temperatures:  # absent from folders made before it existed, which stay valid
            out["temperatures"] = list(self.temperatures)
        if self.prompt_source is not PromptSource.TEMPLATES and not self.prompts_file:
            out["prompt_source"] = self.prompt_source.value
        return out


@dataclass
class CorpusStats:
    shards_total: int
    shards_done: int
    positions: int  # response tokens generated in this run (each a training position)
    seconds: float
    cpu_seconds: float = 0.0  # this process's CPU time (one worker): the rate on an unshared core

    @property
    def positions_per_s(self) -> float:
        return self.positions / self.seconds if self.seconds > 0 else 0.0


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.npz"


def prepare_corpus_dir(config: CorpusConfig) -> list[dict[str, str]]:
    """Create or check the folder; the prompt set it holds (made once, then read back)."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta, prompts_path = out / META, out / PROMPTS_FILE
    identity = config.identity()
    if meta.exists():
        previous = json.loads(meta.read_text())
        if previous != identity:
            changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
            raise BuildSpecError(f"{out} holds a corpus made with other settings ({', '.join(changed)}); "
                                 "use another folder or the same settings")
        return load_prompt_set(prompts_path)
    prompts = _build_prompts(config)
    save_prompt_set(prompts, prompts_path)
    meta.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
    return prompts


def _build_prompts(config: CorpusConfig) -> list[dict[str, Any]]:
    if config.prompts_file:
        return prompts_from_file(Path(config.prompts_file))
    if config.prompt_source is PromptSource.TEMPLATES:
        return build_prompt_set(config.prompt_set)
    from builder.train.user_prompts import UserPromptConfig, build_user_prompts, followup_prompts

    if config.prompt_source is PromptSource.USERS:
        return build_user_prompts(UserPromptConfig(size=config.prompt_set.size, seed=config.seed))
    if config.prompt_source is PromptSource.CONVERSATIONS:
        from builder.train.chat_datasets import conversation_prompts

        return conversation_prompts(config.followup_from, config.prompt_set.size, seed=config.seed)
    from triton_backend.engines.torch.model_loading import load_tokenizer

    return followup_prompts(config.followup_from, load_tokenizer(config.target), seed=config.seed)


def _is_sampled(config: CorpusConfig, index: int) -> bool:
    return random.Random(config.seed * 1_000_003 + index).random() < config.sampled_share


def _temperature(config: CorpusConfig, index: int) -> float:
    """A sampled prompt's temperature: one of ``temperatures`` drawn per prompt (seeded), else ``temperature``."""
    if not config.temperatures:
        return config.temperature
    return random.Random(config.seed * 2_000_003 + index).choice(config.temperatures)


@dataclass
class _Seq:
    index: int  # prompt index in the set
    tokens: list[int]
    prompt_length: int
    temperature: float
    generator: torch.Generator | None
    slot: int = -1
    cached: int = 0  # positions already in the slot
    closing: bool = False  # finished; its last token still to feed (feature capture)
    features: list[torch.Tensor] = field(default_factory=list)  # [new, len(layers) * H] float16 per pass
    top1: list[torch.Tensor] = field(default_factory=list)  # [new] int32 per pass


class _Shard:
    def __init__(self, index: int, size: int) -> None:
        self.index, self.size, self.done = index, size, []  # type: ignore[var-annotated]

    def write(self, out: Path, vocab_size: int, layers: tuple[int, ...]) -> None:
        seqs = sorted(self.done, key=lambda s: s.index)
        if layers:  # features first: a token shard present has its feature file
            write_feature_file(feature_path(out, shard_path(out, self.index)), layers, [s.prompt_length for s in seqs],
                               [torch.tensor(s.tokens, dtype=torch.int64) for s in seqs],
                               [torch.cat(s.features) for s in seqs], [torch.cat(s.top1) for s in seqs])
        dtype = np.uint16 if vocab_size <= 65535 else np.int32
        flat = np.concatenate([np.asarray(s.tokens, dtype=dtype) for s in seqs])
        offsets = np.cumsum([0] + [len(s.tokens) for s in seqs]).astype(np.int64)
        tmp = out / f".shard-{self.index:05d}.tmp.npz"
        np.savez_compressed(tmp, tokens=flat, offsets=offsets,
                            prompt_lengths=np.asarray([s.prompt_length for s in seqs], dtype=np.int32),
                            temperatures=np.asarray([s.temperature for s in seqs], dtype=np.float32),
                            prompt_index=np.asarray([s.index for s in seqs], dtype=np.int64))
        os.replace(tmp, shard_path(out, self.index))  # a shard is complete or absent


def _encode(tokenizer: Any, entry: dict[str, Any], chat: bool) -> list[int]:
    """A prompt entry's ids: ``prompt`` (one user turn) or ``messages`` (a conversation ending in a
    user turn), through the chat template when ``chat``."""
    messages = entry.get("messages") or [{"role": "user", "content": entry["prompt"]}]
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _sample(logits: torch.Tensor, seq: _Seq) -> int:  # logits [vocab]
    if seq.generator is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / seq.temperature, -1)
    return int(torch.multinomial(probs, 1, generator=seq.generator))


class _Decoder:
    """Continuous batching over the slot engine: ``rows`` sequences per pass, prefill mixed in."""

    def __init__(self, engine: Any, config: CorpusConfig, layers: tuple[int, ...] = ()) -> None:
        self.engine, self.config, self.layers = engine, config, layers  # layers: () = no capture
        self.free = [engine.allocate() for _ in range(config.rows)]
        self.active: list[_Seq] = []
        self.positions = 0
        self.finished = 0  # sequences completed

    def add(self, seq: _Seq) -> None:
        seq.slot = self.free.pop()
        self.active.append(seq)

    def step(self) -> list[_Seq]:
        """One batched pass; returns the sequences that finished in it (their slots freed)."""
        from triton_backend.engines.batch import BatchRow

        rows = [BatchRow(s.slot, s.cached, s.tokens[s.cached:], capture=self.layers,
                         num_logits=len(s.tokens) - s.cached if self.layers else 1) for s in self.active]
        outputs = self.engine.forward(rows)
        finished, keep = [], []
        eos = self.engine.eos_token_ids
        for seq, out in zip(self.active, outputs):
            seq.cached = len(seq.tokens)
            if self.layers:
                seq.features.append(out.features.to(torch.float16))
                seq.top1.append(out.logits.argmax(-1).to(torch.int32))
            if seq.closing:  # its last token fed: done
                finished.append(seq)
                self.free.append(seq.slot)
                continue
            token = _sample(out.logits[-1], seq)
            seq.tokens.append(token)
            self.positions += 1
            new = len(seq.tokens) - seq.prompt_length
            if token in eos or new >= self.config.max_new_tokens or len(seq.tokens) >= self.engine.max_context:
                if self.layers:
                    seq.closing = True
                    keep.append(seq)
                else:
                    finished.append(seq)
                    self.free.append(seq.slot)
            else:
                keep.append(seq)
        self.active = keep
        self.finished += len(finished)
        return finished


def _work(config: CorpusConfig, prompts: list[dict[str, str]], todo: list[int], engine: Any, tokenizer: Any,
          deadline: float | None) -> CorpusStats:
    out = Path(config.out_dir)
    start = last_log = time.monotonic()
    cpu_start = time.process_time()
    layers = (capture_layers_for(engine.model, config.capture_layers) if config.features is CorpusFeatures.EAGLE3
              else ())
    if layers:
        logger.info("capturing the outputs of layers %s in the generation passes", layers)
    decoder = _Decoder(engine, config, layers)
    shards: dict[int, _Shard] = {}
    queue = _prompt_queue(config, prompts, todo, tokenizer, shards, deadline)
    done = 0
    while True:
        while decoder.free:
            nxt = next(queue, None)
            if nxt is None:
                break
            decoder.add(nxt)
        if not decoder.active:
            break
        for seq in decoder.step():
            shard = shards[seq.index // config.shard_size]
            shard.done.append(seq)
            if len(shard.done) == shard.size:
                shard.write(out, engine.vocab_size, layers)
                del shards[shard.index]
                done += 1
        now = time.monotonic()
        if now - last_log >= config.log_every_s:
            _log_progress(decoder, now - start, done, len(todo), config.shard_size)
            last_log = now
    elapsed = time.monotonic() - start
    _log_progress(decoder, elapsed, done, len(todo), config.shard_size)
    return CorpusStats(shards_total=len(todo), shards_done=done, positions=decoder.positions, seconds=elapsed,
                       cpu_seconds=time.process_time() - cpu_start)


def _log_progress(decoder: _Decoder, seconds: float, done: int, total: int, shard_size: int) -> None:
    """Shards, positions, positions/s and an ETA from the sequences finished so far."""
    rate = decoder.positions / max(seconds, 1e-9)
    left = max(0, total * shard_size - decoder.finished)  # sequences still to finish (upper bound)
    eta = left * seconds / decoder.finished if decoder.finished else float("nan")
    logger.info("corpus: %d/%d shards, %d sequences, %d positions, %.1f positions/s, ETA %s", done, total,
                decoder.finished, decoder.positions, rate, "?" if eta != eta else f"{eta / 60:.0f} min")


def _prompt_queue(config: CorpusConfig, prompts: list[dict[str, str]], todo: list[int], tokenizer: Any,
                  shards: dict[int, _Shard], deadline: float | None) -> Iterator[_Seq]:
    """The prompts of the shards to do, in order; past ``deadline`` no new shard is started
    (the ones under way finish, so no work is lost)."""
    for index in todo:
        if deadline is not None and time.monotonic() > deadline:
            logger.info("time limit reached: no new shard started")
            return
        lo, hi = index * config.shard_size, min(len(prompts), (index + 1) * config.shard_size)
        shards[index] = _Shard(index, hi - lo)
        for i in range(lo, hi):
            ids = _clip(_encode(tokenizer, prompts[i], config.chat), config.max_prompt_tokens)
            sampled = _is_sampled(config, i)
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + i) if sampled else None
            yield _Seq(i, ids, len(ids), _temperature(config, i) if sampled else 0.0, gen)


def _clip(ids: list[int], limit: int, tail: int = 8) -> list[int]:
    """At most ``limit`` ids: the head of the prompt and its last ``tail`` (the chat template's
    assistant turn opener), the middle of an over-long prompt dropped."""
    if len(ids) <= limit:
        return ids
    tail = min(tail, limit // 2)
    return ids[:limit - tail] + ids[-tail:]


def todo_shards(config: CorpusConfig, num_prompts: int) -> list[int]:
    total = -(-num_prompts // config.shard_size)
    if config.max_shards is not None:
        total = min(total, config.max_shards)
    return [i for i in range(total) if not shard_path(Path(config.out_dir), i).exists()]


def run_worker(config: CorpusConfig, worker: int = 0) -> CorpusStats:
    """Generate this worker's missing shards (``i % workers == worker``) on one thread."""
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.engines.torch.model_loading import load_engine

    prompts = load_prompt_set(Path(config.out_dir) / PROMPTS_FILE)
    todo = [i for i in todo_shards(config, len(prompts)) if i % config.workers == worker]
    logger.info("worker %d: %d shards to generate", worker, len(todo))
    if not todo:
        return CorpusStats(0, 0, 0, 0.0)
    context = config.max_prompt_tokens + config.max_new_tokens + 1
    # one thread per worker, its row kernel's too: `workers` processes share the machine's cores
    runtime = RuntimeConfig(max_batch_size=config.rows, max_seq_len=context, num_threads=1, kernel_threads=1)
    engine, tokenizer = load_engine(config.target, runtime)
    if not isinstance(engine, LlamaEngine):
        raise BuildSpecError(f"{config.target} does not run on the slot engine; corpus generation needs it")
    deadline = time.monotonic() + config.time_limit_s if config.time_limit_s else None
    return _work(config, prompts, todo, engine, tokenizer, deadline)


def _worker_main(config: CorpusConfig, worker: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s w{worker} %(message)s")
    run_worker(config, worker)


def generate_corpus(config: CorpusConfig) -> CorpusStats:
    """Prepare the folder, then run ``config.workers`` processes (one: in this process)."""
    from triton_backend.engines.torch.model_loading import resolve_model_path

    resolve_model_path(config.target)  # a missing target fails here, before the prompt set is built
    prompts = prepare_corpus_dir(config)
    todo = todo_shards(config, len(prompts))
    logger.info("%d prompts, %d shards to generate in %s", len(prompts), len(todo), config.out_dir)
    if config.workers == 1 or not todo:
        return run_worker(config, 0)
    import multiprocessing as mp

    start, before = time.monotonic(), corpus_positions(config.out_dir)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(config, w)) for w in range(config.workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [w for w, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise BuildSpecError(f"corpus worker(s) {failed} failed; rerun to resume")
    left = todo_shards(config, len(prompts))
    return CorpusStats(len(todo), len(todo) - len(left), corpus_positions(config.out_dir) - before,
                       time.monotonic() - start)


def iter_corpus(data_dir: str | Path) -> Iterator[tuple[np.ndarray, int, float]]:
    """``(tokens, prompt_length, temperature)`` for every sequence of every shard, in order."""
    files = sorted(Path(data_dir).glob("shard-*.npz"))
    if not files:
        raise BuildSpecError(f"{data_dir} holds no corpus shards; run `specbuild eagle-data` first")
    for file in files:
        with np.load(file) as z:
            tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
            for i, (plen, temp) in enumerate(zip(z["prompt_lengths"], z["temperatures"])):
                yield tokens[offsets[i]:offsets[i + 1]], int(plen), float(temp)


def corpus_positions(data_dir: str | Path) -> int:
    """Response tokens (generated positions) in the shards on disk."""
    total = 0
    for file in sorted(Path(data_dir).glob("shard-*.npz")):
        with np.load(file) as z:
            total += int(np.diff(z["offsets"]).sum() - z["prompt_lengths"].sum())
    return total


def corpus_summary(data_dir: str | Path) -> dict[str, Any]:
    files = sorted(Path(data_dir).glob("shard-*.npz"))
    return {"shards": len(files), "generated_positions": corpus_positions(data_dir) if files else 0,
            "meta": json.loads((Path(data_dir) / META).read_text()) if (Path(data_dir) / META).is_file() else None}


HELDOUT_FOLDERS = ("held",)  # corpus folders of held-out prompts: measured on, never trained on


def corpus_tree_summary(root: str | Path) -> dict[str, Any]:
    """Every corpus folder under ``root`` (``artifacts/eagle-corpus``): shards, generated positions,
    shards of its prompt set in all; and the training positions in all (held-out folders apart)."""
    folders: dict[str, Any] = {}
    for meta in sorted(Path(root).glob(f"*/{META}")):
        folder = meta.parent
        entry = {k: v for k, v in corpus_summary(folder).items() if k != "meta"}
        prompts = folder / PROMPTS_FILE
        if prompts.is_file():
            shard_size = int(json.loads(meta.read_text()).get("shard_size", 64))
            entry["shards_total"] = -(-len(load_prompt_set(prompts)) // shard_size)
        else:  # made elsewhere with its prompts named in meta.json (gpu/): complete as it is
            entry["shards_total"] = entry["shards"]
        folders[folder.name] = entry
    training = sum(e["generated_positions"] for name, e in folders.items() if name not in HELDOUT_FOLDERS)
    return {"folders": folders, "training_positions": training}


__all__ = ["CorpusConfig", "corpus_tree_summary", "CorpusFeatures", "PromptSource", "CorpusStats", "corpus_positions", "corpus_summary", "generate_corpus", "iter_corpus",
           "prepare_corpus_dir", "run_worker", "shard_path", "todo_shards"]
