#!/usr/bin/env python3
"""Ours against llama.cpp on the CPU, the reference GGUF, side by side: every row in its own process.

Rows: our slot engine with a float32 / int8 / int4 target (int8 / int4 from the GGUF file's own
blocks: ``engines/torch/gguf_blocks.py``) x plain, n-gram lookup, EAGLE-3 dynamic tree (the committed
drafter ``artifacts/smollm2-135m-eagle3``) and auto; and llama.cpp (llama-cpp-python, built from
source in a separate interpreter: ``--llamacpp-python``, docs/cpu-peers.md) on the same Q4_1 GGUF,
plain and with its prompt-lookup drafter (``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``).
Prompts: the held-out split's chat and code prompts (``builder/data/heldout_split.json``, never
trained or tuned on), chat-templated and tokenized once here, so every row reads the same token ids.
Greedy, a fixed output length (EOS ignored), the same threads for every row. Each row runs in a
fresh subprocess (engines sharing a process share cores with each other's spinning threads); the
order of the rows is shuffled every repeat, so drift hits all alike. Every speculative row of ours
is checked token for token against the plain row of its precision.

Measured per request: tokens/s in total (prompt to last token) and after prefill (from the first
token on). Ratios are of total tokens/s over all prompts (sum of tokens over sum of seconds).
Writes benchmarks/results/cpu-peer-LABEL.{json,md} and the headline keys
int4_plain_x_llamacpp_plain, int4_auto_x_int4_plain, int8_auto_x_int8_plain and
cpu_best_x_llamacpp_best (each where its rows ran; a label other than ``cpu`` prefixes them).

    .venv/bin/python scripts/cpu_peer_bench.py --llamacpp-python /path/to/venv/bin/python
    .venv/bin/python scripts/cpu_peer_bench.py --prompts-per-workload 4 --max-tokens 64 --repeats 1 --threads 1

Each row runs ``scripts/cpu_peer_row.py`` in a subprocess (the llama.cpp rows under the llama.cpp
interpreter, which has no torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger("cpu_peer_bench")

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("float32", "int8", "int4")
OUR_METHODS = ("plain", "ngram", "eagle_tree", "auto")
LLAMACPP_METHODS = ("plain", "prompt_lookup")
WORKLOADS = ("chat", "code")
HEADLINE_PAIRS = (("int4_auto_x_int4_plain", "int4 auto", "int4 plain"),
                  ("int8_auto_x_int8_plain", "int8 auto", "int8 plain"),
                  ("int4_plain_x_llamacpp_plain", "int4 plain", "llama.cpp plain"))


class PeerBenchError(ValueError):
    """A bad setting of the bench, or a row that failed."""


@dataclass(frozen=True)
class PeerBenchConfig:
    target: str = "smollm2-135m-instruct"
    eagle: str = "artifacts/smollm2-135m-eagle3"
    precisions: tuple[str, ...] = PRECISIONS
    methods: tuple[str, ...] = OUR_METHODS  # our rows per precision (plain always runs: the others are checked against it)
    workloads: tuple[str, ...] = WORKLOADS
    prompts_per_workload: int = 4
    max_tokens: int = 64
    repeats: int = 1
    threads: int = 1
    ngram_k: int = 4
    eagle_k: int = 3
    eagle_tree_nodes: int = 11
    auto_k: int = 4
    lookup_tokens: int = 4  # llama.cpp's prompt lookup: tokens drafted per round
    lookup_ngram: int = 2  # ... and the longest n-gram it matches
    llamacpp_python: str | None = None  # an interpreter with llama_cpp; None: no llama.cpp rows
    label: str = "cpu"
    out: Path = REPO / "benchmarks" / "results"
    headline: bool = True
    row_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad or not self.precisions:
            raise PeerBenchError(f"precisions: one or more of {list(PRECISIONS)}, got {list(self.precisions)}")
        bad = [m for m in self.methods if m not in OUR_METHODS]
        if bad:
            raise PeerBenchError(f"methods: plain and any of {list(OUR_METHODS[1:])}; unknown {bad}")
        if "plain" not in self.methods:  # every speculative row is checked against it
            object.__setattr__(self, "methods", ("plain", *self.methods))
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise PeerBenchError(f"workloads: one or more of {list(WORKLOADS)}, got {list(self.workloads)}")
        counts = {"prompts_per_workload": self.prompts_per_workload, "max_tokens": self.max_tokens,
                  "repeats": self.repeats, "threads": self.threads, "ngram_k": self.ngram_k, "eagle_k": self.eagle_k,
                  "eagle_tree_nodes": self.eagle_tree_nodes, "auto_k": self.auto_k,
                  "lookup_tokens": self.lookup_tokens, "lookup_ngram": self.lookup_ngram}
        small = [name for name, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if small:
            raise PeerBenchError(f"{', '.join(small)} must be positive integers")
        if self.max_tokens < 2:
            raise PeerBenchError("max_tokens must be at least 2 (a rate after the first token needs two)")
        if self.threads > 64:
            raise PeerBenchError(f"threads must be at most 64, got {self.threads}")
        if not self.label or not all(c.isalnum() or c in "-_" for c in self.label):
            raise PeerBenchError(f"label: letters, digits, - and _ only, got {self.label!r}")
        if self.row_timeout_s <= 0:
            raise PeerBenchError("row_timeout_s must be positive")


@dataclass(frozen=True)
class RowSpec:
    name: str
    engine: str  # "ours" or "llamacpp"
    precision: str  # ours: the target's weights; llama.cpp: the GGUF's own
    method: str  # OUR_METHODS or LLAMACPP_METHODS
    k: int = 0  # draft length (0: none)
    tree_nodes: int = 0

    @property
    def plain_name(self) -> str:
        """The row this one must equal token for token (its engine and precision, plain)."""
        return "llama.cpp plain" if self.engine == "llamacpp" else f"{self.precision} plain"


def row_specs(config: PeerBenchConfig, *, llamacpp: bool) -> list[RowSpec]:
    rows = []
    for p in config.precisions:
        ours = [RowSpec(f"{p} plain", "ours", p, "plain"),
                RowSpec(f"{p} ngram k={config.ngram_k}", "ours", p, "ngram", config.ngram_k),
                RowSpec(f"{p} eagle3 tree k={config.eagle_k}", "ours", p, "eagle_tree", config.eagle_k,
                        config.eagle_tree_nodes),
                RowSpec(f"{p} auto", "ours", p, "auto", config.auto_k)]
        rows += [r for r in ours if r.method in config.methods]
    if llamacpp:
        rows += [RowSpec("llama.cpp plain", "llamacpp", "Q4_1 GGUF", "plain"),
                 RowSpec(f"llama.cpp prompt lookup k={config.lookup_tokens}", "llamacpp", "Q4_1 GGUF",
                         "prompt_lookup", config.lookup_tokens)]
    return rows


def llamacpp_status(python: str | None) -> tuple[bool, str]:
    """(usable, why not / its version): can ``python`` import llama_cpp?"""
    if python is None:
        return False, "no --llamacpp-python given (llama-cpp-python builds from source: docs/cpu-peers.md)"
    if not Path(python).is_file():
        return False, f"--llamacpp-python {python} is not a file"
    try:
        proc = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{python} did not run: {exc}"
    if proc.returncode != 0:
        return False, f"{python} has no llama_cpp ({proc.stderr.strip().splitlines()[-1:] or ['import failed']})"
    return True, f"llama-cpp-python {proc.stdout.strip()}"


# ---- the bench: rows in subprocesses, interleaved ----------------------------------------------

def load_prompts(config: PeerBenchConfig) -> tuple[list[dict], str]:
    """The held-out split's first prompts of each workload, chat-templated and tokenized with the
    target's tokenizer, and the GGUF file the target's weights come from."""
    from builder.train.prompt_set import heldout_split_file
    from triton_backend.engines.torch.model_loading import gguf_source, load_tokenizer

    data = json.loads(heldout_split_file().read_text())["workloads"]
    tokenizer = load_tokenizer(config.target)
    prompts = []
    for workload in config.workloads:
        for index, text in enumerate(data[workload][:config.prompts_per_workload]):
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(templated, add_special_tokens=False)["input_ids"]
            prompts.append({"workload": workload, "index": index, "ids": list(ids)})
    gguf = gguf_source(config.target)
    if gguf is None:
        raise PeerBenchError(f"{config.target} has no GGUF file: llama.cpp needs one")
    return prompts, str(gguf)


def run_row_process(row: RowSpec, job: dict, python: str, work: Path, timeout_s: float) -> dict:
    slug = "".join(c if c.isalnum() else "_" for c in row.name)
    job_file, out_file = work / f"{slug}.job.json", work / f"{slug}.out.json"
    job_file.write_text(json.dumps({**job, "row": asdict(row)}))
    out_file.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    cmd = [python, str(Path(__file__).resolve().with_name("cpu_peer_row.py")), str(job_file), str(out_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out_file.is_file():
        raise PeerBenchError(f"row {row.name!r} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(out_file.read_text())


def run_bench(config: PeerBenchConfig) -> dict:
    usable, llama_note = llamacpp_status(config.llamacpp_python)
    if not usable:
        logger.warning("llama.cpp rows skipped: %s", llama_note)
    rows = row_specs(config, llamacpp=usable)
    prompts, gguf = load_prompts(config)
    job = {"target": config.target, "eagle": config.eagle, "gguf": gguf, "threads": config.threads,
           "max_tokens": config.max_tokens, "lookup_ngram": config.lookup_ngram, "prompts": prompts, "cwd": str(REPO)}
    results: dict[str, dict] = {r.name: {"samples": [], "load_s": [], "info": {}} for r in rows}
    with tempfile.TemporaryDirectory(prefix="cpu-peer-") as tmp:
        for repeat in range(config.repeats):
            order = list(rows)
            random.Random(repeat).shuffle(order)  # no row always first or last
            for row in order:
                python = sys.executable if row.engine == "ours" else str(config.llamacpp_python)
                logger.info("repeat %d: row %s", repeat + 1, row.name)
                out = run_row_process(row, job, python, Path(tmp), config.row_timeout_s)
                results[row.name]["samples"] += [{**s, "repeat": repeat} for s in out["samples"]]
                results[row.name]["load_s"].append(out["load_s"])
                results[row.name]["info"] = out["info"]
    return summarize(config, rows, results, llama_note if not usable else None, llama_note if usable else None)


# ---- summary, identity, report ---------------------------------------------------------------

def identity_checks(rows: list[RowSpec], results: dict[str, dict]) -> dict[str, dict]:
    """Each non-plain row against the plain row of its engine and precision: identical when every
    (prompt, repeat) gave the same tokens. Our rows must be; llama.cpp's are reported as they are."""
    by_key = {name: {(s["workload"], s["index"], s["repeat"]): s["tokens"] for s in r["samples"]}
              for name, r in results.items()}
    out = {}
    for row in rows:
        if row.method == "plain":
            continue
        ref = by_key.get(row.plain_name)
        if ref is None:
            out[row.name] = {"reference": row.plain_name, "identical": None, "mismatches": []}
            continue
        mine = by_key[row.name]
        mismatches = sorted(f"{w}[{i}] repeat {rep}" for (w, i, rep), tokens in mine.items()
                            if ref.get((w, i, rep)) != tokens)
        missing = sorted(set(ref) - set(mine))
        out[row.name] = {"reference": row.plain_name, "identical": not mismatches and not missing,
                         "mismatches": mismatches + [f"{w}[{i}] repeat {rep} missing" for w, i, rep in missing],
                         "compared": len(mine)}
    return out


