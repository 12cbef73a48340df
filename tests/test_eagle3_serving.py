"""EAGLE-3 drafters served: the slot engine returns the capture layers' outputs from its own
pass (Hugging Face's ``hidden_states[i + 1]``, logits unchanged bit for bit); greedy output
with an EAGLE-3 drafter is plain greedy's, token for token, single and batched, chains and
trees; sampling keeps the target's distribution; every served draft's first token is what
the training-time-test forward (``builder.train.eagle3.ttt_forward``, step 0) predicts from
the same features; deployments tell EAGLE-3 folders from EAGLE-1 files by their config."""

from __future__ import annotations

import json
from typing import Any, Sequence

import pytest
import torch

from conftest import tiny_engine
from test_eagle import _exact_joint, _sample_pairs
from test_eagle_serving import ProposalLog, _scheduled, scripted_draft_lengths
from test_scheduler import submit_all
from builder.train.eagle3 import ttt_forward
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SamplingParams,
                                        SpeculationConfig, SpeculationMode)
from triton_backend.core.drafter_format import EagleFormat, detect_eagle_format
from triton_backend.core.errors import ConfigError, ModelLoadError
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.engines.batch import BatchRow
from triton_backend.speculation.drafters.eagle import EagleDrafter
from triton_backend.speculation.drafters.eagle3 import Eagle3Drafter
from triton_backend.speculation.drafters.eagle3_model import Eagle3Info, Eagle3Net, save_eagle3
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

LAYERS = (0, 2, 3)  # capture layers of the tiny 4-layer targets


def _net(config: Any, *, seed: int = 0, scale: float = 0.3, draft: torch.Tensor | None = None,
         layers: Sequence[int] | None = LAYERS) -> Eagle3Net:
    """A random EAGLE-3 net for a target config (``draft``: the draft vocabulary's target ids)."""
    vocab = int(config.vocab_size)
    ids = torch.arange(vocab) if draft is None else draft
    info = Eagle3Info.from_target_config(config, len(ids), tuple(layers) if layers else None)
    torch.manual_seed(seed)
    net = Eagle3Net(info)
    net.set_vocab(ids)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn_like(p))
    return net.eval()


def _drafter(target: Any, **kwargs: Any) -> Eagle3Drafter:
    drafter = Eagle3Drafter(_net(target.model.config, **kwargs), target)
    drafter.relative_cost = 0.01  # as cheap as a real drafter (here it is as big as the tiny target)
    return drafter


def _decoder(target: Any, drafter: Any, tokenizer: Any = None) -> SpeculativeDecoder:
    return SpeculativeDecoder(target, tokenizer, drafters={} if drafter is None else {SpeculationMode.EAGLE: drafter})


def _spec(k: int = 3, *, tree: bool, fallback: FallbackConfig | None = None) -> SpeculationConfig:
    eagle = EagleConfig(tree=True, max_tree_nodes=8, tree_top_k=3) if tree else EagleConfig(tree=False)
    return SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=fallback or FallbackConfig(enabled=False), eagle=eagle)


