"""``specbuild eagle-features``, ``train-eagle3`` and ``export-eagle3``: flags -> one config -> one call."""

from __future__ import annotations

import argparse

from triton_backend.core.reference_model import DEFAULT_REFERENCE


def _layers(text: str) -> tuple[int, ...] | None:
    from triton_backend.core.errors import ConfigError

    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"--capture-layers takes comma-separated layer indices, got {text!r}") from exc


def _cmd_features(a: argparse.Namespace) -> int:
    from builder.train.eagle_features import FeatureConfig, generate_features

    out = generate_features(FeatureConfig(target=a.target, corpus_dir=a.corpus, out_dir=a.out,
                                          capture_layers=_layers(a.capture_layers), batch_tokens=a.batch_tokens,
                                          max_shards=a.max_shards))
    print(f"features in {out}: {len(list(out.glob('feat-*.pt')))} files")
    return 0


def _cmd_train(a: argparse.Namespace) -> int:
    from builder.train.eagle3 import Eagle3TrainConfig, train_eagle3

    cfg = Eagle3TrainConfig(target=a.target, features_dir=a.features, heldout_dir=a.heldout_features, out=a.out,
                            draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps, step_decay=a.step_decay, epochs=a.epochs,
                            batch_size=a.batch_size, max_len=a.max_len, lr=a.lr, time_limit_s=a.time_limit,
                            eval_every_s=a.eval_every, seed=a.seed, init_from=a.init_from or "",
                            init_from_target=a.init_from_target, revocab=a.revocab, threads=a.threads)
    print(train_eagle3(cfg, progress=not a.quiet).summary())
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from builder.stages.eagle3_export import export_eagle3
    from triton_backend.engines.torch.model_loading import resolve_model_path

    folder, _ = resolve_model_path(a.target)
    config = AutoConfig.from_pretrained(folder).to_dict()
    export = export_eagle3(a.eagle, a.out, target=str(a.target),
                           num_target_layers=int(config["num_hidden_layers"]),
                           target_hidden_size=int(config["hidden_size"]), target_vocab_size=int(config["vocab_size"]),
                           max_draft_len=a.max_draft_len, port=a.port)
    print(f"EAGLE-3 drafter: {export.drafter}\nLLM-API options: {export.options}\n"
          f"serve (TensorRT-LLM 1.x, PyTorch flow; also in {export.folder / 'serve.sh'}):\n{export.serve_shell()}")
    return 0


def register_eagle3_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    f = sub.add_parser("eagle-features", help="EAGLE-3 training features (fused low/mid/high layers) from a token corpus "
                                              "by batched prefill (resumable)")
    f.add_argument("--target", default=DEFAULT_REFERENCE)
    f.add_argument("--corpus", required=True, help="the eagle-data folder")
    f.add_argument("--out", required=True, help="feature folder (feat-*.pt)")
    f.add_argument("--capture-layers", default="", help="comma-separated layer indices (default: 1, L/2-1, L-4)")
    f.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per prefill batch")
    f.add_argument("--max-shards", type=int, default=None)
    f.set_defaults(func=_cmd_features)

    t = sub.add_parser("train-eagle3", help="train an EAGLE-3 drafter (training-time test, reduced draft vocabulary)")
    t.add_argument("--target", default=DEFAULT_REFERENCE)
    t.add_argument("--features", required=True,
                   help="training feature folder(s), comma-separated: eagle-features folders or eagle-data corpus "
                        "folders (their stored feat-*.pt used, shards without one prefilled first)")
    t.add_argument("--heldout-features", required=True, help="held-out feature folder (greedy responses), of either kind")
    t.add_argument("--out", required=True, help="drafter folder (config.json, model.safetensors, training_report.json)")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="size of the draft vocabulary (default 8192; with --init-from, the init's)")
    t.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="warm start from an EAGLE-3 drafter folder of the same target (its weights and vocabulary "
                        "map; capture layers must match the features'); a checkpoint in --out still resumes first")
    t.add_argument("--init-from-target", action="store_true",
                   help="fresh start: the decoder layer from the target's last decoder layer where shapes fit")
    t.add_argument("--revocab", action="store_true",
                   help="with --init-from: re-pick the draft vocabulary from this run's data (--draft-vocab tokens, "
                        "default the init's size); the init's body and its head rows for tokens kept")
    t.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default 0: torch's default, the cores it sees or OMP_NUM_THREADS)")
    t.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (draft depth trained)")
    t.add_argument("--step-decay", type=float, default=0.8, help="loss weight decay per TTT step")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--max-len", type=int, default=512, help="positions per sequence used")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--time-limit", type=float, default=1800.0, help="training time limit in seconds")
    t.add_argument("--eval-every", type=float, default=300.0, help="seconds between learning-curve points")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=_cmd_train)

    x = sub.add_parser("export-eagle3", help="an EAGLE-3 drafter for TensorRT-LLM 1.x (drafter folder, LLM-API YAML, "
                                             "trtllm-serve line)")
    x.add_argument("--eagle", required=True, help="the drafter folder (train-eagle3, or a published EAGLE-3 checkpoint)")
    x.add_argument("--target", default=DEFAULT_REFERENCE, help="the target (HF folder or reference name)")
    x.add_argument("--out", required=True)
    x.add_argument("--max-draft-len", type=int, default=3)
    x.add_argument("--port", type=int, default=8000)
    x.set_defaults(func=_cmd_export)
