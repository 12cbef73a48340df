"""``specbuild distill`` and ``specbuild train-medusa``: flags -> one job config -> one call."""

from __future__ import annotations

import argparse
import json

from builder.cli.args import data_arguments, data_config, eval_config, given
from builder.ops.local_run import parse_layers


def _cmd_distill(a: argparse.Namespace) -> int:
    from builder.train.distill import DistillConfig
    from builder.train.jobs import DistillJob, run_distill

    train = DistillConfig(target=a.target, data_dir=a.data_dir, out_dir=a.out, init_layers=a.init_layers,
                          draft_vocab=a.draft_vocab, epochs=a.epochs, batch_size=a.batch_size,
                          time_limit_s=a.time_limit, seed=a.seed, **given(lr=a.lr))
    job = DistillJob(data=data_config(a, a.data_dir, a.prompts, hidden=False), train=train,
                     evaluation=eval_config(a), threads=a.threads, progress=not a.quiet)
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
                              tree_size=a.tree_size, seed=a.seed, **given(lr=a.lr))
    heldout = data_config(a, heldout_dir, heldout_prompts, hidden=True)
    job = MedusaJob(data=data_config(a, a.data_dir, a.prompts, hidden=True), heldout=heldout, train=train,
                    evaluation=eval_config(a), threads=a.threads, progress=not a.quiet)
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
    data_arguments(d)
    d.add_argument("--out", required=True, help="output folder (a HF model directory)")
    d.add_argument("--init-layers", type=parse_layers, default=(0, 1), help="target layers the draft starts from, e.g. 0,1")
    d.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft's LM head ranks")
    d.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    d.set_defaults(func=_cmd_distill)

    m = sub.add_parser("train-medusa", help="train Medusa heads on the frozen target; report per-head accuracy")
    data_arguments(m)
    m.add_argument("--out", required=True, help="heads file (.safetensors)")
    m.add_argument("--heldout-data-dir", default=None, help="held-out target data (default: <data-dir>-heldout)")
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    m.add_argument("--candidate-vocab", type=int, default=8192, help="tokens the heads rank (0: all)")
    m.add_argument("--tree-size", type=int, default=15, help="nodes in the medusa_choices tree grown from accuracies")
    m.add_argument("--batch-size", type=int, default=256, help="positions per training step")
    m.set_defaults(func=_cmd_train_medusa)