def _hf_features(model: Any, tokens: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """The capture layers' outputs of ``tokens`` in one Hugging Face forward: ``[n, len(layers) * H]``."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([list(tokens)]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layers], -1)


# -- the engine ----------------------------------------------------------------------------------


def test_capture_layers_are_hf_hidden_states_and_leave_logits_unchanged():
    engine = tiny_engine(0, layers=4)
    tokens, tree = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]
    a, b = engine.allocate(), engine.allocate()
    try:
        rows = [BatchRow(a, 0, tokens, num_logits=len(tokens), return_hidden=True),
                BatchRow(b, 0, tokens[:5] + tree, num_logits=4, tree_parents=[-1, 0, -1], return_hidden=True)]
        plain = engine.forward(rows)
        captured = engine.forward([BatchRow(a, 0, tokens, num_logits=len(tokens), return_hidden=True, capture=(3, 0, 2)),
                                   rows[1]])
        assert torch.equal(plain[0].logits, captured[0].logits) and torch.equal(plain[0].hidden, captured[0].hidden)
        assert torch.equal(plain[1].logits, captured[1].logits) and plain[1].features is None
        assert captured[1].features is None and captured[0].features.shape == (len(tokens), 3 * 32)
        assert torch.allclose(captured[0].features, _hf_features(engine.model, tokens, (3, 0, 2)), atol=1e-5)
        with pytest.raises(ValueError):
            engine.forward([BatchRow(a, 0, tokens, capture=(4,))])
    finally:
        engine.release(a)
        engine.release(b)


# -- greedy exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
def test_greedy_identical_to_plain_single_and_batched(tree, reduced):
    target = tiny_engine(0, layers=4)
    drafter = _drafter(target, draft=torch.arange(0, 32, 3) if reduced else None)
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2], [30, 3, 30, 3, 30])
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    for fallback in (FallbackConfig(enabled=False), FallbackConfig(prior_acceptance=0.9)):
        spec = _spec(3, tree=tree, fallback=fallback)
        alone = [decoder.generate(p, params, spec) for p in prompts]
        assert [r.token_ids for r in alone] == plain
        assert sum(r.stats.drafted_tokens for r in alone) > 0
        assert _scheduled(decoder, prompts, params, spec, batch=2) == plain


def test_auto_rounds_mixing_ngram_matches_and_eagle3_stay_exact():
    """``auto``: rounds the n-gram match drafts still hand the EAGLE-3 drafter its features."""
    from triton_backend.speculation.drafters.ngram import NgramDrafter

    target = tiny_engine(0, layers=4)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.EAGLE: _drafter(target),
                                                         SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = ([30, 3, 30, 3, 30, 3], [5, 9, 9, 4, 1, 7, 2, 5, 9, 9])
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    spec = SpeculationConfig(method="auto", draft_length=DraftLengthConfig(num_draft_tokens=3),
                             fallback=FallbackConfig(prior_acceptance=0.9))
    results = [decoder.generate(p, params, spec) for p in prompts]
    assert [r.token_ids for r in results] == plain and sum(r.stats.drafted_tokens for r in results) > 0
    assert _scheduled(decoder, prompts, params, spec, batch=2) == plain


def test_scheduler_drafts_every_eagle3_row_in_one_call(monkeypatch):
    target = tiny_engine(0, layers=4)
    decoder = _decoder(target, _drafter(target, seed=5, scale=0.15))
    requests = []
    for i, prompt in enumerate(([1, 2, 3], [5, 9, 9, 4, 1, 7, 2], [30, 3, 30, 3, 30], [7, 7, 1])):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=20, temperature=0.9 if sampling else 0.0, seed=40 + i if sampling else None,
                                ignore_eos=True)
        requests.append((prompt, params, _spec(3, tree=i < 2)))
    alone = [decoder.generate(p, params, spec).token_ids for p, params, spec in requests]
    calls: list[int] = []
    propose_trees = Eagle3Drafter.propose_trees

    def spy(self, sessions, *args):
        calls.append(len(sessions))
        return propose_trees(self, sessions, *args)

    monkeypatch.setattr(Eagle3Drafter, "propose_trees", spy)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4, policy="per_request"))
    try:
        assert [c.tokens() for c in submit_all(scheduler, requests)] == alone
        assert max(calls) > 1 and len(calls) <= scheduler.rounds  # rows drafted together, one call a round
    finally:
        scheduler.shutdown()


# -- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("params,reduced", [(dict(temperature=1.0), False), (dict(temperature=0.8, top_k=4), True)])
def test_sampling_matches_target_distribution(tree, params, reduced):
    """The next 2 tokens through EAGLE-3 rounds follow the target's exact joint law (total
    variation bound, fixed seeds); ``q`` is the drafter's over target ids, zero off the draft
    vocabulary in the reduced case."""
    target = tiny_engine(10, vocab=8, layers=3)
    drafter = _drafter(target, scale=0.5, draft=torch.tensor([0, 2, 3, 5, 6]) if reduced else None, layers=(0, 1, 2))
    decoder = _decoder(target, drafter)
    prompt = [1, 2, 1, 3, 1]
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    spec = _spec(2, tree=tree)
    tv, impossible, drafted = _sample_pairs(decoder, prompt, params, spec, exact)
    assert drafted > 0
    assert tv < 0.07, tv  # sampling noise at n=2000 over <=64 outcomes is ~0.04
    assert not impossible


# -- serving == training-time measurement --------------------------------------------------------


def assert_first_drafts_are_ttt_step0(log: ProposalLog, net: Eagle3Net, model: Any, finals: Sequence[Sequence[int]],
                                      features: Any = _hf_features, margin: float = 0.0) -> int:
    """Each logged round's first draft after ``tokens`` is the argmax of ``ttt_forward``'s step 0
    at position ``len(tokens) - 2`` over the final text's features (mapped by ``d2t``); rounds
    whose top two logits lie within ``margin`` are skipped. Returns the rounds checked."""
    embed = model.get_input_embeddings().weight.detach().float()
    layers = net.info.capture_layers
    per_final = []
    for final in finals:
        feats = features(model, final, layers).float()[None]
        nxt = torch.tensor([list(final[1:]) + [0]])
        with torch.no_grad():
            per_final.append(ttt_forward(net, embed, feats, nxt, 1)[0][0])  # [n, draft_vocab]
    checked = 0
    assert log.rounds
    for tokens, _, drafts in log.rounds:
        owner = next(i for i, f in enumerate(finals) if list(f[: len(tokens)]) == list(tokens))
        logits = per_final[owner][len(tokens) - 2]
        top = logits.topk(2).values
        if float(top[0] - top[1]) <= margin:
            continue
        assert int(net.draft_to_target(logits.argmax())) == drafts[0], f"round after {len(tokens)} tokens"
        checked += 1
    log.rounds.clear()
    return checked


def test_served_first_drafts_equal_the_training_forward(monkeypatch):
    """Single loop and scheduler, chains and trees, with pauses: the first draft of every
    round equals ``ttt_forward`` step 0 from the features of the committed text."""
    target = tiny_engine(0, layers=4)
    net = _net(target.model.config, draft=torch.arange(1, 32, 2))
    drafter = Eagle3Drafter(net, target)
    decoder = _decoder(target, drafter)
    prompts = ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2], [30, 3, 30, 3, 30])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    finals = [list(p) + list(o) for p, o in zip(prompts, plain)]
    scripted_draft_lengths(monkeypatch, [3, 0, 0, 2, 0, 0, 0, 1, 3, 0, 3])
    log = ProposalLog(monkeypatch)
    monkeypatch.setattr(Eagle3Drafter, "propose_trees", EagleDrafter.propose_trees)  # the log spies on the family's
    for tree in (False, True):
        spec = _spec(3, tree=tree)
        assert [decoder.generate(p, params, spec).token_ids for p in prompts] == plain
        assert assert_first_drafts_are_ttt_step0(log, net, target.model, finals) > 5
        assert _scheduled(decoder, prompts, params, spec, batch=2) == plain
        assert assert_first_drafts_are_ttt_step0(log, net, target.model, finals) > 5


# -- deployment ----------------------------------------------------------------------------------


def test_deployment_tells_eagle3_folders_from_eagle1_files(tmp_path):
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.speculation.drafters.eagle_model import EagleInfo, EagleNet, save_eagle

    target = tiny_engine(0, layers=6)
    folder = save_eagle3(tmp_path / "e3", _net(target.model.config, layers=None), dtype=torch.float32)
    assert detect_eagle_format(folder) is EagleFormat.EAGLE3
    eagle1 = save_eagle(tmp_path / "e1" / "eagle.safetensors", EagleNet(EagleInfo.from_target_config(target.model.config)))
    assert detect_eagle_format(eagle1) is EagleFormat.EAGLE1 and detect_eagle_format(eagle1.parent) is EagleFormat.EAGLE1
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError):
        detect_eagle_format(tmp_path / "other")
    config = DeploymentConfig.from_dict({"eagle": str(folder)})
    assert config.eagle_format is None and config.resolved_eagle_format() is EagleFormat.EAGLE3
    assert DeploymentConfig.from_dict(json.loads(
        DeploymentConfig(eagle=str(folder), eagle_format=EagleFormat.EAGLE3).to_json())).eagle_format is EagleFormat.EAGLE3
    with pytest.raises(ConfigError):
        DeploymentConfig.from_dict({"eagle": str(folder), "eagle_format": "eagle2"})
    drafter = Eagle3Drafter.from_folder(str(folder), target)  # capture layers: the default set of a 6-layer target
    assert drafter.capture_layers == (1, 2, 2)
    with pytest.raises(ModelLoadError):
        Eagle3Drafter.from_folder(str(folder), tiny_engine(0, layers=6, hidden=48))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_drafter_file_is_served_in_its_own_precision(tmp_path, dtype):
    """A drafter stored in 16 bits runs its linears on the compact-weight kernel with those values
    (half the bytes of float32 a step reads); a float32 file keeps the row kernel. Drafts stay close
    to the float32 drafter's and the output stays exactly plain decoding's, alone and batched."""
    from triton_backend.engines.torch.weight_gemm import load_weight_gemm

    target = tiny_engine(0, layers=4)
    if target.forward_impl.kernel is None or load_weight_gemm() is None:
        pytest.skip("needs the row and compact-weight CPU kernels (x86-64 with AVX2 + FMA)")
    net = _net(target.model.config, scale=0.1)
    half = Eagle3Drafter.from_folder(str(save_eagle3(tmp_path / "half", net, dtype=dtype)), target)
    full = Eagle3Drafter.from_folder(str(save_eagle3(tmp_path / "full", net, dtype=torch.float32)), target)
    assert half._step is not None and half._step.name.startswith("weight_gemm")
    assert full._step is not None and full._step.name.startswith("row_gemm")
    assert "weight_gemm" in half.cost_identity() and str(dtype).removeprefix("torch.") in half.cost_identity()
    assert "weight_gemm" not in full.cost_identity()
    g = torch.randn(3, net.info.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(half._small_logits(g), full._small_logits(g), atol=0.05, rtol=0.05)
    half.relative_cost = 0.01
    assert_exact_chains_and_trees(target, half)


def assert_exact_chains_and_trees(target: Any, drafter: Eagle3Drafter) -> None:
    """Greedy output with ``drafter``'s chains and trees is plain decoding's, alone and through the batch scheduler."""
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2])
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    for tree in (False, True):
        spec = _spec(3, tree=tree)
        assert [decoder.generate(p, params, spec).token_ids for p in prompts] == plain
        assert _scheduled(decoder, prompts, params, spec, batch=2) == plain


def test_run_cli_serves_an_eagle3_folder(tmp_path):
    """``specbuild run --eagle DIR`` on a folder ``train-eagle3`` wrote: the EAGLE-3 drafter
    drafts and the output is plain greedy's."""
    from build_fixtures import make_tiny_llama
    from builder.ops.local_run import LocalRunConfig, add_run_arguments, run_local
    from triton_backend.core.reference_model import ensure_reference_model
    import argparse

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), hidden=64, layers=6, intermediate=128)
    from transformers import AutoConfig

    folder = save_eagle3(tmp_path / "drafter", _net(AutoConfig.from_pretrained(tiny), layers=None, scale=0.1,
                                                    draft=torch.arange(0, 49152, 7)))
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    common = ["--target", str(tiny), "--raw", "--prompt", "one two three", "--max-tokens", "12", "--no-fallback"]
    spec = LocalRunConfig.from_args(parser.parse_args(common + ["--eagle", str(folder), "--speculation", "eagle"]))
    assert spec.deployment.eagle_format is EagleFormat.EAGLE3
    plain = LocalRunConfig.from_args(parser.parse_args(common + ["--speculation", "off"]))
    out, base = run_local(spec), run_local(plain)
    assert out.token_ids == base.token_ids and out.stats.drafted_tokens > 0 and out.stats.method == "eagle"