def _rates(samples: list[dict]) -> dict[str, float]:
    tokens = sum(len(s["tokens"]) for s in samples)
    seconds = sum(s["latency_s"] for s in samples)
    after = sum(s["latency_s"] - s["ttft_s"] for s in samples)
    later = sum(max(len(s["tokens"]) - 1, 0) for s in samples)
    passes = [s["target_passes"] for s in samples if s.get("target_passes")]
    out = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds > 0 else 0.0,
           "decode_tok_s": later / after if after > 0 else 0.0,
           "ttft_ms": 1e3 * sum(s["ttft_s"] for s in samples) / len(samples) if samples else 0.0}
    if passes:
        out["tokens_per_pass"] = tokens / sum(passes)
    return out


def prefix_share(samples: list[dict], reference: list[dict]) -> float | None:
    """Mean share of each reference output (float32 plain's) that ``samples`` reproduce before their
    first differing token: 1.0 where a row computes float32's very tokens (int4 / int8 from the GGUF's
    own blocks), less where its arithmetic differs (llama.cpp quantizes activations to 8 bits)."""
    ref = {(s["workload"], s["index"], s["repeat"]): s["tokens"] for s in reference}
    shares = []
    for s in samples:
        want = ref.get((s["workload"], s["index"], s["repeat"]))
        if want:
            same = next((i for i, (a, b) in enumerate(zip(s["tokens"], want)) if a != b), min(len(s["tokens"]), len(want)))
            shares.append(same / len(want))
    return sum(shares) / len(shares) if shares else None


