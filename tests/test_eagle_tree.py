"""EAGLE dynamic draft trees: the drafter's tree expansion (against chains run per path, batched
against alone), the multi-draft rejection rule (statistically exact; a wrong rule is caught),
the loop's exactness (greedy token for token, sampling in distribution) on tiny random models
and the reference model, and the tree sizing of the gain rule."""

from __future__ import annotations


import pytest
import torch
from scipy import stats as scipy_stats

from conftest import tiny_engine
from test_eagle import REFERENCE_DRAFTER, _decoder, _exact_joint, _random_drafter, _sample_pairs
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SamplingParams,
                                        SpeculationConfig, SpeculationMode)
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.core.tree import path_to
from triton_backend.speculation.drafters.eagle import EagleDrafter
from triton_backend.speculation.drafters.eagle_tree import TreeShape, draw_without_replacement
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.round_plan import plan_round
from triton_backend.speculation.tree_plan import BEST_FIRST, TreeModel, TreeRecord, best_nodes
from triton_backend.speculation.tree_verify import verify_tree_multidraft

GREEDY = LogitsProcessor()


def _backlog(drafter, count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.embed.shape[1]
    return torch.randn(1, count, hidden, generator=g), torch.randint(0, 32, (1, count), generator=g)


def _tree(drafter, feats, toks, shape, processor=GREEDY, generator=None):
    kv = drafter.new_cache(1, 4)
    return drafter.draft_trees(kv, torch.tensor([0]), feats, toks, torch.tensor([toks.shape[1]]), [shape],
                               [processor], [generator])[0]


def test_a_chain_shaped_tree_is_the_chain():
    target = tiny_engine(0)
    drafter = _random_drafter(target)
    feats, toks = _backlog(drafter, 5)
    chain, _ = drafter.draft_chain(drafter.new_cache(1, 4), torch.tensor([0]), feats, toks, torch.tensor([5]), 4,
                                   [GREEDY], [None])
    tree = _tree(drafter, feats, toks, TreeShape.chain(4))
    assert tree.tokens == chain[0].tolist() and tree.parents == [-1, 0, 1, 2] and tree.ranks == [0] * 4


@pytest.mark.parametrize("candidates", [False, True])
def test_every_node_sees_its_path_only(candidates):
    """Each expanded node's children are the top-k the drafter gives after running the node's
    path as a chain (tree attention and cache placement are right), and the kept set is a
    tree: ancestors kept, at most ``nodes``, depth at most ``depth``, siblings by rank."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, vocab=torch.arange(0, 32, 2) if candidates else None)
    feats, toks = _backlog(drafter, 4)
    shape = TreeShape(depth=4, top_k=3, nodes=14)
    tree = _tree(drafter, feats, toks, shape)
    assert 0 < len(tree.tokens) <= 14
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        assert p < i
        children.setdefault(p, []).append(i)
    for parent, kids in children.items():
        assert [tree.ranks[c] for c in kids] == list(range(len(kids)))  # a prefix of the ranks, in order
        path = [tree.tokens[j] for j in path_to(parent, tree.parents)]
        assert len(path) < shape.depth
        kv = drafter.new_cache(1, 4)
        feature = drafter._feed(kv, torch.tensor([0]), feats, toks, torch.tensor([4]), [GREEDY], [None], None)
        for d, token in enumerate(path):  # the path as a chain
            feature = drafter.net(feature[:, None], drafter.embed[torch.tensor([[token]])], torch.tensor([4 + d]), kv)[:, 0]
        logits = drafter._small_logits(feature)[0]
        top = torch.topk(logits, len(kids)).indices
        expected = (drafter.vocab[top] if drafter.vocab is not None else top).tolist()
        assert [tree.tokens[c] for c in kids] == expected
        # a node's score: its parent's plus its own log probability (the drafter's), the best-first order's key
        base = 0.0 if parent < 0 else tree.scores[parent]
        logp = torch.log_softmax(logits.float(), -1)[top]
        assert [tree.scores[c] for c in kids] == pytest.approx((base + logp).tolist(), abs=1e-4)


def test_batched_trees_equal_trees_alone():
    target = tiny_engine(0)
    drafter = _random_drafter(target)
    counts = [5, 2, 3]
    shapes = [TreeShape(3, 2, 6), TreeShape(4, 3, 10), TreeShape(2, 1, 2)]
    backlogs = [_backlog(drafter, c, seed=i) for i, c in enumerate(counts)]
    alone = [_tree(drafter, f, t, s) for (f, t), s in zip(backlogs, shapes)]
    hidden = drafter.embed.shape[1]
    feats, toks = torch.zeros(3, 5, hidden), torch.zeros(3, 5, dtype=torch.long)
    for b, (f, t) in enumerate(backlogs):
        feats[b, :counts[b]], toks[b, :counts[b]] = f[0], t[0]
    kv = drafter.new_cache(6, 4)
    batched = drafter.draft_trees(kv, torch.zeros(3, dtype=torch.long), feats, toks, torch.tensor(counts), shapes,
                                  [GREEDY] * 3, [None] * 3, slots=torch.tensor([5, 0, 3]))
    for a, b in zip(alone, batched):
        assert (a.tokens, a.parents, a.ranks) == (b.tokens, b.parents, b.ranks)


def test_draws_without_replacement_in_order():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(5, 5)
    for _ in range(n):
        a, b = draw_without_replacement(q, 2, g)
        counts[a, b] += 1
    expected = torch.tensor([[q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for b in range(5)] for a in range(5)])
    mask = expected.flatten() > 0
    assert counts.flatten()[~mask].sum() == 0  # never twice the same token, never a token q excludes
    chi2 = scipy_stats.chisquare(counts.flatten()[mask].numpy(), (expected.flatten()[mask] * n).numpy())
    assert chi2.pvalue > 1e-3


# -- the multi-draft rule ------------------------------------------------------------------------

VOCAB = 5


def _tables(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    soft = lambda *shape: torch.softmax(torch.randn(*shape, generator=g) * 1.5, -1)  # noqa: E731
    return soft(VOCAB), soft(VOCAB, VOCAB), soft(VOCAB), soft(VOCAB, VOCAB)  # p0, p(.|a), q0, q(.|a)


def _wrong_rule(rows, tokens, parents, probs, g):
    """A plausible but wrong rule: each child checked against the unchanged p and q."""
    p, q = rows(0), probs[0]
    for c in [i for i, par in enumerate(parents) if par < 0]:
        if float(torch.rand(1, generator=g)) * float(q[tokens[c]]) < float(p[tokens[c]]):
            return [c], None
    return [], int(torch.multinomial(p, 1, generator=g))


def _joint_of_first_two(rule, n: int, seed: int) -> torch.Tensor:
    """Counts of the first two committed tokens when a 3-wide, 2-deep tree drawn from q is
    verified by ``rule`` (the second token comes from the next round when nothing is accepted)."""
    p0, p1, q0, q1 = _tables()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(n):
        first = draw_without_replacement(q0, 3, g)
        second = draw_without_replacement(q1[first[0]], 2, g)
        tokens, parents = first + second, [-1, -1, -1, 0, 0]
        probs = torch.stack([q0] * 3 + [q1[first[0]]] * 2)
        rows = lambda i: p0 if i == 0 else p1[tokens[i - 1]]  # noqa: E731 (depth 2's rows: the same table)
        if rule is verify_tree_multidraft:
            r = rule(rows, tokens, parents, probs, g)
            path, nxt = list(r.path), r.next_token
        else:
            path, nxt = rule(rows, tokens, parents, probs, g)
            if path:
                nxt = int(torch.multinomial(p1[tokens[path[0]]], 1, generator=g))
        seq = [tokens[i] for i in path] + ([nxt] if nxt is not None else [])
        if len(seq) == 1:
            seq.append(int(torch.multinomial(p1[seq[0]], 1, generator=g)))
        counts[seq[0], seq[1]] += 1
    return counts


def test_multidraft_rule_preserves_the_target_distribution():
    p0, p1, _, _ = _tables()
    n = 20000
    expected = (p0[:, None] * p1).flatten() * n
    chi2 = scipy_stats.chisquare(_joint_of_first_two(verify_tree_multidraft, n, 0).flatten().numpy(), expected.numpy())
    assert chi2.pvalue > 1e-3
    wrong = scipy_stats.chisquare(_joint_of_first_two(_wrong_rule, n, 0).flatten().numpy(), expected.numpy())
    assert wrong.pvalue < 1e-6  # the test has teeth


def test_multidraft_rule_with_the_target_as_draft_accepts_everything():
    p0, p1, _, _ = _tables()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        first = draw_without_replacement(p0, 2, g)
        tokens, parents = first + [int(torch.multinomial(p1[first[0]], 1, generator=g))], [-1, -1, 0]
        probs = torch.stack([p0, p0, p1[first[0]]])
        r = verify_tree_multidraft(lambda i: p0 if i == 0 else p1[tokens[i - 1]], tokens, parents, probs, g)
        assert r.path == (0, 2)


# -- the loop ------------------------------------------------------------------------------------


def _tree_spec(k: int = 3, fallback: FallbackConfig | None = None, **eagle) -> SpeculationConfig:
    return SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=fallback or FallbackConfig(enabled=False), eagle=EagleConfig(**eagle))


@pytest.mark.parametrize("candidates", [False, True])
@pytest.mark.parametrize("fallback", [FallbackConfig(enabled=False), FallbackConfig(prior_acceptance=0.9)])
def test_greedy_trees_identical_to_plain(candidates, fallback):
    target = tiny_engine(0)
    drafter = _random_drafter(target, vocab=torch.arange(0, 32, 3) if candidates else None)
    drafter.relative_cost = 0.01
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2]):
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spec = decoder.generate(prompt, params, _tree_spec(3, fallback, max_tree_nodes=8, tree_top_k=3))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted_tokens > 0


def test_constant_drafter_trees_stay_exact_and_count_depths():
    """A drafter with zero weights guesses one constant feature: its trees are exact, and a
    round's drafted positions are its tree's depth (as Medusa's), never its node count."""
    target = tiny_engine(0)
    decoder = _decoder(target, _random_drafter(target, scale=0.0))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = decoder.generate([1, 2, 3], params, SpeculationConfig(method="off"))
    tree = decoder.generate([1, 2, 3], params, _tree_spec(3, max_tree_nodes=9, tree_top_k=3))
    chain = decoder.generate([1, 2, 3], params, _tree_spec(3, tree=False))
    assert tree.token_ids == chain.token_ids == plain.token_ids
    assert tree.stats.accepted_tokens <= tree.stats.drafted_tokens <= 3 * tree.stats.target_passes


@pytest.mark.parametrize("params,candidates", [(dict(temperature=1.0), False), (dict(temperature=0.8, top_k=4), True)])
def test_sampled_trees_match_target_distribution(params, candidates):
    """The next 2 tokens through EAGLE tree rounds (multi-draft rule with the drafter's q)
    follow the target's exact joint distribution (total variation bound, fixed seeds)."""
    target = tiny_engine(10, vocab=8)
    drafter = _random_drafter(target, scale=0.5, vocab=torch.tensor([0, 2, 3, 5, 6]) if candidates else None)
    decoder = _decoder(target, drafter)
    prompt = [1, 2, 1, 3, 1]
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    spec = _tree_spec(2, max_tree_nodes=6, tree_top_k=3)
    tv, impossible, drafted = _sample_pairs(decoder, prompt, params, spec, exact)
    assert drafted > 0
    assert tv < 0.07, tv  # sampling noise at n=2000 over <=64 outcomes is ~0.04
    assert not impossible


@pytest.mark.slow
def test_reference_drafter_greedy_trees_identical_to_plain(reference, reference_prompts):
    engine, tokenizer = reference
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.EAGLE: EagleDrafter.from_file(
        str(REFERENCE_DRAFTER), engine)})
    params = SamplingParams(max_tokens=32)
    accepted = 0
    for prompt in reference_prompts[:3]:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        for spec in (_tree_spec(4, max_tree_nodes=10, tree_top_k=4), _tree_spec(6, FallbackConfig())):
            out = decoder.generate(prompt, params, spec)
            assert out.token_ids == plain.token_ids
            accepted += out.stats.accepted_tokens
    assert accepted > 0


