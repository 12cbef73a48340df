"""EAGLE drafting: the drafter's file, its batched core, the loop's exactness (greedy token
for token, sampling in distribution with the drafter's q), a training smoke run on a tiny
target, and greedy exactness on the real model with the committed reference drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_engine
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.eagle import EagleDrafter
from triton_backend.speculation.drafters.eagle_model import EagleCheckpoint, EagleInfo, EagleNet, load_eagle, save_eagle
from triton_backend.core.errors import ModelLoadError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor

REFERENCE_DRAFTER = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-eagle"


def _random_drafter(target, seed: int = 0, scale: float = 0.3, vocab: torch.Tensor | None = None) -> EagleDrafter:
    torch.manual_seed(seed)
    net = EagleNet(EagleInfo.from_target_config(target.model.config))
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, scale)
    return EagleDrafter(EagleCheckpoint(net.eval(), vocab), target)


def _decoder(target, drafter) -> SpeculativeDecoder:
    return SpeculativeDecoder(target, None, drafters={SpeculationMode.EAGLE: drafter})


def test_file_round_trip_and_bad_files(tmp_path):
    target = tiny_engine(0)
    drafter = _random_drafter(target, vocab=torch.arange(0, 32, 2))
    path = save_eagle(tmp_path / "eagle.safetensors", drafter.net, drafter.vocab, dtype=torch.float32)
    loaded = load_eagle(tmp_path)  # a folder holding eagle.safetensors
    assert loaded.info == drafter.info
    assert torch.equal(loaded.candidate_vocab, drafter.vocab)
    for name, tensor in drafter.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[name], tensor), name
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError):
        load_eagle(path)
    with pytest.raises(ModelLoadError):
        load_eagle(tmp_path / "missing.safetensors")


def test_batched_core_equals_rows_alone():
    """Ragged rows in one draft_chain call give each row what it gets alone (the scheduler's contract)."""
    target = tiny_engine(0)
    drafter = _random_drafter(target)
    hidden = target.model.config.hidden_size
    torch.manual_seed(1)
    counts = [5, 2, 3]
    feats = [torch.randn(c, hidden) for c in counts]
    toks = [torch.randint(0, 32, (c,)) for c in counts]
    greedy = [LogitsProcessor()] * 3
    alone = []
    for f, t in zip(feats, toks):
        kv = drafter.new_cache(1, 4)
        d, _ = drafter.draft_chain(kv, torch.tensor([0]), f[None], t[None], torch.tensor([len(t)]), 3, greedy[:1], [None])
        alone.append(d[0])
    width = max(counts)
    pad_f = torch.zeros(3, width, hidden)
    pad_t = torch.zeros(3, width, dtype=torch.long)
    for i, (f, t) in enumerate(zip(feats, toks)):
        pad_f[i, :len(t)], pad_t[i, :len(t)] = f, t
    kv = drafter.new_cache(5, 4)  # one cache row per engine slot; these rows live in slots 4, 0, 2
    batched, q = drafter.draft_chain(kv, torch.zeros(3, dtype=torch.long), pad_f, pad_t, torch.tensor(counts), 3,
                                     greedy, [None] * 3, slots=torch.tensor([4, 0, 2]))
    assert q is None
    for i in range(3):
        assert torch.equal(batched[i], alone[i])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("candidates", [False, True])
def test_greedy_identical_to_plain(k, candidates):
    target = tiny_engine(0)
    vocab = torch.arange(0, 32, 3) if candidates else None
    decoder = _decoder(target, _random_drafter(target, vocab=vocab))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2]):
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spec = decoder.generate(prompt, params, SpeculationConfig(method="eagle",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=k), fallback=FallbackConfig(enabled=False)))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted_tokens > 0 and spec.stats.method == "eagle"
        assert spec.stats.target_passes < 40  # every round verified in one pass


def test_fallback_rounds_keep_features_in_step():
    """With the default gain rule a poor drafter is paused (plain rounds) and probed again: the
    features of the plain rounds are kept for the next proposal, output stays exact."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=3)
    drafter.relative_cost = 0.01  # as cheap as a real drafter on a real target (here it is as big as the target)
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = decoder.generate([4, 8, 15], params, SpeculationConfig(method="off"))
    spec = decoder.generate([4, 8, 15], params, SpeculationConfig(method="eagle",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(probe_interval=2, prior_acceptance=0.9)))
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.stats.speculative_rounds < spec.stats.target_passes  # some rounds drafted, some did not


def test_constant_drafter_stats_add_up():
    """A drafter with zero weights guesses one constant feature: few accepts, but the loop
    stays exact in length and counts drafted positions consistently."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, scale=0.0)
    decoder = _decoder(target, drafter)
    res = decoder.generate([1, 2, 3], SamplingParams(max_tokens=30), SpeculationConfig(method="eagle",
                                                                                       draft_length=DraftLengthConfig(num_draft_tokens=2), fallback=FallbackConfig(enabled=False)))
    stats = res.stats
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert sum(stats.drafted_per_position) == stats.drafted_tokens
    assert len(res.token_ids) == 30