def summarize(config: PeerBenchConfig, rows: list[RowSpec], results: dict[str, dict], skipped: str | None = None,
              llamacpp: str | None = None) -> dict:
    identity = identity_checks(rows, results)
    table = []
    for row in rows:
        samples = results[row.name]["samples"]
        entry = {**asdict(row), "plain_row": row.plain_name, "all": _rates(samples),
                 "workloads": {w: _rates([s for s in samples if s["workload"] == w]) for w in config.workloads},
                 "load_s": results[row.name]["load_s"], "info": results[row.name].get("info", {}),
                 "identical_to": identity.get(row.name, {}).get("reference"),
                 "identical": True if row.method == "plain" else identity[row.name]["identical"]}
        table.append(entry)
    rate = {e["name"]: e["all"]["tok_s"] for e in table}
    float32 = results.get("float32 plain", {}).get("samples")
    for e in table:
        ref = rate.get(e["plain_row"])
        e["x_plain"] = e["all"]["tok_s"] / ref if ref else None
        e["prefix_share_float32"] = prefix_share(results[e["name"]]["samples"], float32) if float32 else None
    ours_identical = all(identity[r.name]["identical"] for r in rows if r.engine == "ours" and r.method != "plain")
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()
                       if k not in ("llamacpp_python", "out")},
            "llamacpp": llamacpp, "llamacpp_skipped": skipped, "rows": table, "identity": identity,
            "ours_identical_to_plain": ours_identical, "headline": headline_figures(table, ours_identical)}


