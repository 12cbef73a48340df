"""The drafter token corpus (builder/train/eagle_corpus.py) and its prompt set
(builder/train/prompt_set.py) on a tiny random Llama: continuous batching over shards gives
each prompt the target's own response (greedy rows equal Hugging Face greedy decoding), a
killed run resumes to the same bytes, other settings are refused, and the built prompt set
keeps the held-out prompts and topics out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.errors import BuildSpecError
from builder.train.eagle_corpus import (CorpusConfig, corpus_positions, generate_corpus, iter_corpus, shard_path)
from builder.train.prompt_set import PromptSetConfig, build_prompt_set, heldout_texts, heldout_topics, _norm

PROMPTS = ["Say hi.", "Count to three.", "Name a colour.", "What is two plus two?", "Spell cat.", "Name a fruit.",
           "Give me a number.", "Say bye."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from build_fixtures import make_tiny_llama
    from triton_backend.core.reference_model import ensure_reference_model

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), ensure_reference_model(), hidden=64, layers=2,
                           intermediate=128)


def _config(tiny, out, **kw) -> CorpusConfig:
    prompts = out.parent / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = dict(target=str(tiny), out_dir=str(out), prompts_file=str(prompts), max_new_tokens=6, rows=3, shard_size=3,
                sampled_share=0.5, max_prompt_tokens=64, log_every_s=0.0)
    return CorpusConfig(**{**base, **kw})


def test_corpus_rows_are_the_targets_own_responses_and_resume_to_the_same_bytes(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    config = _config(tiny, tmp_path / "corpus")
    stats = generate_corpus(config)
    files = sorted((tmp_path / "corpus").glob("shard-*.npz"))
    assert len(files) == 3 and stats.shards_done == 3  # 8 prompts, shards of 3: 3 + 3 + 2
    seqs = list(iter_corpus(tmp_path / "corpus"))
    assert len(seqs) == len(PROMPTS)
    assert stats.positions == corpus_positions(tmp_path / "corpus") == sum(len(t) - p for t, p, _ in seqs)
    temps = {round(t, 4) for _, _, t in seqs}
    assert temps == {0.0, config.temperature}  # both greedy and sampled responses
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    greedy = [(t, p) for t, p, temp in seqs if temp == 0.0]
    for tokens, plen in greedy:  # each batched row decodes exactly what the target alone does
        out = model.generate(torch.from_numpy(tokens[None, :plen]), max_new_tokens=config.max_new_tokens, do_sample=False,
                             eos_token_id=[2], pad_token_id=2)
        assert out[0].tolist() == tokens.tolist()
    before = {f.name: np.load(f)["tokens"].copy() for f in files}
    shard_path(tmp_path / "corpus", 1).unlink()  # a run killed before shard 1 was written
    again = generate_corpus(config)
    assert again.shards_total == 1 and again.shards_done == 1
    after = {f.name: np.load(f)["tokens"] for f in sorted((tmp_path / "corpus").glob("shard-*.npz"))}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    assert generate_corpus(config).shards_total == 0  # complete: nothing to do
    with pytest.raises(BuildSpecError, match="other settings"):
        generate_corpus(_config(tiny, tmp_path / "corpus", max_new_tokens=7))


def test_two_workers_and_shard_limits(tiny, tmp_path):
    stats = generate_corpus(_config(tiny, tmp_path / "c2", workers=2, max_shards=2, sampled_share=0.0))
    assert stats.shards_done == 2 and len(list((tmp_path / "c2").glob("shard-*.npz"))) == 2
    assert stats.positions == corpus_positions(tmp_path / "c2") > 0
    with pytest.raises(BuildSpecError):
        CorpusConfig(target="x", out_dir="y", rows=0)


def test_prompt_set_is_varied_deterministic_and_free_of_held_out_prompts():
    config = PromptSetConfig(size=300, seed=3)
    prompts = build_prompt_set(config)
    assert len(prompts) >= 280 and {p["kind"] for p in prompts} == {"chat", "docs", "code"}
    assert prompts == build_prompt_set(config)
    banned, topics = heldout_texts(), heldout_topics()
    assert banned and topics  # the held-out sets were read
    for p in prompts:
        key = _norm(p["prompt"])
        assert key not in banned
        if p["kind"] == "chat":  # the seed topics the held-out prompts are about are not used
            assert not any(f" {_norm(t)} " in f" {key} " for t in topics), p
    assert len({_norm(p["prompt"]) for p in prompts}) == len(prompts)


def test_over_long_prompts_keep_their_head_and_the_assistant_opener():
    from builder.train.eagle_corpus import _clip

    ids = list(range(100))
    assert _clip(ids, 200) == ids
    clipped = _clip(ids, 20)
    assert len(clipped) == 20 and clipped[:12] == ids[:12] and clipped[-8:] == ids[-8:]


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):  # enough layers for the default EAGLE-3 capture set (1, 2, 2)
    from build_fixtures import make_tiny_llama
    from triton_backend.core.reference_model import ensure_reference_model

    return make_tiny_llama(tmp_path_factory.mktemp("tiny6"), ensure_reference_model(), hidden=32, layers=6, heads=4,
                           kv_heads=2, intermediate=64)


def _contents(file) -> list:
    """A shard's or feature file's arrays as plain lists (comparable across rewrites)."""
    if file.suffix == ".npz":
        with np.load(file) as z:
            return [z[k].tolist() for k in sorted(z.files)]
    rec = torch.load(file, weights_only=True)
    return [rec["layers"], rec["prompt_lengths"].tolist()] + [[t.tolist() for t in rec[k]]
                                                             for k in ("tokens", "features", "top1")]


def test_features_captured_in_the_generation_passes_equal_prefill_and_resume(tiny6, tmp_path):
    """``features=eagle3``: each shard's feature file holds, for every prompt and response
    position, what the batched prefill (eagle-features) computes for the same sequence; the
    tokens are those of a run without capture; a run killed between a feature file and its
    token shard, or before both, resumes to the same files; the trainer's resolution keeps
    stored files and prefills only the shards without one."""
    from transformers import AutoModelForCausalLM

    from builder.train.eagle_features import capture_layers_for, feature_files, prefill_features

    config = _config(tiny6, tmp_path / "cap", features="eagle3")
    stats = generate_corpus(config)
    plain = generate_corpus(_config(tiny6, tmp_path / "plain"))
    assert stats.positions == plain.positions > 0  # the closing pass of a finished row is no generated position
    for name in ("shard-00000.npz", "shard-00001.npz", "shard-00002.npz"):
        assert np.array_equal(np.load(tmp_path / "cap" / name)["tokens"], np.load(tmp_path / "plain" / name)["tokens"])
    assert not list((tmp_path / "plain").glob("feat-*.pt"))
    model = AutoModelForCausalLM.from_pretrained(tiny6, dtype=torch.float32).eval()
    layers = capture_layers_for(model, None)
    files = sorted((tmp_path / "cap").glob("feat-*.pt"))
    assert len(files) == 3
    worst, seen = 0.0, 0
    for file in files:
        rec = torch.load(file, weights_only=True)
        assert tuple(rec["layers"]) == layers
        seqs = [t.numpy() for t in rec["tokens"]]
        for (want_f, want_t), feats, top1 in zip(prefill_features(model, seqs, layers), rec["features"], rec["top1"]):
            assert feats.dtype == torch.float16 and feats.shape == want_f.shape == (len(top1), 3 * 32)
            worst = max(worst, float((feats.float() - want_f.float()).abs().max()))
            assert top1.tolist() == want_t.tolist()
            seen += 1
    assert seen == len(PROMPTS) and worst < 1e-3, worst  # float16 storage of two float32 forwards
    before = {f.name: _contents(f) for f in sorted((tmp_path / "cap").iterdir()) if f.suffix in (".npz", ".pt")}
    shard_path(tmp_path / "cap", 1).unlink()  # killed after shard 1's feature file, before its token shard
    shard_path(tmp_path / "cap", 2).unlink()  # killed before shard 2's files
    (tmp_path / "cap" / "feat-00002.pt").unlink()
    again = generate_corpus(config)
    assert again.shards_done == 2
    after = {f.name: _contents(f) for f in sorted((tmp_path / "cap").iterdir()) if f.suffix in (".npz", ".pt")}
    assert after == before  # nothing lost, nothing twice: the same tokens and features
    (tmp_path / "cap" / "feat-00001.pt").unlink()  # a shard without stored features: the trainer prefills it
    stored = (tmp_path / "cap" / "feat-00000.pt").stat().st_mtime_ns
    resolved = feature_files(str(tiny6), str(tmp_path / "cap"))
    assert [f.name for f in resolved] == ["feat-00000.pt", "feat-00001.pt", "feat-00002.pt"]
    assert (tmp_path / "cap" / "feat-00000.pt").stat().st_mtime_ns == stored
    rec = torch.load(tmp_path / "cap" / "feat-00001.pt", weights_only=True)
    assert [len(t) for t in rec["tokens"]] == [len(f) for f in rec["features"]]
    with pytest.raises(BuildSpecError, match="features must be"):
        _config(tiny6, tmp_path / "x", features="eagle9")
    with pytest.raises(BuildSpecError, match="capture_layers"):
        _config(tiny6, tmp_path / "x", capture_layers=(1, 2))
    from builder.cli.main import main as cli_main

    assert cli_main(["eagle-data", "--out", str(tmp_path / "x"), "--features", "eagle3", "--headline"]) == 2
    assert cli_main(["eagle-data", "--out", str(tmp_path / "x"), "--capture-layers", "1,x"]) == 2
    assert not (tmp_path / "x").exists()


def test_committed_corpus_summary_is_current():
    """artifacts/eagle-corpus/summary.json is what `specbuild eagle-corpus-summary` counts now."""
    import json
    from pathlib import Path

    from builder.train.eagle_corpus import HELDOUT_FOLDERS, corpus_tree_summary

    root = Path(__file__).resolve().parents[1] / "artifacts" / "eagle-corpus"
    summary = corpus_tree_summary(root)
    assert summary["folders"] == json.loads((root / "summary.json").read_text())
    assert set(HELDOUT_FOLDERS) <= set(summary["folders"])
    assert summary["training_positions"] == sum(e["generated_positions"] for name, e in summary["folders"].items()
                                                if name not in HELDOUT_FOLDERS)
