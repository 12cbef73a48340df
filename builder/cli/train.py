"""``specbuild distill`` and ``specbuild train-medusa``: flags -> one job config -> one call."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from builder.ops.local_run import parse_layers
from triton_backend.core.reference_model import DEFAULT_REFERENCE

if TYPE_CHECKING:
    from builder.train.target_data import TargetDataConfig
    from builder.train.jobs import EvalConfig


def _data_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_REFERENCE, help="reference model name or HF directory")
    p.add_argument("--data-dir", required=True, help="target-data shards (made here, or resumed when partly there)")
    p.add_argument("--prompts", default="", help="training prompts, one per line (default: the packaged set)")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="length of each target response")
    p.add_argument("--gen-batch-size", type=int, default=32, help="prompts per batched target generation")
    p.add_argument("--shard-size", type=int, default=64, help="prompts per data shard (the unit of resuming)")
    p.add_argument("--eval-prompts", default="", help="held-out prompts (default: the packaged held-out set)")
    p.add_argument("--eval-count", type=int, default=16, help="held-out prompts to measure acceptance on")
    p.add_argument("--eval-max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft length / tree depth when measuring")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance run")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--time-limit", type=float, default=900.0, help="training time limit in seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _data_config(a: argparse.Namespace, out_dir: str, prompts: str, *, hidden: bool) -> "TargetDataConfig":
    from builder.train.target_data import TargetDataConfig
    from triton_backend.core.errors import ConfigError

    if not out_dir.strip().rstrip("/").removesuffix("-heldout"):
        raise ConfigError("--data-dir must name a folder for the target-data shards")
    return TargetDataConfig(target=a.target, out_dir=out_dir, prompts_file=prompts, max_prompts=a.max_prompts,
                            max_new_tokens=a.max_new_tokens, batch_size=a.gen_batch_size, shard_size=a.shard_size,
                            save_hidden=hidden,
                            seed=a.seed)


def _eval_config(a: argparse.Namespace) -> "EvalConfig | None":
    from builder.train.jobs import EvalConfig

    if a.no_eval:
        return None
    return EvalConfig(prompts_file=a.eval_prompts, count=a.eval_count, max_tokens=a.eval_max_tokens,
                      num_draft_tokens=a.num_draft_tokens)


def _given(**kwargs: object) -> dict[str, object]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _cmd_distill(a: argparse.Namespace) -> int:
    from builder.train.distill import DistillConfig
    from builder.train.jobs import DistillJob, run_distill

    train = DistillConfig(target=a.target, data_dir=a.data_dir, out_dir=a.out, init_layers=a.init_layers,
                          draft_vocab=a.draft_vocab, epochs=a.epochs, batch_size=a.batch_size,
                          time_limit_s=a.time_limit, seed=a.seed, **_given(lr=a.lr))
    job = DistillJob(data=_data_config(a, a.data_dir, a.prompts, hidden=False), train=train,
                     evaluation=_eval_config(a), threads=a.threads, progress=not a.quiet)
    report = run_distill(job)
    print(report["summary"])
    if report["acceptance"]:
        acc = report["acceptance"]
        print(f"held-out acceptance: {acc['acceptance_rate']:.3f} ({acc['accepted_tokens']}/{acc['drafted_tokens']}), "
              f"{acc['tokens_per_pass']:.2f} tokens per target pass")
    return 0


def _cmd_train_medusa(a: argparse.Namespace) -> int:
    from builder.train.medusa import MedusaTrainConfig
    from builder.train.target_data import default_prompts_file
    from builder.train.jobs import MedusaJob, run_train_medusa

    heldout_dir = a.heldout_data_dir or f"{a.data_dir.rstrip('/')}-heldout"
    heldout_prompts = a.eval_prompts or str(default_prompts_file("heldout_prompts.txt"))
    train = MedusaTrainConfig(target=a.target, data_dir=a.data_dir, heldout_dir=heldout_dir, out=a.out,
                              num_heads=a.num_heads, num_layers=a.num_layers, candidate_vocab=a.candidate_vocab,
                              epochs=a.epochs, batch_size=a.batch_size, time_limit_s=a.time_limit,
                              tree_size=a.tree_size, seed=a.seed, **_given(lr=a.lr))
    heldout = _data_config(a, heldout_dir, heldout_prompts, hidden=True)
    job = MedusaJob(data=_data_config(a, a.data_dir, a.prompts, hidden=True), heldout=heldout, train=train,
                    evaluation=_eval_config(a), threads=a.threads, progress=not a.quiet)
    report = run_train_medusa(job)
    print(report["summary"])
    print("medusa_choices:", json.dumps(report["training"]["medusa_choices"]))
    if report["acceptance"]:
        acc = report["acceptance"]
        print(f"held-out acceptance: {acc['acceptance_rate']:.3f} ({acc['accepted_tokens']}/{acc['drafted_tokens']} "
              f"tree depth positions), {acc['tokens_per_pass']:.2f} tokens per target pass")
    return 0


def register_training_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    d = sub.add_parser("distill", help="train a small draft on the target's own outputs; report held-out acceptance")
    _data_arguments(d)
    d.add_argument("--out", required=True, help="output folder (a HF model directory)")
    d.add_argument("--init-layers", type=parse_layers, default=(0, 1), help="target layers the draft starts from, e.g. 0,1")
    d.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft's LM head ranks")
    d.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    d.set_defaults(func=_cmd_distill)

    m = sub.add_parser("train-medusa", help="train Medusa heads on the frozen target; report per-head accuracy")
    _data_arguments(m)
    m.add_argument("--out", required=True, help="heads file (.safetensors)")
    m.add_argument("--heldout-data-dir", default=None, help="held-out target data (default: <data-dir>-heldout)")
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    m.add_argument("--candidate-vocab", type=int, default=8192, help="tokens the heads rank (0: all)")
    m.add_argument("--tree-size", type=int, default=15, help="nodes in the medusa_choices tree grown from accuracies")
    m.add_argument("--batch-size", type=int, default=256, help="positions per training step")
    m.set_defaults(func=_cmd_train_medusa)

    from builder.cli.eagle import register_eagle_commands

    register_eagle_commands(sub)