# -- sizing --------------------------------------------------------------------------------------


def test_best_nodes_are_the_table_scaled_best_first_and_shapes_follow():
    nodes = best_nodes(BEST_FIRST[0], 6, 4)
    assert [n.prob for n in nodes] == pytest.approx(list(BEST_FIRST[:6]))  # the drafter measured: the table
    weak = best_nodes(BEST_FIRST[0] / 2, 6, 4)
    assert [n.prob for n in weak] == pytest.approx([p / 2 for p in BEST_FIRST[:6]])
    strong = best_nodes(0.8, 6, 4)
    assert strong[0].prob == pytest.approx(0.8) and strong[1].prob == pytest.approx(BEST_FIRST[1] * 0.8 / BEST_FIRST[0])
    assert best_nodes(0.5, 6, 4, kappa=3.0)[0].prob == 1.0  # a probability, and never rising
    assert all(n.depth <= 2 for n in best_nodes(0.5, 12, 2))
    model = TreeModel(11, 4, 4)
    assert model.shape([0.5] * 4, 1) == TreeShape(1, 1, 1)  # one node: the first choice
    assert model.shape([0.5] * 4, 3) == TreeShape(3, 3, 3)  # the 3 best of a depth-4 top-4 tree
    assert model.shape([0.5] * 4, 11) == TreeShape(4, 4, 11)
    assert model.shape([0.5] * 4, 0) is None