def headline_figures(table: list[dict], ours_identical: bool) -> dict[str, float]:
    """The issue's goal keys, each where its rows ran; none while a speculative row of ours differs
    from its plain row (a figure of a row that is not exact is no figure)."""
    if not ours_identical:
        return {}
    rate = {e["name"]: e["all"]["tok_s"] for e in table}
    figures = {key: rate[a] / rate[b] for key, a, b in HEADLINE_PAIRS if rate.get(a) and rate.get(b)}
    ours = [e["all"]["tok_s"] for e in table if e["engine"] == "ours" and e["identical"]]
    peers = [e["all"]["tok_s"] for e in table if e["engine"] == "llamacpp"]
    if ours and peers and max(peers) > 0:
        figures["cpu_best_x_llamacpp_best"] = max(ours) / max(peers)
    return figures


def report_markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = [f"CPU peers on {cfg['target']} (scripts/cpu_peer_bench.py): held-out {', '.join(cfg['workloads'])} prompts "
             f"x {cfg['prompts_per_workload']} each, {cfg['max_tokens']} tokens, greedy, EOS ignored, "
             f"{cfg['threads']} thread(s), {cfg['repeats']} repeat(s), each row in its own process, rows shuffled "
             "per repeat. tok/s: generated tokens over request seconds (prefill included); after prefill: from "
             "the first token on.", ""]
    lines.append("llama.cpp: " + (summary["llamacpp"] or f"not run ({summary['llamacpp_skipped']})"))
    lines += ["", "| row | weights | tok/s | after prefill tok/s | TTFT ms | tokens/pass | x its plain | identical to plain "
              "| float32's tokens kept |", "|---|---|---|---|---|---|---|---|---|"]
    for e in summary["rows"]:
        a = e["all"]
        same = "-" if e["method"] == "plain" else {True: "yes", False: "NO", None: "not compared"}[e["identical"]]
        tpp = f"{a['tokens_per_pass']:.2f}" if "tokens_per_pass" in a else "-"
        xp = "-" if e["x_plain"] is None else f"{e['x_plain']:.2f}"
        kept = "-" if e.get("prefix_share_float32") is None else f"{e['prefix_share_float32']:.2f}"
        lines.append(f"| {e['name']} | {e['precision']} | {a['tok_s']:.1f} | {a['decode_tok_s']:.1f} | {a['ttft_ms']:.0f} | "
                     f"{tpp} | {xp} | {same} | {kept} |")
    workloads = cfg["workloads"]
    lines += ["", "Per workload, tok/s: " + " / ".join(workloads), "", "| row | " + " | ".join(workloads) + " |",
              "|---" * (len(workloads) + 1) + "|"]
    for e in summary["rows"]:
        lines.append(f"| {e['name']} | " + " | ".join(f"{e['workloads'][w]['tok_s']:.1f}" for w in workloads) + " |")
    verdict = "yes" if summary["ours_identical_to_plain"] else "NO (no headline figures written)"
    lines += ["", f"Every speculative row of ours identical to its plain row: {verdict}. float32's tokens kept: the "
              "mean share of float32 plain's output a row reproduces before its first differing token."]
    if summary["headline"]:
        lines += ["", "Headline: " + ", ".join(f"{k} = {v:.3f}" for k, v in summary["headline"].items())]
    return "\n".join(lines) + "\n"


