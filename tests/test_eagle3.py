"""EAGLE-3 on tiny random Llamas: features are the named layers' outputs, the training-time-test
forward equals chain drafting with a KV cache step for step, training learns and resumes, and
drafter folders round-trip (ours and the published layout's names)."""

from __future__ import annotations

import json

import pytest
import torch

from triton_backend.core.errors import ModelLoadError
from triton_backend.speculation.drafters.eagle3_model import (Eagle3Info, Eagle3Net, default_capture_layers,
                                                              load_eagle3, save_eagle3)
from triton_backend.speculation.drafters.eagle_model import EagleKV
from torch.nn import functional as F

import random

from builder.train.eagle3 import length_batches, ttt_forward, ttt_loss, ttt_mask


def _info(vocab: int = 40, draft: int = 24) -> Eagle3Info:
    return Eagle3Info(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                      vocab_size=vocab, draft_vocab_size=draft, capture_layers=(1, 2, 4))


def _net(seed: int = 0) -> Eagle3Net:
    torch.manual_seed(seed)
    net = Eagle3Net(_info())
    net.set_vocab(torch.randperm(40)[:24].sort().values)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net.eval()


def test_ttt_mask_rules():
    m = ttt_mask(4, 2)  # query (step 2, j) sees step-0 keys i <= j - 2, step 1 at j - 1, step 2 at j
    assert m.shape == (4, 12)
    assert m[3, :4].tolist() == [True, True, False, False]
    assert m[3, 4:8].tolist() == [False, False, True, False] and m[3, 8:].tolist() == [False, False, False, True]
    assert ttt_mask(3, 0).equal(torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_training_time_test_equals_chain_drafting_with_a_cache():
    """Step s of the TTT forward at position p + s is what the drafter computes drafting s
    tokens after the target's feature at p: the mask is the inference-time context."""
    net = _net()
    embed = torch.randn(40, 32)
    t, p, steps = 7, 3, 3
    feats, nxt = torch.randn(1, t, net.info.feature_size), torch.randint(0, 40, (1, t))
    ttt = ttt_forward(net, embed, feats, nxt, steps)
    with torch.no_grad():
        kv = EagleKV.empty(net.info, 1, 4, torch.float32)  # type: ignore[arg-type]
        g = net(net.fc(feats[:, :p + 1]), embed[nxt[:, :p + 1]], torch.tensor([0]), kv)  # the context, p + 1 positions
        assert torch.allclose(net.logits(g), ttt[0][:, :p + 1], atol=1e-5)
        own = g[:, -1:]
        for s in range(1, steps):  # each draft step reads the previous step's own output
            own = net(own, embed[nxt[:, p + s:p + s + 1]], torch.tensor([p + s]), kv)
            assert torch.allclose(net.logits(own)[0, 0], ttt[s][0, p + s], atol=1e-5), s


def test_loss_on_trained_positions_equals_the_full_logits_loss():
    """The loss runs the LM head only where a label is trained; it equals the cross-entropy of
    the full logits with untrained positions ignored, and its gradients match."""
    net = _net().train()
    embed = torch.randn(40, 32)
    feats, nxt = torch.randn(2, 9, net.info.feature_size), torch.randint(0, 40, (2, 9))
    labels = torch.randint(0, 24, (2, 9))
    labels[0, :4] = -1  # a prompt
    labels[1, 6:] = -1  # padding
    fast = ttt_loss(net, embed, feats, nxt, labels, 3, 0.8)
    fast.backward()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad()
    ref = feats.new_zeros(())
    for s, logits in enumerate(ttt_forward(net, embed, feats, nxt, 3)):
        lab = labels.clone()
        lab[:, :s] = -1
        ref = ref + 0.8 ** s * F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-1)
    ref.backward()
    assert torch.allclose(fast, ref, atol=1e-6)
    for g, p in zip(grads, [p for p in net.parameters() if p.grad is not None]):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_length_batches_cover_every_sequence_once_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.randint(20, 500) for _ in range(301)]
    batches = length_batches(lengths, 8, random.Random(1))
    assert len(batches) == -(-301 // 8)
    assert sorted(i for b in batches for i in b) == list(range(301))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    plain = sum(len(b) * max(lengths[i] for i in b) for b in (list(range(j, min(j + 8, 301))) for j in range(0, 301, 8)))
    assert padded < 0.8 * plain
    assert batches == length_batches(lengths, 8, random.Random(1))  # the same order on a resume


def test_vocab_map_and_round_trip(tmp_path):
    net = _net()
    ids = torch.arange(24) + net.d2t
    assert net.t2d[ids].all() and int(net.t2d.sum()) == 24
    assert net.target_to_draft(ids).equal(torch.arange(24))
    missing = int((~net.t2d).nonzero()[0])
    assert int(net.target_to_draft(torch.tensor([missing]))) == -1
    save_eagle3(tmp_path / "ours", net, dtype=torch.float32)
    back = load_eagle3(tmp_path / "ours")
    assert back.info.capture_layers == (1, 2, 4) and back.d2t.equal(net.d2t) and back.t2d.equal(net.t2d)
    for k, v in net.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 24


def test_published_layout_loads(tmp_path):
    """A published checkpoint: pytorch_model.bin, ``layers.0.`` names, an embedding, no t2d,
    a config without capture layers (the target's layer count gives the default set)."""
    net = _net(1)
    folder = tmp_path / "published"
    folder.mkdir()
    state = {k.replace("midlayer.", "layers.0."): v for k, v in net.state_dict().items() if k != "t2d"}
    state["embed_tokens.weight"] = torch.randn(40, 32)
    torch.save(state, folder / "pytorch_model.bin")
    cfg = net.info.config_json()
    cfg.pop("eagle_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="capture layers"):
        load_eagle3(folder)
    loaded = load_eagle3(folder, num_target_layers=12)
    assert loaded.info.capture_layers == default_capture_layers(12) == (1, 5, 8)
    assert loaded.t2d.equal(net.t2d) and torch.equal(loaded.fc.weight, net.fc.weight)
    bad = dict(state)
    bad["d2t"] = bad["d2t"] + 100  # maps outside the vocabulary
    torch.save(bad, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="vocabulary map"):
        load_eagle3(folder, num_target_layers=12)
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_eagle3(folder, num_target_layers=12)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_eagle3(tmp_path / "nowhere")


def test_features_are_the_capture_layers_outputs(tmp_path):
    from build_fixtures import make_tiny_llama
    from builder.train.eagle_features import prefill_features
    from triton_backend.core.reference_model import ensure_reference_model
    from transformers import AutoModelForCausalLM
    import numpy as np

    folder = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), hidden=32, layers=6, heads=4, kv_heads=2,
                             intermediate=64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = default_capture_layers(6)
    seqs = [np.array([5, 9, 2, 7, 11]), np.array([3, 4, 8])]
    got = prefill_features(model, seqs, layers)
    seen: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _i, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in layers]
    for seq, (feats, top1) in zip(seqs, got):
        with torch.no_grad():
            logits = model(torch.from_numpy(seq)[None]).logits[0]
        want = torch.cat([seen[i][0] for i in layers], -1)
        assert feats.shape == (len(seq), 3 * 32)
        assert torch.allclose(feats.float(), want, atol=2e-2, rtol=1e-2)  # float16 storage
        assert top1.tolist() == logits.argmax(-1).tolist()
    for h in hooks:
        h.remove()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny 6-layer target, training features stored by its corpus run (the corpus folder) and
    held-out features by prefill: ``(target, train folder, held-out feature folder)``."""
    from build_fixtures import make_tiny_llama
    from builder.train.eagle_corpus import CorpusConfig, generate_corpus
    from builder.train.eagle_features import FeatureConfig, generate_features
    from triton_backend.core.reference_model import ensure_reference_model

    root = tmp_path_factory.mktemp("eagle3")
    tiny = str(make_tiny_llama(root / "tiny", ensure_reference_model(), hidden=48, layers=6, heads=4, kv_heads=2,
                               intermediate=96))
    for name, prompts, share in (("train", ["Say hi.", "Count to three.", "Name a colour.", "Spell cat.", "Say bye.",
                                            "Name a fruit."], 0.5), ("held", ["What is two plus two?", "Give me a number."], 0.0)):
        (root / f"{name}.txt").write_text("\n".join(prompts) + "\n")
        generate_corpus(CorpusConfig(target=tiny, out_dir=str(root / name), prompts_file=str(root / f"{name}.txt"),
                                     max_new_tokens=12, rows=4, shard_size=4, sampled_share=share,
                                     features="eagle3" if name == "train" else "none"))
    generate_features(FeatureConfig(target=tiny, corpus_dir=str(root / "held"), out_dir=str(root / "held-f")))
    return tiny, str(root / "train"), str(root / "held-f")


def _train_cfg(tiny_data, out, **kw):
    from builder.train.eagle3 import Eagle3TrainConfig

    tiny, train, held = tiny_data
    settings = dict(draft_vocab=64, ttt_steps=2, epochs=8, batch_size=2, lr=3e-3, time_limit_s=120, eval_every_s=0.0)
    settings.update(kw)
    return Eagle3TrainConfig(target=tiny, features_dir=settings.pop("features_dir", train), heldout_dir=held, out=str(out),
                             **settings)


def test_training_learns_resumes_and_writes_a_loadable_drafter(tmp_path, tiny_data):
    from builder.train.eagle3 import train_eagle3

    cfg = _train_cfg(tiny_data, tmp_path / "drafter")
    report = train_eagle3(cfg, progress=False)
    assert report.steps == 24 and len(report.curve) >= 2 and len(report.acceptance) == 2
    assert 0 < report.draft_vocab_coverage <= 1 and report.draft_vocab == 64
    assert sum(report.losses[-3:]) < sum(report.losses[:3])  # it learns
    assert all(0 <= a <= 1 for a in report.acceptance) and report.acceptance[1] <= report.acceptance[0]
    assert report.curve[0].steps == 0 and report.curve[0].acceptance == report.start_acceptance
    assert report.init_from is None and report.threads == torch.get_num_threads()
    again = train_eagle3(cfg, progress=False)  # finished: resumes to its end
    assert again.steps == 24 and again.acceptance == report.acceptance
    assert again.start_acceptance == report.start_acceptance
    net = load_eagle3(tmp_path / "drafter")
    assert net.info.capture_layers == default_capture_layers(6) and net.info.draft_vocab_size == 64
    saved = json.loads((tmp_path / "drafter" / "training_report.json").read_text())
    assert saved["training"]["curve"] and saved["settings"]["ttt_steps"] == 2
    assert saved["settings"]["target"].startswith("<outside the repository>/")  # no machine paths in reports


def test_warm_start_keeps_the_drafter_and_its_vocabulary(tmp_path, tiny_data):
    """``init_from``: the run starts from the drafter's own weights and vocabulary map (not one
    recomputed from the new data), its step-0 acceptance is the drafter's, and a checkpoint in
    ``out`` still resumes first; a drafter of other capture layers, another target or another
    draft vocabulary size is refused."""
    from dataclasses import replace

    from builder.errors import BuildSpecError
    from builder.train.eagle3 import _prepare, train_eagle3
    from builder.train.eagle3_init import draft_vocabulary

    first = train_eagle3(_train_cfg(tiny_data, tmp_path / "first", epochs=4), progress=False)
    init = load_eagle3(tmp_path / "first")
    held = tiny_data[2]  # new data: the held-out features, whose most written tokens differ
    cfg = _train_cfg(tiny_data, tmp_path / "warm", draft_vocab=None, init_from=str(tmp_path / "first"),
                     features_dir=held, epochs=2, lr=1e-3)
    run = _prepare(cfg)
    for k, v in init.state_dict().items():
        assert torch.equal(run.net.state_dict()[k], v), k
    fresh_ids, _ = draft_vocabulary([s.top1[s.first:] for s in run.train], 64, init.info.vocab_size)
    init_ids = torch.arange(64) + init.d2t
    assert not torch.equal(fresh_ids, init_ids)  # a recomputed vocabulary would differ
    report = train_eagle3(cfg, progress=False)
    assert report.curve[0].steps == 0 and report.start_acceptance == report.curve[0].acceptance == first.acceptance
    assert report.steps > 0 and report.draft_vocab == 64 and report.init_from == "<outside the repository>/first"
    warm = load_eagle3(tmp_path / "warm")
    assert torch.equal(warm.d2t, init.d2t) and torch.equal(warm.t2d, init.t2d)
    assert not torch.equal(warm.fc.weight, init.fc.weight)  # trained on
    saved = json.loads((tmp_path / "warm" / "training_report.json").read_text())
    assert saved["training"]["init_from"] == "<outside the repository>/first"
    assert saved["training"]["start_acceptance"] == first.acceptance
    again = train_eagle3(cfg, progress=False)  # the checkpoint wins: no new start from the init
    assert again.steps == report.steps and again.acceptance == report.acceptance

    with pytest.raises(BuildSpecError, match="disagrees"):
        train_eagle3(replace(cfg, out=str(tmp_path / "w2"), draft_vocab=32), progress=False)
    other = replace(init.info, capture_layers=(1, 2, 3))
    net = Eagle3Net(other)
    net.load_state_dict(init.state_dict())
    save_eagle3(tmp_path / "layers", net)
    with pytest.raises(BuildSpecError, match=r"reads target layers \(1, 2, 3\)"):
        train_eagle3(replace(cfg, out=str(tmp_path / "w3"), init_from=str(tmp_path / "layers")), progress=False)
    save_eagle3(tmp_path / "target", init)
    meta = json.loads((tmp_path / "target" / "config.json").read_text())
    meta["specbuild"]["target"] = "another-model"
    (tmp_path / "target" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(BuildSpecError, match="drafter for target 'another-model'"):
        train_eagle3(replace(cfg, out=str(tmp_path / "w4"), init_from=str(tmp_path / "target")), progress=False)
    assert not any((tmp_path / w).exists() for w in ("w2", "w3", "w4"))
    with pytest.raises(BuildSpecError, match="exclude each other"):
        replace(cfg, init_from_target=True)


def test_init_from_target_copies_the_last_layer(tiny_data):
    """``init_from_target``: the fresh drafter's decoder layer starts from the target's last
    layer where the shapes fit (q/k/v: their hidden-state half), its LM head from the target's
    rows of the draft vocabulary."""
    from builder.train.eagle3_init import fresh_net, target_parts

    parts = target_parts(tiny_data[0])
    top1 = [torch.randint(0, 300, (50,))]
    net, _ = fresh_net(parts, top1, 32, (1, 2, 2), "tiny", 0, from_target_layer=True)
    plain, _ = fresh_net(parts, top1, 32, (1, 2, 2), "tiny", 0)
    last, m, h = parts.last_layer, net.midlayer, 48
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert torch.equal(m.get_parameter(name), last[name]), name
    assert torch.equal(m.hidden_norm.weight, last["input_layernorm.weight"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        mine = m.self_attn.get_parameter(f"{proj}.weight")
        assert torch.equal(mine[:, h:], last[f"self_attn.{proj}.weight"])
        assert torch.equal(mine[:, :h], plain.midlayer.self_attn.get_parameter(f"{proj}.weight")[:, :h])
    ids = torch.arange(32) + net.d2t
    assert torch.equal(net.lm_head.weight, parts.head[ids]) and torch.equal(net.fc.weight, plain.fc.weight)


def test_revocab_keeps_the_body_and_the_shared_head_rows(tiny_data):
    """``revocab``: a warm start over a draft vocabulary re-picked from new data keeps the init's
    body, its head rows for the tokens both vocabularies hold, the target's rows for the others
    (too few shared rows here to fit the map: ``mapped_head_rows``);
    coverage of the new data rises; without ``init_from`` it is refused."""
    from dataclasses import replace

    from builder.errors import BuildSpecError
    from builder.train.eagle3_init import coverage_of, fresh_net, revocab, target_parts

    parts = target_parts(tiny_data[0])
    old_data = [torch.arange(0, 40).repeat(3)]
    new_data = [torch.arange(20, 90).repeat(3)]
    init, _ = fresh_net(parts, old_data, 40, (1, 2, 2), "tiny", 0)
    with torch.no_grad():
        init.lm_head.weight.add_(torch.randn_like(init.lm_head.weight))  # trained rows, unlike the target's
    net, coverage = revocab(init, parts, new_data, 48)
    assert net.info.draft_vocab_size == 48 and coverage > coverage_of(init, new_data)
    assert coverage == pytest.approx(48 / 70)
    for k, v in init.state_dict().items():
        if not k.startswith("lm_head") and k not in ("d2t", "t2d"):
            assert torch.equal(net.state_dict()[k], v), k
    ids = net.draft_to_target(torch.arange(48))
    old = init.target_to_draft(ids)
    for i, (token, j) in enumerate(zip(ids.tolist(), old.tolist())):
        want = init.lm_head.weight[j] if j >= 0 else parts.head[token]
        assert torch.equal(net.lm_head.weight[i], want), token
    assert (old >= 0).any() and (old < 0).any()
    cfg = _train_cfg(tiny_data, "unused", init_from="")
    with pytest.raises(BuildSpecError, match="needs --init-from"):
        replace(cfg, revocab=True)


def test_new_head_rows_are_carried_into_the_drafters_space():
    """A token new to the draft vocabulary gets the target's head row through the map that takes
    the target's rows to the drafter's on the shared tokens (exact when the drifted rows are a
    linear image of the target's); with fewer shared rows than the width, the target's raw row."""
    from builder.train.eagle3_init import mapped_head_rows

    gen = torch.Generator().manual_seed(0)
    target = torch.randn(300, 8, generator=gen)
    drift = torch.randn(8, 8, generator=gen)
    old_ids = torch.arange(0, 100)
    draft = target[old_ids] @ drift  # the drafter's trained rows
    ids = torch.arange(60, 160)  # 40 shared tokens, 60 new
    old_index = torch.where(ids < 100, ids, torch.full_like(ids, -1))
    rows = mapped_head_rows(target, draft, ids, old_index)
    assert torch.equal(rows[:40], draft[60:100])
    torch.testing.assert_close(rows[40:], target[100:160] @ drift, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(rows[40:], target[100:160])
    few = torch.where(ids < 65, ids, torch.full_like(ids, -1))  # 5 shared rows < width 8
    assert torch.equal(mapped_head_rows(target, draft, ids, few)[5:], target[65:160])


def test_revocab_training_run(tmp_path, tiny_data):
    from builder.train.eagle3 import train_eagle3

    train_eagle3(_train_cfg(tiny_data, tmp_path / "first", epochs=2), progress=False)
    cfg = _train_cfg(tiny_data, tmp_path / "re", draft_vocab=48, init_from=str(tmp_path / "first"), revocab=True,
                     features_dir=tiny_data[2], epochs=1)
    report = train_eagle3(cfg, progress=False)
    assert report.draft_vocab == 48 and report.steps > 0
    assert load_eagle3(tmp_path / "re").info.draft_vocab_size == 48