def test_a_request_alone_drafts_a_tree_and_a_loaded_batch_less():
    """The measured CPU pass costs: a lone request with the drafter's measured acceptance
    drafts a tree filling the kernel's sweep (12 rows); in a batch of 8 each row drafts fewer."""
    cost = PassCostModel({1: {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 12: 1.12, 13: 1.4, 16: 1.5},
                          8: {1: 1.37, 2: 2.12, 4: 3.94, 8: 6.95}}, "pass-cost-cpu.md")
    model = TreeModel(16, 4, 4)
    option = model.option([BEST_FIRST[0]] * 4, draft_cost=0.04)
    alone = plan_round([option], cost)[0]
    assert alone == 11  # a 13-token pass takes a second sweep: not worth its 12th node
    loaded = plan_round([option] * 8, cost)
    assert max(loaded) < alone
    weak = model.option([0.1] * 4, draft_cost=0.04)
    assert plan_round([weak], cost)[0] < alone  # a drafter doing badly here drafts less, or nothing


def test_tree_record_and_calibration():
    # root children 0 (rank 0), 1 (rank 1); node 0's children 2 (rank 0), 3 (rank 1); node 2's child 4
    parents, ranks = [-1, -1, 0, 0, 2], [0, 1, 0, 1, 0]
    record = TreeRecord.of(parents, ranks, [0, 3])
    assert (record.chain_drafted, record.chain_accepted, record.accepted_nodes) == (3, 1, 2)
    assert TreeRecord.of(parents, ranks, []).accepted_nodes == 0
    model = TreeModel(11, 4, 4)
    before = model.option([0.5] * 4, 0.04).prefix_probs
    for _ in range(10):  # rounds accepting more than the table expects raise every node's value
        model.shape([0.5] * 4, 4)
        model.record(TreeRecord(4, 2, 4))
    after = model.option([0.5] * 4, 0.04).prefix_probs
    assert all(a >= b for a, b in zip(after, before)) and after[3] > before[3]
    model.record(TreeRecord(4, 0, 0))  # a record without a shaped round before it teaches nothing
    assert model.option([0.5] * 4, 0.04).prefix_probs == after