def _sample_pairs(decoder, prompt, params, spec, exact, n=2000):
    """``n`` seeded samples' first two tokens against the exact joint ``exact``: the total-variation
    distance, the outcomes ``exact`` gives no mass, and the tokens drafted."""
    counts: dict = {}
    drafted = 0
    for seed in range(n):
        result = decoder.generate(prompt, SamplingParams(max_tokens=3, seed=seed, **params), spec)
        key = tuple(result.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        drafted += result.stats.drafted_tokens
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts))
    return tv, set(counts) - set(exact), drafted


def _exact_joint(target, prompt, horizon, processor):
    dist = {(): 1.0}
    for _ in range(horizon):
        nxt = {}
        for seq, mass in dist.items():
            with torch.inference_mode():
                logits = target.model(torch.tensor([list(prompt) + list(seq)])).logits[0, -1:]
            probs = processor.probs(logits)[0]
            for tok in range(target.vocab_size):
                if probs[tok] > 0:
                    nxt[seq + (tok,)] = mass * float(probs[tok])
        dist = nxt
    return dist


@pytest.mark.parametrize("params,candidates", [(dict(temperature=1.0), False), (dict(temperature=0.8, top_k=4), True)])
def test_sampling_matches_target_distribution(params, candidates):
    """Samples of the next 2 tokens through EAGLE rounds follow the target's exact joint
    distribution (total variation bound, fixed seeds); q is the drafter's (on a candidate
    subset of the vocabulary in the second case)."""
    target = tiny_engine(10, vocab=8)
    drafter = _random_drafter(target, scale=0.5, vocab=torch.tensor([0, 2, 3, 5, 6]) if candidates else None)
    decoder = _decoder(target, drafter)
    prompt = [1, 2, 1, 3, 1]
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    spec = SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=2),
                             fallback=FallbackConfig(enabled=False))
    tv, impossible, drafted = _sample_pairs(decoder, prompt, params, spec, exact)
    assert drafted > 0
    assert tv < 0.07, tv  # sampling noise at n=2000 over <=64 outcomes is ~0.04
    assert not impossible


