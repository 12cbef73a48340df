"""User-like prompts for drafter data: what people send a chat assistant, not templates of a topic.

Two passes over the target make the set (``specbuild eagle-data --prompt-source users`` then
``--prompt-source followups --from FIRST``):

* **first pass** (:func:`build_user_prompts`): everyday requests built from independent parts
  (opener, persona, subject, frame, style suffix, casing), writing tasks (emails, stories, posts
  for someone in a tone), situations asking for advice, code in 16 languages and code questions,
  arithmetic word problems with drawn numbers, grounded questions over passages that installed
  packages ship (their README and licence text in ``*.dist-info``), and *self-instruct* requests:
  the target writes a user's message itself (its answer is training data too);
* **second pass** (:func:`followup_prompts`): from a finished first-pass corpus, the messages the
  target wrote become prompts (de-duplicated, cleaned), and answered requests become two-turn
  conversations: the first request, the target's own answer as the assistant turn, and a
  follow-up (``multiturn``), so the drafter sees the history in the context as users send it.

Nothing is downloaded. Every user turn is checked against the held-out and bench prompts
(:func:`builder.train.prompt_set.heldout_texts`) and refused when equal after normalization.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import numpy as np

from builder.errors import BuildSpecError
from builder.train.prompt_set import PROMPTS_FILE, heldout_texts, load_prompt_set, normalize_prompt

logger = logging.getLogger(__name__)

_SEEDS = "user_seeds.json"
KINDS = ("chat", "writing", "advice", "code", "arithmetic", "grounded", "self_instruct")
_DEFAULT_SHARES = {"chat": 0.26, "writing": 0.16, "advice": 0.06, "code": 0.16, "arithmetic": 0.06,
                   "grounded": 0.10, "self_instruct": 0.20}


@dataclass(frozen=True)
class UserPromptConfig:
    size: int = 12000
    seed: int = 0
    max_passage_chars: int = 1200

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 10_000_000 or not 200 <= self.max_passage_chars <= 100_000:
            raise BuildSpecError("user prompts: size in [1, 10^7] and max_passage_chars in [200, 10^5]")


def _seeds() -> dict:
    return json.loads((resources.files("builder") / "data" / _SEEDS).read_text())


def _styled(rng: random.Random, text: str) -> str:
    """Casual writing as people type it: sometimes all lower case, sometimes no final stop."""
    r = rng.random()
    if r < 0.12:
        text = text.lower()
    elif r < 0.2:
        text = text.rstrip(".!")
    return text


def _chat(rng: random.Random, s: dict) -> str:
    frame = rng.choice(s["frames"]).format(s=rng.choice(s["subjects"]))
    persona, opener = rng.choice(s["personas"]), rng.choice(s["openers"])
    text = (persona + frame) if persona else frame
    text = opener + (text[0].lower() + text[1:] if opener.endswith(" ") and opener.strip() and not persona else text)
    return _styled(rng, text[0].upper() + text[1:] + rng.choice(s["suffixes"]))


def _writing(rng: random.Random, s: dict) -> str:
    text = rng.choice(s["writing"]).format(s=rng.choice(s["subjects"]), who=rng.choice(s["who"]),
                                           tone=rng.choice(s["tones"]))
    return _styled(rng, text + rng.choice(s["suffixes"]))


def _advice(rng: random.Random, s: dict) -> str:
    return _styled(rng, rng.choice(s["openers"]) + rng.choice(s["situations"]) + rng.choice(s["suffixes"]))


def _code(rng: random.Random, s: dict) -> str:
    if rng.random() < 0.25:
        return rng.choice(s["code_other"])
    return _styled(rng, rng.choice(s["code_tasks"]).format(lang=rng.choice(s["langs"]), task=rng.choice(s["code_verbs"])))


def _arithmetic(rng: random.Random, s: dict) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(5, 95)
    price = round(rng.uniform(3, 250), 2)
    kinds: list[Callable[[], str]] = [
        lambda: f"We were {b} people at dinner and the bill was ${price}. With a {rng.choice((10, 15, 18, 20))}% tip, "
                "how much does each person pay?",
        lambda: f"What is {c}% of {a * 10}?",
        lambda: f"A shirt costs ${price} and is {c % 60 + 5}% off. What is the sale price?",
        lambda: f"If I drive {a * 5} km at {b * 10} km/h, how long does it take?",
        lambda: f"How many minutes are there in {b} hours and {c} minutes?",
        lambda: f"Convert {a} miles to kilometres.",
        lambda: f"Convert {c} degrees Fahrenheit to Celsius.",
        lambda: f"I save ${a * 5} a week. How many weeks until I have ${a * 5 * (b + 10)}?",
        lambda: f"What is {a} times {b * 7} plus {c}?",
        lambda: f"A recipe for {b} people needs {c * 10} g of flour. How much for {b + rng.randint(1, 6)} people?",
        lambda: f"My rent went from ${a * 30} to ${a * 30 + c * 3}. By what percent did it go up?",
        lambda: f"If a train leaves at 9:{c % 60:02d} and the trip takes {b * 13} minutes, when does it arrive?",
        lambda: f"Solve for x: {b}x + {c} = {b * a + c}.",
        lambda: f"What is the average of {a}, {b * 5}, {c} and {a + c}?",
    ]
    return rng.choice(kinds)() + rng.choice(("", "", " Show your work.", " Explain step by step.", " Just the answer please."))


def package_passages(max_chars: int) -> list[tuple[str, str]]:
    """``(package, paragraph block)`` from the README and licence text of installed distributions."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    out: list[tuple[str, str]] = []
    for info in sorted(purelib.glob("*.dist-info")):
        name = info.name.split("-")[0]
        texts = []
        meta = info / "METADATA"
        if meta.is_file():
            body = meta.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)
            texts.append(body[1] if len(body) == 2 else "")
        for lic in list(info.glob("LICEN[CS]E*")) + list((info / "licenses").glob("*")):
            if lic.is_file():
                texts.append(lic.read_text(encoding="utf-8", errors="replace"))
        for text in texts:
            block = ""
            for para in re.split(r"\n\s*\n", text):
                para = para.strip()
                if not para or para.startswith(("..", "<", "[!", "|", "![")) or len(para) > max_chars:
                    continue
                if len(block) + len(para) > max_chars:
                    if len(block) >= 200:
                        out.append((name, block.strip()))
                    block = ""
                block += para + "\n\n"
            if len(block) >= 200:
                out.append((name, block.strip()))
    return out


