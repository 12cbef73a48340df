"""Flags and helpers several commands share: the training commands' data and evaluation flags
(distill, train-medusa, train-eagle, eval-eagle), and ``given`` (only the flags a user set)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from triton_backend.core.reference_model import DEFAULT_REFERENCE

if TYPE_CHECKING:
    from builder.train.jobs import EvalConfig
    from builder.train.target_data import TargetDataConfig


def data_arguments(p: argparse.ArgumentParser) -> None:
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


def data_config(a: argparse.Namespace, out_dir: str, prompts: str, *, hidden: bool) -> "TargetDataConfig":
    from builder.train.target_data import TargetDataConfig
    from triton_backend.core.errors import ConfigError

    if not out_dir.strip().rstrip("/").removesuffix("-heldout"):
        raise ConfigError("--data-dir must name a folder for the target-data shards")
    return TargetDataConfig(target=a.target, out_dir=out_dir, prompts_file=prompts, max_prompts=a.max_prompts,
                            max_new_tokens=a.max_new_tokens, batch_size=a.gen_batch_size, shard_size=a.shard_size,
                            save_hidden=hidden,
                            seed=a.seed)


def eval_config(a: argparse.Namespace) -> "EvalConfig | None":
    from builder.train.jobs import EvalConfig

    if a.no_eval:
        return None
    return EvalConfig(prompts_file=a.eval_prompts, count=a.eval_count, max_tokens=a.eval_max_tokens,
                      num_draft_tokens=a.num_draft_tokens)


def given(**kwargs: object) -> dict[str, object]:
    """The keyword arguments that are not ``None`` (flags the user gave)."""
    return {k: v for k, v in kwargs.items() if v is not None}


__all__ = ["data_arguments", "data_config", "eval_config", "given"]