# -- the batch scheduler -------------------------------------------------------------------------


def test_scheduler_drafts_every_eagle_row_in_one_call_and_equals_alone(monkeypatch):
    """Greedy and seeded sampling requests with trees (fixed and gain-sized): the scheduler's
    outputs equal each request alone, and each round drafts all its EAGLE rows in one call."""
    from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
    from test_scheduler import submit_all

    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=5, scale=0.15)
    drafter.relative_cost = 0.01
    decoder = _decoder(target, drafter)
    requests = []
    for i, prompt in enumerate(([1, 2, 3], [5, 9, 9, 4, 1, 7, 2], [30, 3, 30, 3, 30], [7, 7, 1])):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=20, temperature=0.9 if sampling else 0.0, seed=40 + i if sampling else None,
                                ignore_eos=True)
        fallback = FallbackConfig(prior_acceptance=0.9) if i < 2 else FallbackConfig(enabled=False)
        requests.append((prompt, params, _tree_spec(3, fallback, max_tree_nodes=8, tree_top_k=3)))
    alone = [decoder.generate(p, params, spec).token_ids for p, params, spec in requests]
    calls: list[int] = []
    propose_trees = EagleDrafter.propose_trees

    def spy(self, sessions, *args):
        calls.append(len(sessions))
        return propose_trees(self, sessions, *args)

    monkeypatch.setattr(EagleDrafter, "propose_trees", spy)
    for policy in ("per_request", "load_aware"):
        scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4, policy=policy))
        try:
            assert [c.tokens() for c in submit_all(scheduler, requests)] == alone
            assert max(calls) > 1 and len(calls) <= scheduler.rounds  # rows drafted together, one call a round
        finally:
            scheduler.shutdown()
        calls.clear()