def build_user_prompts(config: UserPromptConfig) -> list[dict[str, Any]]:
    """``[{"kind": ..., "prompt": text}]``: the first pass's prompts, de-duplicated, held-out free."""
    s = _seeds()
    rng = random.Random(config.seed)
    passages = package_passages(config.max_passage_chars)
    rng.shuffle(passages)
    banned = heldout_texts()
    makers: dict[str, Callable[[], str]] = {
        "chat": lambda: _chat(rng, s), "writing": lambda: _writing(rng, s), "advice": lambda: _advice(rng, s),
        "code": lambda: _code(rng, s), "arithmetic": lambda: _arithmetic(rng, s),
        "self_instruct": lambda: rng.choice(s["self_instruct"]).format(
            p=rng.choice(s["self_instruct_people"]), s=rng.choice(s["subjects"])),
    }
    out: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(kind: str, text: str) -> bool:
        key = normalize_prompt(text)
        if not key or key in seen or key in banned:
            return False
        seen.add(key)
        out.append({"kind": kind, "prompt": text})
        return True

    for kind in KINDS:
        want = int(round(config.size * _DEFAULT_SHARES[kind]))
        made = tries = 0
        while made < want and tries < want * 30:
            tries += 1
            if kind == "grounded":
                if not passages:
                    break
                name, text = passages[tries % len(passages)]
                text = f"{rng.choice(s['grounded_openers'])}{text}\n\n{rng.choice(s['grounded_questions'])}"
            else:
                text = makers[kind]()
            made += add(kind, text)
    rng.shuffle(out)
    logger.info("user prompts: %d (%s)", len(out),
                ", ".join(f"{k} {sum(p['kind'] == k for p in out)}" for k in KINDS))
    return out


_LEAD = re.compile(r"^\s*(?:(?:message|question|request|instruction|task|user|prompt)\s*\d*\s*[:\-]\s*)+", re.I)


_QUOTED = re.compile(r'["\u201c]([^"\u201c\u201d]{15,500})["\u201d]')
_ASSISTANT_VOICE = ("sure", "here is", "here's", "i'm sorry", "as an ai", "i'm here to", "i'm ready to", "what a ",
                    "certainly", "of course", "great question", "i'd be happy", "i would be happy")


def clean_written_request(text: str) -> str | None:
    """A user message the target wrote for the self-instruct pass, or None when it is not one:
    a quoted message when it wrote one (``A student might ask, "..."``), else its first paragraph,
    refused when it speaks as the assistant."""
    quoted = _QUOTED.search(text)
    text = quoted.group(1) if quoted else text
    text = _LEAD.sub("", text.strip()).strip().strip('"\u201c\u201d').strip()
    text = text.split("\n\n")[0].strip()  # the message, not what the target added after it
    if not 15 <= len(text) <= 500 or text.lower().startswith(_ASSISTANT_VOICE):
        return None
    return text


def _responses(corpus_dir: Path, tokenizer: Any) -> list[tuple[int, str, bool]]:
    """``(prompt index, response text, ended)`` for every sequence of a corpus folder."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    out = []
    for file in sorted(corpus_dir.glob("shard-*.npz")):
        with np.load(file) as z:
            tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
            for i, (plen, index) in enumerate(zip(z["prompt_lengths"], z["prompt_index"])):
                response = tokens[offsets[i] + plen:offsets[i + 1]].tolist()
                ended = bool(response) and response[-1] in eos
                out.append((int(index), tokenizer.decode(response, skip_special_tokens=True).strip(), ended))
    return out


def followup_prompts(first_dir: str | Path, tokenizer: Any, seed: int = 0, multiturn_share: float = 0.6
                     ) -> list[dict[str, Any]]:
    """The second pass: written requests as prompts and two-turn conversations from ``first_dir``."""
    first = Path(first_dir)
    prompts = load_prompt_set(first / PROMPTS_FILE)
    s, rng, banned = _seeds(), random.Random(seed), heldout_texts()
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, response, ended in _responses(first, tokenizer):
        entry = prompts[index]
        if entry.get("kind") == "self_instruct":
            request = clean_written_request(response)
            key = normalize_prompt(request or "")
            if request and key not in seen and key not in banned:
                seen.add(key)
                out.append({"kind": "self_written", "prompt": request})
        elif "prompt" in entry and response and rng.random() < multiturn_share:
            follow = rng.choice(s["followups"])
            out.append({"kind": "multiturn", "messages": [
                {"role": "user", "content": entry["prompt"]}, {"role": "assistant", "content": response},
                {"role": "user", "content": follow}]})
    rng.shuffle(out)
    logger.info("follow-up prompts: %d (%d written by the target, %d conversations)", len(out),
                sum(p["kind"] == "self_written" for p in out), sum(p["kind"] == "multiturn" for p in out))
    if not out:
        raise BuildSpecError(f"{first} holds no answered prompts to follow up on")
    return out


__all__ = ["KINDS", "UserPromptConfig", "build_user_prompts", "clean_written_request", "followup_prompts",
           "package_passages"]