def write_report(summary: dict, out_dir: Path, label: str, *, headline: Path | None = None) -> dict[str, Path]:
    """``cpu-peer-LABEL.json`` and ``.md`` in ``out_dir`` (paths in them relative to the repository);
    the headline figures merged into ``headline`` (None: not written; a label other than ``cpu``
    prefixes the keys)."""
    from builder.headline import update_headline
    from builder.report_paths import portable

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"cpu-peer-{label}.json", "markdown": out_dir / f"cpu-peer-{label}.md"}
    paths["json"].write_text(json.dumps(portable(summary), indent=2) + "\n")
    paths["markdown"].write_text(report_markdown(summary))
    if headline is not None and summary["headline"]:
        prefix = "" if label == "cpu" else f"{label}_"
        update_headline({prefix + k: v for k, v in summary["headline"].items()}, headline)
        paths["headline"] = headline
    return paths


def parse_args(argv: list[str] | None) -> PeerBenchConfig:
    d = PeerBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=d.target)
    p.add_argument("--eagle", default=d.eagle, help="the EAGLE-3 drafter folder of the eagle and auto rows")
    p.add_argument("--precisions", default=",".join(d.precisions), help="target weights: float32,int8,int4")
    p.add_argument("--methods", default=",".join(d.methods), help="our rows per precision: plain (always) and any of "
                   "ngram,eagle_tree,auto")
    p.add_argument("--workloads", default=",".join(d.workloads), help="held-out split workloads: chat,code")
    p.add_argument("--prompts-per-workload", type=int, default=d.prompts_per_workload)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--threads", type=int, default=d.threads, help="every row's threads (ours and llama.cpp's)")
    p.add_argument("--ngram-k", type=int, default=d.ngram_k)
    p.add_argument("--eagle-k", type=int, default=d.eagle_k)
    p.add_argument("--eagle-tree-nodes", type=int, default=d.eagle_tree_nodes)
    p.add_argument("--auto-k", type=int, default=d.auto_k)
    p.add_argument("--lookup-tokens", type=int, default=d.lookup_tokens, help="llama.cpp prompt lookup's draft length")
    p.add_argument("--lookup-ngram", type=int, default=d.lookup_ngram, help="llama.cpp prompt lookup's longest n-gram")
    p.add_argument("--llamacpp-python", default=None,
                   help="an interpreter with llama-cpp-python (docs/cpu-peers.md); without it no llama.cpp rows")
    p.add_argument("--label", default=d.label, help="results file suffix; not 'cpu': headline keys get it as a prefix")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--no-headline", action="store_true")
    p.add_argument("--row-timeout-s", type=float, default=d.row_timeout_s)
    a = p.parse_args(argv)

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    return PeerBenchConfig(target=a.target, eagle=a.eagle, precisions=names(a.precisions), methods=names(a.methods),
                           workloads=names(a.workloads),
                           prompts_per_workload=a.prompts_per_workload, max_tokens=a.max_tokens, repeats=a.repeats,
                           threads=a.threads, ngram_k=a.ngram_k, eagle_k=a.eagle_k,
                           eagle_tree_nodes=a.eagle_tree_nodes, auto_k=a.auto_k, lookup_tokens=a.lookup_tokens,
                           lookup_ngram=a.lookup_ngram, llamacpp_python=a.llamacpp_python, label=a.label, out=a.out,
                           headline=not a.no_headline, row_timeout_s=a.row_timeout_s)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_bench(config)
    from builder.bench.config import headline_file

    paths = write_report(summary, config.out, config.label,
                         headline=headline_file(config.out) if config.headline else None)
    print(report_markdown(summary))
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 0 if summary["ours_identical_to_plain"] else 1


if __name__ == "__main__":
    sys.exit(main())