def test_a_prompt_joining_the_batch_is_fed_apart_and_changes_no_output(monkeypatch):
    """A row whose drafter lacks a whole prompt is fed in its own call, so the rows with a few new
    pairs are not padded to its length; every request's output still equals it alone (greedy and
    seeded sampling)."""
    from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
    from triton_backend.speculation.drafters.eagle import FEED_TOGETHER, feed_groups
    from test_scheduler import submit_all

    assert feed_groups([1, 3, FEED_TOGETHER + 1, 2, 40]) == [[0, 1, 3], [2], [4]]
    assert feed_groups([40]) == [[0]] and feed_groups([2, 3]) == [[0, 1]]
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=5, scale=0.15)
    decoder = _decoder(target, drafter)
    long_prompt = [(7 * i) % 30 + 1 for i in range(24)]
    requests = []
    for i, prompt in enumerate(([1, 2, 3], long_prompt, [5, 9, 9, 4], [30, 3, 30])):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=12, temperature=0.9 if sampling else 0.0, seed=60 + i if sampling else None,
                                ignore_eos=True)
        requests.append((prompt, params, _tree_spec(3, FallbackConfig(enabled=False), max_tree_nodes=6, tree_top_k=2)))
    alone = [decoder.generate(p, params, spec).token_ids for p, params, spec in requests]
    widths: list[tuple[int, int]] = []
    feed_net = EagleDrafter._feed_net

    def spy(self, features, *args):
        widths.append(tuple(features.shape[:2]))
        return feed_net(self, features, *args)

    monkeypatch.setattr(EagleDrafter, "_feed_net", spy)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        assert [c.tokens() for c in submit_all(scheduler, requests)] == alone
    finally:
        scheduler.shutdown()
    assert (1, len(long_prompt)) in widths  # the prompt's pairs alone (then the first committed token's)
    assert all(w <= FEED_TOGETHER for rows, w in widths if rows > 1)  # nobody padded to it


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_a_tree_step_over_a_chain_equals_the_chain_step(layout):
    """Both drafter layouts place tree nodes through :class:`TreeStep`: two sibling nodes after
    a committed context each get what a chain step after the context gives them."""
    from triton_backend.speculation.drafters.eagle3_model import Eagle3Info, Eagle3Net
    from triton_backend.speculation.drafters.eagle_model import EagleInfo, EagleKV, EagleNet, TreeStep

    torch.manual_seed(0)
    if layout == "eagle":
        info = EagleInfo(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=40)
        net, call = EagleNet(info).eval(), lambda n, f, e, s, kv, tree=None: n(f, e, s, kv, tree=tree)
    else:
        info = Eagle3Info(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=40,
                          draft_vocab_size=40, capture_layers=(0,))
        net, call = Eagle3Net(info).eval(), lambda n, f, e, s, kv, tree=None: n(f, e, s, kv, tree)
    context, f, e = 5, torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    nodes_f, nodes_e = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    with torch.inference_mode():
        kv = EagleKV.empty(info, 1, 8, torch.float32)
        call(net, f, e, torch.tensor([0]), kv)
        visible = torch.zeros(1, 2, context + 2, dtype=torch.bool)
        visible[0, :, :context] = True
        visible[0, [0, 1], [context, context + 1]] = True
        tree = call(net, nodes_f, nodes_e, torch.tensor([context]), kv,
                    TreeStep(torch.full((1, 2), context), torch.tensor([[context, context + 1]]), visible))
        for i in range(2):
            fresh = EagleKV.empty(info, 1, 8, torch.float32)
            call(net, f, e, torch.tensor([0]), fresh)
            chain = call(net, nodes_f[:, i:i + 1], nodes_e[:, i:i + 1], torch.tensor([context]), fresh)
            assert torch.allclose(tree[:, i], chain[:, 0], atol=1e-5)


def test_controller_tree_shapes():
    """Fixed drafting: the configured tree at depth k; the gain rule: a tree of k nodes (a
    chain for one); trees off: always chains. A tree round teaches the chain estimate its
    first-choice chain and the model how many of its nodes were accepted."""
    from triton_backend.speculation.controller import controller_for

    target = tiny_engine(0)
    drafter = _random_drafter(target)
    fixed = controller_for(_tree_spec(3, max_tree_nodes=10, tree_top_k=2), SpeculationMode.EAGLE, drafter)
    assert fixed.tree_shape(3) == TreeShape(3, 2, 10)
    off = controller_for(_tree_spec(3, tree=False), SpeculationMode.EAGLE, drafter)
    assert off.tree is None and off.tree_shape(3) is None
    gain = controller_for(_tree_spec(4, FallbackConfig(prior_acceptance=0.4)), SpeculationMode.EAGLE, drafter)
    assert gain.policy.max_k == 11  # a round's k counts nodes (max_tree_nodes)
    conditional = gain.policy.estimate.conditional()
    assert gain.tree_shape(1) is None  # one node: the first choice, a chain
    assert gain.tree_shape(6) == gain.tree.shape(conditional, 6) == TreeShape(4, 4, 6)
    before = gain.tree.calibration.factor()
    gain.record(2, 1, TreeRecord(chain_drafted=2, chain_accepted=0, accepted_nodes=4))
    assert gain.tree.calibration.factor() > before  # 4 nodes accepted: more than the table expected of 6
    assert gain.policy.estimate.rejected[0] > 0  # the first choice failed at depth 1