@pytest.mark.slow
def test_training_smoke_on_tiny_target(tmp_path):
    """Target data with hidden states from a tiny Llama, a few training steps, a drafter file
    the runtime serves with greedy output identical to plain."""
    from build_fixtures import make_tiny_llama
    from builder.train.eagle import EagleTrainConfig, train_eagle
    from builder.train.target_data import TargetDataConfig, generate_target_data
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.core.reference_model import ensure_reference_model

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), hidden=64, layers=2, intermediate=128)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\nCount to three.\nName a colour.\nWhat is two plus two?\n")
    for name in ("data", "held"):
        generate_target_data(TargetDataConfig(target=str(tiny), out_dir=str(tmp_path / name), prompts_file=str(prompts),
                                              max_new_tokens=12, batch_size=4, shard_size=4), progress=False)
    out = tmp_path / "eagle" / "eagle.safetensors"
    report = train_eagle(EagleTrainConfig(target=str(tiny), data_dir=str(tmp_path / "data"),
                                          heldout_dir=str(tmp_path / "held"), out=str(out), candidate_vocab=64,
                                          epochs=3, batch_size=2, time_limit_s=60), progress=False)
    assert report.steps == 6 and out.is_file() and len(report.curve) >= 1
    assert report.losses[-1] < report.losses[0]
    resumed = train_eagle(EagleTrainConfig(target=str(tiny), data_dir=str(tmp_path / "data"),
                                           heldout_dir=str(tmp_path / "held"), out=str(out), candidate_vocab=64,
                                           epochs=3, batch_size=2, time_limit_s=60), progress=False)
    assert resumed.steps == 6  # a finished run resumes to its end: nothing left to train
    decoder = build_decoder(DeploymentConfig(target=str(tiny), eagle=str(out.parent), ngram=False))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = decoder.generate([1, 2, 3, 4], params, SpeculationConfig(method="off"))
    spec = decoder.generate([1, 2, 3, 4], params, SpeculationConfig(method="eagle",
                                                                    draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
    assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0
    from builder.cli.main import main as cli_main

    common = ["--target", str(tiny), "--eval-prompts", str(prompts), "--eval-count", "2", "--eval-max-tokens", "8"]
    assert cli_main(["train-eagle", *common, "--data-dir", str(tmp_path / "data"), "--heldout-data-dir",
                     str(tmp_path / "held"), "--prompts", str(prompts), "--max-new-tokens", "12", "--shard-size", "4",
                     "--epochs", "1", "--batch-size", "2", "--candidate-vocab", "64", "--out", str(tmp_path / "cli"),
                     "--quiet"]) == 0
    report = json.loads((tmp_path / "cli" / "training_report.json").read_text())
    assert report["training"]["steps"] == 2 and report["acceptance"]["drafted_tokens"] > 0
    assert cli_main(["eval-eagle", "--eagle", str(tmp_path / "cli"), "--no-headline", *common]) == 0
    assert json.loads((tmp_path / "cli" / "acceptance.json").read_text())["prompts"] == 2
    from builder.headline import HEADLINE_PATH

    committed = HEADLINE_PATH.read_bytes()  # a drafter other than the committed one: figures go where asked
    assert cli_main(["eval-eagle", "--eagle", str(tmp_path / "cli"), "--headline", str(tmp_path / "h.json"),
                     *common]) == 0
    assert set(json.loads((tmp_path / "h.json").read_text())) == {"eagle_acceptance_pos1", "eagle_tokens_per_pass"}
    assert HEADLINE_PATH.read_bytes() == committed


@pytest.mark.slow
def test_reference_drafter_greedy_identical_to_plain(reference, reference_prompts):
    """The committed drafter on the real SmolLM2-135M-Instruct: token for token the target's
    greedy output, and it really accepts drafts."""
    engine, tokenizer = reference
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.EAGLE: EagleDrafter.from_file(
        str(REFERENCE_DRAFTER), engine)})
    params = SamplingParams(max_tokens=32)
    accepted = 0
    for prompt in reference_prompts[:3]:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spec = decoder.generate(prompt, params, SpeculationConfig(method="eagle",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_planner_counts_the_eagle_nets():
    from builder.errors import BuildSpecError
    from builder.plan.planner import plan_deployment
    from builder.plan.spec import BuildSpec, EagleSpec, GpuTarget, MedusaSpec, ModelSpec

    spec = BuildSpec(target=ModelSpec("llama-3-8b", "bf16"), eagle=EagleSpec(num_eagle_layers=4), gpu=GpuTarget("h100-80gb"))
    plan = plan_deployment(spec)
    nets = plan.model("eagle")
    h, v, inter = 4096, 128256, 14336
    layer = 2 * h * h + h + (2 * h * 32 * 128 + 2 * h * 8 * 128) + 3 * h * inter + h
    assert nets.params == 4 * (layer + 2 * h * v)
    assert nets.footprint.weights == 2 * nets.params  # 16-bit, one GPU
    assert nets.footprint.kv_cache * 32 == plan.model("target").footprint.kv_cache  # one more layer of 32
    lim = spec.limits
    assert nets.footprint.activations == lim.max_batch_size * lim.max_draft_len * v * 4
    with pytest.raises(BuildSpecError, match="EAGLE"):
        BuildSpec(target=ModelSpec("llama-3-8b"), eagle=EagleSpec(), medusa=MedusaSpec())
    assert BuildSpec.from_dict({"target": {"source": "llama-3-8b"}, "eagle": {"num_eagle_layers": 3}}).eagle == EagleSpec(3)


def test_the_drafters_cost_per_token_is_measured_on_this_machine_and_cached(tmp_path, monkeypatch):
    """What the gain rule prices an EAGLE draft token at: the cost measured against the
    target's step (cached per machine and kernel), not the parameter ratio."""
    import triton_backend.speculation.pass_cost as pass_cost
    from triton_backend.speculation.pass_cost import MAX_DRAFT_COST, install_measured_draft_costs

    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: None)  # a quiet machine: cached

    target = tiny_engine(0)
    drafter = _random_drafter(target)
    by_parameters = drafter.relative_cost
    install_measured_draft_costs(target, {SpeculationMode.EAGLE: drafter}, "test", cache_dir=tmp_path)
    assert 0.0 < drafter.relative_cost <= MAX_DRAFT_COST and drafter.relative_cost != by_parameters
    slots = [target.allocate() for _ in range(target.num_slots)]  # the measurement gave its slot back
    for slot in slots:
        target.release(slot)
    (cached,) = (tmp_path / "pass_cost").glob("*.json")
    data = json.loads(cached.read_text())
    assert data["draft_cost"] == drafter.relative_cost
    cached.write_text(json.dumps({**data, "draft_cost": 0.25}))
    again = _random_drafter(target, seed=1)  # the same architecture on the same machine: read, not measured
    install_measured_draft_costs(target, {SpeculationMode.EAGLE: again}, "test", cache_dir=tmp_path)
    assert again.relative_cost == 0.25
    other_settings = _random_drafter(target, seed=2)
    install_measured_draft_costs(target, {SpeculationMode.EAGLE: other_settings}, "other", cache_dir=tmp_path)
    assert other_settings.relative_cost != 0.25 and len(list((tmp_path / "pass_cost").glob("*.json"))) == 2
