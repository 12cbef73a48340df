"""EAGLE-3 drafter data and training at GPU scale, in one time-boxed run.

What ``specbuild eagle-data`` and ``specbuild train-eagle3`` do on CPU for hours, done on one
CUDA device in minutes, through the same pieces (prompt encoding, feature capture, the
training-time-test loss, the warm start, the saved drafter layout):

1. generate: every prompt of the drafter prompt set answered by the target with Hugging Face
   ``generate`` at large batch, ``--greedy-passes`` greedy and ``--sampled-passes`` sampled
   (temperature ``--temperature``) responses per prompt, until ``--gen-s`` seconds are spent;
2. features: one batched prefill per batch of sequences (the generated ones plus any token
   corpus folders named by ``--corpus``) captures the low/mid/high layer outputs and the
   target's greedy token at every position;
3. train: the drafter (warm-started from ``--init-from``) trained with training-time test
   until ``--train-s`` seconds are spent, held-out chain acceptance measured on ``--heldout``
   along the way.

Writes to ``--out``: ``drafter/`` (config.json, model.safetensors, training_report.json) and
``gpu-corpus.npz`` (the generated token sequences in the corpus shard layout, so CPU runs can
recompute their features on the served weights). The held-out figure printed here is taken on
this device's forward; the figure that counts is measured again on CPU on the served weights
(``specbuild train-eagle3``'s held-out measure / ``specbuild eval-eagle``).

Also runs on CPU (``--device cpu``) with tiny settings, which is how it is checked before a GPU run.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("eagle3_at_scale")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--prompts", default="artifacts/eagle-corpus/corpus/prompts.jsonl.gz")
    p.add_argument("--corpus", default="artifacts/eagle-corpus/corpus,artifacts/eagle-corpus/distill,artifacts/eagle-corpus/gpu",
                   help="token corpus folders whose sequences are trained on too (comma-separated; '' none)")
    p.add_argument("--heldout", default="artifacts/eagle-corpus/held")
    p.add_argument("--init-from", default="artifacts/smollm2-135m-eagle3")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gen-rows", type=int, default=1024, help="sequences per generate batch")
    p.add_argument("--greedy-passes", type=int, default=1)
    p.add_argument("--sampled-passes", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts only (0: all)")
    p.add_argument("--gen-s", type=float, default=150.0)
    p.add_argument("--skip-batches", type=int, default=0,
                   help="leave out the first N generate batches (made by an earlier run: pass its corpus to --corpus)")
    p.add_argument("--feature-tokens", type=int, default=32768, help="padded tokens per feature prefill batch")
    p.add_argument("--train-s", type=float, default=200.0)
    p.add_argument("--finish-by", type=float, default=0.0,
                   help="unix time by which the drafter must be saved (training stops 30 s before; 0: no limit)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--eval-every-s", type=float, default=60.0)
    p.add_argument("--tf32", action="store_true", help="TF32 matmuls for generation and features (faster, ~1e-3 error)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def _encode_prompts(tokenizer, prompts: list[dict], limit: int) -> list[list[int]]:
    from builder.train.eagle_corpus import _clip, _encode

    return [_clip(_encode(tokenizer, p, True), limit) for p in prompts]


@torch.inference_mode()
def generate(model, prompt_ids: list[list[int]], args, eos: int, deadline: float) -> list[dict]:
    """Responses, batch after batch (prompts sorted by length), until ``deadline``."""
    from transformers import GenerationConfig

    passes = [0.0] * args.greedy_passes + [args.temperature] * args.sampled_passes
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    jobs = []  # (pass, [prompt indices])
    for k, temp in enumerate(passes):
        batches = [order[i:i + args.gen_rows] for i in range(0, len(order), args.gen_rows)]
        random.Random(args.seed + k).shuffle(batches)
        jobs += [(k, temp, b) for b in batches]
    out: list[dict] = []
    t0 = time.monotonic()
    positions = 0
    for n, (k, temp, members) in enumerate(jobs):
        if n < args.skip_batches:
            continue
        if time.monotonic() > deadline:
            logger.info("generation budget spent after %d of %d batches", n, len(jobs))
            break
        width = max(len(prompt_ids[i]) for i in members)
        ids = torch.full((len(members), width), eos, dtype=torch.long)
        mask = torch.zeros((len(members), width), dtype=torch.long)
        for r, i in enumerate(members):  # left padding
            ids[r, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            mask[r, width - len(prompt_ids[i]):] = 1
        torch.manual_seed(args.seed * 7919 + n)
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=temp > 0, temperature=temp or None,
                               top_k=0 if temp > 0 else None, top_p=1.0 if temp > 0 else None,
                               eos_token_id=eos, pad_token_id=eos)
        gen = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), generation_config=cfg)
        resp = gen[:, width:].cpu().numpy()
        for r, i in enumerate(members):
            row = resp[r].tolist()
            if eos in row:
                row = row[:row.index(eos) + 1]
            if row:
                out.append({"prompt_index": i, "pass": k, "temperature": temp, "prompt": prompt_ids[i], "response": row})
                positions += len(row)
        rate = positions / (time.monotonic() - t0)
        logger.info("generate batch %d/%d (pass %d, %d rows, width %d): %d positions so far, %.0f positions/s",
                    n + 1, len(jobs), k, len(members), width, positions, rate)
    return out


def save_corpus(seqs: list[dict], path: Path) -> None:
    flat = np.concatenate([np.asarray(s["prompt"] + s["response"], dtype=np.uint16) for s in seqs])
    offsets = np.cumsum([0] + [len(s["prompt"]) + len(s["response"]) for s in seqs]).astype(np.int64)
    np.savez_compressed(path, tokens=flat, offsets=offsets,
                        prompt_lengths=np.asarray([len(s["prompt"]) for s in seqs], dtype=np.int32),
                        temperatures=np.asarray([s["temperature"] for s in seqs], dtype=np.float32),
                        prompt_index=np.asarray([s["prompt_index"] for s in seqs], dtype=np.int64),
                        sample_pass=np.asarray([s["pass"] for s in seqs], dtype=np.int16))


def corpus_sequences(folders: str) -> list[tuple[np.ndarray, int]]:
    from builder.train.eagle_corpus import iter_corpus

    out = []
    for folder in [f for f in folders.split(",") if f.strip()]:
        for tokens, plen, _temp in iter_corpus(folder):
            out.append((np.asarray(tokens, dtype=np.int64), int(plen)))
    return out


def features(model, seqs: list[tuple[np.ndarray, int]], layers: tuple[int, ...], batch_tokens: int, max_len: int):
    """Training sequences (features on the device) for every sequence, by batched prefill in the
    batches ``eagle-features`` makes (sorted by length, at most ``batch_tokens`` padded tokens)."""
    from builder.train.eagle3 import training_sequence
    from builder.train.eagle_features import _batches, prefill_features

    seqs = [(s[:max_len], p) for s, p in seqs]
    out: list = [None] * len(seqs)
    for batch in _batches(seqs, batch_tokens):
        got = prefill_features(model, [seqs[i][0] for i in batch], layers)
        for i, (feats, top1) in zip(batch, got):
            out[i] = training_sequence(feats, torch.from_numpy(seqs[i][0]).to(feats.device), top1, seqs[i][1], max_len)
    return out


def train(args, net, embed, coverage: float, train_seqs, held, out_dir: Path, deadline: float) -> dict:
    """``train-eagle3``'s epochs (its step, schedule and curve points) over sequences already in
    memory, until ``deadline`` or the planned epochs end; no checkpoints (the run is one sitting)."""
    from builder.train.eagle3 import CurvePoint, Eagle3TrainConfig, _as_saved, _epochs, _Run, chain_acceptance
    from builder.train.schedule import TimedCosine

    cfg = Eagle3TrainConfig(target=args.target, features_dir="gpu", heldout_dir=args.heldout, out=str(out_dir),
                            ttt_steps=args.ttt_steps, epochs=args.epochs, batch_size=args.batch_size,
                            max_len=args.max_len, lr=args.lr, time_limit_s=max(1.0, deadline - time.monotonic()),
                            eval_every_s=args.eval_every_s, save_every_s=float("inf"), init_from=args.init_from,
                            seed=args.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.0)
    per_epoch = -(-len(train_seqs) // cfg.batch_size)
    sched = TimedCosine(opt, cfg.epochs * per_epoch, cfg.time_limit_s)
    curve = [CurvePoint(0, 0, 0.0, chain_acceptance(net, embed, held, cfg.ttt_steps))]
    logger.info("step 0: held-out chain acceptance %s", curve[0].acceptance)
    state = {"steps": 0, "positions": 0, "seconds": 0.0}
    losses = _epochs(cfg, _Run(net, embed, coverage, train_seqs, held), opt, sched, state, curve, out_dir / "unused",
                     progress=False)
    final = chain_acceptance(_as_saved(net), embed, held, cfg.ttt_steps)
    seconds = time.monotonic() - sched.start
    curve.append(CurvePoint(state["steps"], state["positions"], seconds, final))
    logger.info("final (float16 weights): held-out chain acceptance %s after %d steps", final, state["steps"])
    return {"settings": {k: v for k, v in asdict(cfg).items() if k not in ("time_limit_s", "save_every_s")},
            "steps": state["steps"], "positions": state["positions"], "epochs_planned": cfg.epochs,
            "per_epoch_steps": per_epoch, "seconds": seconds, "acceptance": final, "curve": [asdict(p) for p in curve],
            "losses": losses[:5] + losses[-5:]}


def main() -> None:
    args = _args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from builder.train.eagle3_init import coverage_of, read_init, target_parts, warm_net
    from builder.train.eagle_features import capture_layers_for
    from builder.train.prompt_set import load_prompt_set
    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer
    from triton_backend.speculation.drafters.eagle3_model import save_eagle3

    tokenizer = load_tokenizer(args.target)
    model = load_model(args.target).to(args.device).eval()
    eos = int(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, int)
              else model.generation_config.eos_token_id[0])
    prompts = load_prompt_set(Path(args.prompts))
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    prompt_ids = _encode_prompts(tokenizer, prompts, args.max_prompt_tokens)
    logger.info("%d prompts encoded; loading took %.1fs", len(prompt_ids), time.monotonic() - t_start)

    t0 = time.monotonic()
    generated = generate(model, prompt_ids, args, eos, t0 + args.gen_s)
    gen_s = time.monotonic() - t0
    gen_positions = sum(len(s["response"]) for s in generated)
    save_corpus(generated, out / "gpu-corpus.npz")
    logger.info("generated %d sequences, %d positions in %.1fs (%.0f positions/s)", len(generated), gen_positions,
                gen_s, gen_positions / max(gen_s, 1e-9))

    torch.set_default_device(args.device)
    t0 = time.monotonic()
    layers = capture_layers_for(model, None)
    seqs = [(np.asarray(s["prompt"] + s["response"], dtype=np.int64), len(s["prompt"])) for s in generated]
    cpu_corpus = corpus_sequences(args.corpus) if args.corpus else []
    train_seqs = features(model, seqs + cpu_corpus, layers, args.feature_tokens, args.max_len)
    held = features(model, corpus_sequences(args.heldout), layers, args.feature_tokens, args.max_len)[:64]
    feat_s = time.monotonic() - t0
    train_positions = sum(len(s.tokens) - 1 - s.first for s in train_seqs)
    logger.info("features: %d training sequences (%d positions: %d generated here, %d from the CPU corpus), %d held-out, "
                "in %.1fs", len(train_seqs), train_positions, gen_positions, len(cpu_corpus), len(held), feat_s)
    del model
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None

    torch.set_default_device("cpu")  # the drafter is read on the host, then moved
    parts = target_parts(args.target)
    init = read_init(args.init_from, args.target, parts.config, None)
    net = warm_net(init, layers, Path(args.target).name).to(args.device)
    embed = parts.embed.to(args.device)
    torch.set_default_device(args.device)  # training builds its masks and positions on the device
    coverage = coverage_of(net, [s.top1[s.first:] for s in train_seqs])
    deadline = time.monotonic() + args.train_s
    if args.finish_by:
        deadline = min(deadline, time.monotonic() + args.finish_by - time.time() - 30.0)
    report = train(args, net, embed, coverage, train_seqs, held, out / "drafter", deadline)
    net = net.to("cpu")
    torch.set_default_device("cpu")
    net.info.extra.update({"heldout_chain_acceptance": [round(a, 4) for a in report["acceptance"]],
                           "init_from": args.init_from, "trained_on": "gpu-scale run (scripts/gpu/eagle3_at_scale.py)"})
    save_eagle3(out / "drafter", net)
    summary = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "tf32": args.tf32,
               "generation": {"sequences": len(generated), "positions": gen_positions, "seconds": gen_s,
                              "positions_per_s": gen_positions / max(gen_s, 1e-9), "rows": args.gen_rows,
                              "greedy_passes": args.greedy_passes, "sampled_passes": args.sampled_passes,
                              "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                              "prompts": len(prompt_ids)},
               "features": {"seconds": feat_s, "train_sequences": len(train_seqs), "train_positions": train_positions,
                            "cpu_corpus_sequences": len(cpu_corpus), "heldout_sequences": len(held),
                            "layers": list(layers)},
               "training": {**report, "draft_vocab_coverage": coverage},
               "total_s": time.monotonic() - t_start}
    (out / "drafter" / "gpu_training_report.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("done in %.0fs: %s", summary["total_s"], out)


if __name__ == "__main__":
    main()