def test_eval_eagle_and_the_bench_measure_an_eagle3_folder(tmp_path):
    """``specbuild eval-eagle`` and ``specbuild bench --eagle`` take an EAGLE-3 folder as they take
    an EAGLE-1 file: the held-out acceptance figures go to the headline file asked for, the
    reports name the drafter and its format, the bench's EAGLE rows are exact and give
    ``eagle_chat_x_plain``."""
    from build_fixtures import make_tiny_llama
    from builder.bench.config import BenchConfig
    from builder.bench.report import summarize, to_markdown
    from builder.bench.runner import run_bench
    from builder.cli.main import main as cli_main
    from builder.train.eagle_job import eagle_bench_headline
    from triton_backend.core.reference_model import ensure_reference_model
    from transformers import AutoConfig

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), hidden=64, layers=6, intermediate=128)
    folder = save_eagle3(tmp_path / "drafter", _net(AutoConfig.from_pretrained(tiny), layers=None, scale=0.1,
                                                    draft=torch.arange(0, 49152, 7)))
    (tmp_path / "held.txt").write_text("Say hi.\nName a colour.\n")
    assert cli_main(["eval-eagle", "--eagle", str(folder), "--target", str(tiny), "--eval-prompts",
                     str(tmp_path / "held.txt"), "--eval-count", "2", "--eval-max-tokens", "8",
                     "--headline", str(tmp_path / "h.json")]) == 0
    report = json.loads((folder / "acceptance.json").read_text())
    assert report["format"] == "eagle3" and report["drafter"].endswith("/drafter") and report["prompts"] == 2
    assert report["drafted_tokens"] > 0 and 1 <= len(report["per_position"]) <= 3
    assert set(json.loads((tmp_path / "h.json").read_text())) == {"eagle_acceptance_pos1", "eagle_tokens_per_pass"}
    config = BenchConfig(target=str(tiny), eagle=str(folder), workloads=("chat",), prompts_per_workload=1, max_tokens=8,
                         repeats=1, ngram_k=(4,), peer=False, plot=False, out_dir=tmp_path, label="t")
    run = run_bench(config)
    eagle_rows = [r for r in run.rows if run.row_info[r].get("method") == "eagle"]
    assert eagle_rows and all(run.row_info[r]["eagle_format"] == "eagle3" for r in eagle_rows)
    summary = summarize(run)
    assert all(e["identical_to_plain"] for e in summary["rows"] if e["row"] in eagle_rows)
    assert "(eagle3)" in to_markdown(summary)
    assert set(eagle_bench_headline(summary, tmp_path / "h.json")) == {"eagle_chat_x_plain"}


# -- the reference model -------------------------------------------------------------------------


def _prefill(model: Any, tokens: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """``eagle-features``' own computation (``prefill_features``): ``[n, 3H]`` float16."""
    import numpy as np

    from builder.train.eagle_features import prefill_features

    return prefill_features(model, [np.array(tokens)], tuple(layers))[0][0]


def _trained_net(model: Any, finals: Sequence[Sequence[int]], prompt_lengths: Sequence[int], steps: int = 60) -> Eagle3Net:
    """An EAGLE-3 net trained for a few steps (``ttt_loss``, 2 training-time-test steps) on the
    target's own greedy answers ``finals``, from the features ``prefill_features`` makes:
    on those answers it drafts well, so serving them accepts drafts."""
    from builder.train.eagle3 import ttt_loss

    draft = torch.unique(torch.cat([torch.arange(0, int(model.config.vocab_size), 12)] +
                                   [torch.tensor(list(f)) for f in finals]))
    net = _net(model.config, layers=None, scale=0.0, draft=draft).train()
    embed = model.get_input_embeddings().weight.detach().float()
    width = max(len(f) for f in finals)
    feats = torch.zeros(len(finals), width, net.info.feature_size)
    nxt = torch.zeros(len(finals), width, dtype=torch.long)
    labels = torch.full((len(finals), width), -1, dtype=torch.long)
    for b, (final, plen) in enumerate(zip(finals, prompt_lengths)):
        n = len(final)
        feats[b, :n] = _prefill(model, final, net.info.capture_layers).float()
        nxt[b, :n - 1] = torch.tensor(list(final[1:]))
        labels[b, max(0, plen - 2):n - 2] = net.target_to_draft(torch.tensor(list(final[max(2, plen):])))  # top1 at j + 1
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        ttt_loss(net, embed, feats, nxt, labels, 2, 0.8).backward()
        opt.step()
    return net.eval()


@pytest.mark.slow
def test_reference_target_with_a_quickly_trained_eagle3_drafter(reference, reference_prompts, monkeypatch):
    """SmolLM2-135M-Instruct with an EAGLE-3 drafter trained for a few steps (the default
    capture layers, a reduced draft vocabulary): greedy output is plain greedy's, single and
    batched, chains and trees, with drafts accepted; every round's first draft is
    ``ttt_forward``'s step 0 over the features ``prefill_features`` makes (the training
    pipeline's own): training-time measurement == serving."""
    engine, tokenizer = reference
    decoder = _decoder(engine, None, tokenizer)
    prompts = [decoder.encode(p) for p in reference_prompts[:2]]
    params = SamplingParams(max_tokens=24)
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    finals = [list(p) + list(o) for p, o in zip(prompts, plain)]
    net = _trained_net(engine.model, finals, [len(p) for p in prompts])
    assert net.info.capture_layers == (1, 14, 26) and net.info.draft_vocab_size < engine.vocab_size
    decoder = _decoder(engine, Eagle3Drafter(net, engine), tokenizer)
    log = ProposalLog(monkeypatch)
    monkeypatch.setattr(Eagle3Drafter, "propose_trees", EagleDrafter.propose_trees)
    checked, accepted = 0, 0
    for tree in (False, True):
        spec = _spec(3, tree=tree)
        results = [decoder.generate(p, params, spec) for p in prompts]
        assert [r.token_ids for r in results] == plain
        accepted += sum(r.stats.accepted_tokens for r in results)
        assert _scheduled(decoder, prompts, params, spec, batch=2) == plain
        checked += assert_first_drafts_are_ttt_step0(log, net, engine.model, finals, _prefill, margin=0.05)
    assert checked > 10 and accepted > 10


@pytest.mark.slow
def test_eagle3_through_a_real_triton_server(tmp_path):
    """A deployment naming an EAGLE-3 folder, served by a real Triton server: concurrent gRPC
    streams (greedy and seeded sampling; chain and tree rounds) equal each request served
    alone in-process, and the server's rows really drafted with the EAGLE-3 drafter."""
    from triton_fixtures import running_triton
    from test_batched_serving import _concurrently
    from builder.ops.triton_client import GenerateRequest
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.serving.interface import ServingConfig
    from triton_backend.serving.service import parse_request
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ensure_reference_model())
    folder = save_eagle3(tmp_path / "eagle3", _net(config, layers=None, scale=0.02, draft=torch.arange(0, 49152, 12)))
    deployment = DeploymentConfig(eagle=str(folder), ngram=False, speculation=_spec(3, tree=True))
    serving = ServingConfig(max_batch_size=4, max_queue_size=8, default_max_tokens=12)
    decoder = build_decoder(deployment)
    assert isinstance(decoder.drafters[SpeculationMode.EAGLE], Eagle3Drafter)
    prompts = ["What is the capital of France?", "List three benefits of regular exercise.",
               "Write a haiku about the ocean."]
    requests = [GenerateRequest(prompt=p, max_tokens=12, temperature=0.8 if i == 2 else None, seed=7 if i == 2 else None,
                                speculation="eagle", chat=True, stream=True) for i, p in enumerate(prompts)]

    def alone(request: GenerateRequest) -> Any:
        parsed = parse_request(request.arrays(), deployment.speculation, serving.default_max_tokens)
        prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": parsed.prompt}],
                                                       add_generation_prompt=True, tokenize=False)
        return decoder.generate(prompt, parsed.sampling, parsed.speculation)

    expected = [alone(r) for r in requests]
    with running_triton(tmp_path / "server", deployment, serving) as running:
        results = _concurrently(running, requests)
    for request, result, want in zip(requests, results, expected):
        assert not isinstance(result, Exception), result
        assert result.text == want.text, request.prompt
        assert result.stats["speculation_method"] == "eagle" and result.stats["total_draft_tokens"] > 0
