"""Tree verification on tiny random Llamas: the tree attention pass against a slow per-path
reference, KV compaction, the tree verifiers (hand-built, statistical), the Medusa loop's
greedy exactness, the heads file and the tree grown from accuracies."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from scipy import stats as scipy_stats

from conftest import tiny_engine
from triton_backend.core.config import (
    DraftLengthConfig, FallbackConfig, MedusaConfig, SamplingParams, SpeculationConfig, SpeculationMode, TreeAcceptance,
)
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.core.errors import ConfigError, ModelLoadError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint, MedusaHeads, MedusaHeadsInfo, load_medusa, save_medusa
from triton_backend.core.tree import ancestor_mask, choices_to_parents, node_depths, normalise_choices, path_to
from triton_backend.engines.torch.tree_attention import tree_attention_inputs
from triton_backend.speculation.tree_verify import verify_tree_greedy, verify_tree_sampling, verify_tree_typical

PARENTS = [-1, -1, 0, 0, 1, 2, 5, -1]  # three root children, branches of depth 1..4


def random_heads(hidden: int, vocab: int, num_heads: int = 3, seed: int = 0, scale: float = 0.3) -> MedusaHeads:
    torch.manual_seed(seed)
    info = MedusaHeadsInfo(num_heads=num_heads, num_layers=1, hidden_size=hidden, vocab_size=vocab,
                           medusa_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    heads = MedusaHeads(info)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads


@pytest.fixture(scope="module")
def medusa_decoder():
    target = tiny_engine(0, vocab=32)
    drafter = MedusaDrafter(MedusaCheckpoint(random_heads(32, 32)), target)
    return target, SpeculativeDecoder(target, None, drafters={SpeculationMode.MEDUSA: drafter})


def test_tree_shape_helpers():
    assert node_depths(PARENTS) == [1, 1, 2, 2, 2, 3, 4, 1]
    assert path_to(6, PARENTS) == [0, 2, 5, 6] and path_to(-1, PARENTS) == []
    m = ancestor_mask(PARENTS)
    assert m[6].nonzero().flatten().tolist() == [0, 2, 5, 6] and m[7].nonzero().flatten().tolist() == [7]
    with pytest.raises(ValueError):
        node_depths([0])  # a node cannot be its own parent


def test_mask_and_positions_against_per_path_reference():
    """Row by row, the tree mask equals the causal mask of the sequence committed + path."""
    past, new = 3, 2
    mask, positions = tree_attention_inputs(PARENTS, past, new, torch.float32)
    n = len(PARENTS)
    allowed = mask[0, 0] == 0
    assert allowed.shape == (new + n, past + new + n)
    for row in range(new + n):
        if row < new:
            want = set(range(past + row + 1))
            pos = past + row
        else:
            path = path_to(row - new, PARENTS)
            want = set(range(past + new)) | {past + new + j for j in path}
            pos = past + new - 1 + len(path)
        assert set(allowed[row].nonzero().flatten().tolist()) == want, row
        assert int(positions[0, row]) == pos, row


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_pass_matches_per_path_forward(seed):
    target = tiny_engine(seed, vocab=32)
    g = torch.Generator().manual_seed(seed)
    committed = torch.randint(0, 32, (7,), generator=g).tolist()
    tree_tokens = torch.randint(0, 32, (len(PARENTS),), generator=g).tolist()
    session = target.new_session()
    session.logits(committed[:4], 1)  # a warm cache: the pass runs the rest of the committed tokens too
    logits, hidden = session.tree_logits(committed, tree_tokens, PARENTS)
    assert logits.shape == (len(PARENTS) + 1, 32) and hidden.shape[0] == len(PARENTS) + 1
    for node in range(-1, len(PARENTS)):
        seq = committed + [tree_tokens[j] for j in path_to(node, PARENTS)]
        with torch.inference_mode():
            ref = target.model(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(logits[node + 1], ref, atol=1e-4), node


def test_compaction_keeps_the_accepted_path():
    target = tiny_engine(0, vocab=32)
    committed, tree_tokens = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]
    session = target.new_session()
    session.tree_logits(committed, tree_tokens, PARENTS)
    path = [0, 2, 5]
    session.keep_tree_path(path)
    seq = committed + [tree_tokens[i] for i in path] + [7]
    assert session.cached_length == len(seq) - 1
    got = session.logits(seq, 1)
    with torch.inference_mode():
        ref = target.model(torch.tensor([seq])).logits[0, -1]
    assert torch.allclose(got[0], ref, atol=1e-4)
    assert session.forward_calls == 2  # the compacted cache was reused, not recomputed


def test_rejected_tree_is_dropped_before_a_plain_pass():
    target = tiny_engine(0, vocab=32)
    session = target.new_session()
    session.tree_logits([1, 2, 3], [4, 5], [-1, 0])
    got = session.logits([1, 2, 3, 9], 2)  # no keep_tree_path: the tree must not leak into the cache
    with torch.inference_mode():
        ref = target.model(torch.tensor([[1, 2, 3, 9]])).logits[0, -2:]
    assert torch.allclose(got, ref, atol=1e-4)


def _onehot_rows(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.zeros(len(argmaxes), vocab)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return rows


@pytest.mark.parametrize("argmaxes,path,next_token", [
    # rows: root, then nodes 0..7 of PARENTS; tokens below
    ([1, 3, 0, 4, 0, 0, 2, 0, 0], (0, 2, 5, 6), 0),  # deepest branch fully accepted: bonus from node 6
    ([1, 7, 0, 0, 0, 0, 0, 0, 0], (0,), 7),  # root child 0 accepted, nothing below matches
    ([2, 0, 9, 0, 0, 0, 0, 0, 0], (1, 4), 0),  # second root child, then its child
    ([5, 0, 0, 0, 0, 0, 0, 0, 0], (), 5),  # nothing matches: the root's argmax
    ([8, 0, 0, 0, 0, 0, 0, 0, 0], (7,), 0),  # a later root child
])
def test_greedy_tree_hand_built(argmaxes, path, next_token):
    tokens = [1, 2, 3, 6, 9, 4, 2, 8]
    result = verify_tree_greedy(_onehot_rows(argmaxes), tokens, PARENTS)
    assert result.path == path and result.next_token == next_token


def test_tree_verifiers_check_shapes():
    with pytest.raises(ValueError):
        verify_tree_greedy(torch.zeros(3, 10), [1, 2, 3], [-1, 0, 1])
    with pytest.raises(ValueError):
        verify_tree_sampling(torch.full((3, 10), 0.1), [1, 2], [-1, 5], None)


def test_exact_tree_sampling_preserves_the_target_distribution():
    """Joint law of (first, second) committed token equals p(x1) p(x2 | x1), whatever the tree."""
    vocab = 4
    g = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(9, vocab, generator=g) * 1.5, -1)  # root + 8 nodes
    tokens = [0, 1, 2, 3, 0, 1, 2, 3]
    parents = [-1, -1, 0, 0, 1, 1, 2, -1]
    children = {(p, tokens[i]): i for i, p in enumerate(parents)}
    expected = torch.zeros(vocab, vocab)
    for a, b in itertools.product(range(vocab), range(vocab)):
        node = children.get((-1, a))
        # after x1 = a, x2 comes from node a's row when a is in the tree, else from the next round: use row 0
        # as the stand-in "next round" distribution (the test drives the second draw the same way)
        second = rows[node + 1] if node is not None else rows[0]
        expected[a, b] = rows[0, a] * second[b]
    counts = torch.zeros(vocab, vocab)
    n = 20000
    for _ in range(n):
        r = verify_tree_sampling(rows, tokens, parents, g)
        seq = [tokens[i] for i in r.path] + [r.next_token]
        if len(seq) == 1:  # nothing accepted: the second token comes from a fresh draw
            seq.append(int(torch.multinomial(rows[0], 1, generator=g)))
        counts[seq[0], seq[1]] += 1
    chi2 = scipy_stats.chisquare(counts.flatten().numpy(), (expected.flatten() * n).numpy())
    assert chi2.pvalue > 1e-3


def test_typical_acceptance_thresholds():
    probs = torch.tensor([[0.70, 0.20, 0.05, 0.05], [0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]])
    # node 0 (token 1, p=0.20 at the root) passes: min(0.09, 0.3*exp(-H)) < 0.2; node 1 (token 1 after node 0,
    # p=0.01) fails the high-confidence row's bar
    result = verify_tree_typical(probs, [1, 1], [-1, 0], torch.Generator().manual_seed(0))
    assert result.path == (0,) and result.next_token == 0  # sampled from row 1: 0 with 0.97
    # token 3 has p = 0.05 at the root: below min(0.09, 0.3 * exp(-H) = 0.126), above a 0.04 threshold
    assert verify_tree_typical(probs[:2], [3], [-1], None, threshold=0.09, alpha=0.3).path == ()
    assert verify_tree_typical(probs[:2], [3], [-1], None, threshold=0.04, alpha=0.3).path == (0,)


def test_medusa_greedy_identical_to_plain(medusa_decoder):
    _, decoder = medusa_decoder
    params = SamplingParams(max_tokens=40)
    accepted = 0
    for prompt in ([1, 2, 3], [5, 5, 5, 5], [7, 1, 9, 1, 7, 1]):
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        tree = decoder.generate(prompt, params, SpeculationConfig(method="medusa",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
        assert tree.token_ids == plain.token_ids
        assert tree.stats.method == "medusa" and tree.stats.drafted_tokens > 0
        assert tree.stats.target_passes < plain.stats.target_passes or tree.stats.accepted_tokens == 0
        accepted += tree.stats.accepted_tokens
    assert accepted > 0  # the trees were exercised: some paths accepted and compacted


def test_typical_at_near_zero_temperature_is_greedy(medusa_decoder):
    _, decoder = medusa_decoder
    plain = decoder.generate([4, 2], SamplingParams(max_tokens=24), SpeculationConfig(method="off"))
    typical = decoder.generate([4, 2], SamplingParams(max_tokens=24, temperature=1e-4, seed=1),
                               SpeculationConfig(method="medusa", medusa=MedusaConfig(tree_acceptance="typical"),
                                                 fallback=FallbackConfig(enabled=False)))
    assert typical.token_ids == plain.token_ids


def test_sampling_through_the_loop_is_seeded(medusa_decoder):
    _, decoder = medusa_decoder
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=11)
    spec = SpeculationConfig(method="medusa", fallback=FallbackConfig(enabled=False))
    a, b = decoder.generate([1, 2], params, spec), decoder.generate([1, 2], params, spec)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_choices():
    parents, slots = choices_to_parents([(1,), (0,), (0, 0), (0, 1), (0, 0, 2)])
    assert parents == [-1, -1, 0, 0, 2] and slots == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2)]
    with pytest.raises(ValueError, match="no parent"):
        normalise_choices([(0,), (1, 0)])
    with pytest.raises(ConfigError, match="medusa_choices"):
        DeploymentConfig(medusa="x.safetensors", medusa_choices=((0, 0),))


def test_heads_file_round_trip(tmp_path):
    heads = random_heads(32, 32)
    vocab = torch.arange(0, 32, 2)
    path = save_medusa(tmp_path / "h.safetensors", heads, vocab, dtype=torch.float32)
    loaded = load_medusa(path)
    assert loaded.info == heads.info and torch.equal(loaded.candidate_vocab, vocab)
    h = torch.randn(5, 32)
    w = torch.randn(32, 32)
    assert torch.allclose(loaded.heads.logits(h, w), heads.logits(h, w), atol=1e-6)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # TensorRT-LLM's tensor names
        assert "medusa_heads.2.medusa_layers.0.linear.weight" in set(f.keys())
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError):
        load_medusa(tmp_path / "bad.safetensors")
    with pytest.raises(ModelLoadError, match="not found"):
        load_medusa(tmp_path / "missing.safetensors")


def test_candidate_vocab_limits_proposals(medusa_decoder):
    target, _ = medusa_decoder
    vocab = torch.tensor([3, 5, 8, 13, 21])
    drafter = MedusaDrafter(MedusaCheckpoint(random_heads(32, 32), vocab), target)
    proposal = drafter.tree(torch.randn(32), depth=3)
    assert set(proposal.tokens) <= set(vocab.tolist()) and proposal.parents == [-1, -1, 0, 0, 1, 2]
    assert drafter.tree(torch.randn(32), depth=1).parents == [-1, -1]


def test_deployment_round_trip_with_medusa():
    config = DeploymentConfig(medusa="heads.safetensors", medusa_choices=[[0], [0, 0]],
                              speculation=SpeculationConfig(method="medusa",
                                                            medusa=MedusaConfig(tree_acceptance=TreeAcceptance.TYPICAL)))
    again = DeploymentConfig.from_dict(json.loads(config.to_json()))
    assert again == config and again.medusa_choices == ((0,), (0, 0))


def test_verifiers_evaluate_only_the_rows_they_visit():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PARENTS) + 1, 10, generator=g)
    tokens = [int(logits[0].argmax()), 2, int(logits[1].argmax()), 6, 9, 4, 2, 8]
    visited: list[int] = []

    def row(i: int) -> torch.Tensor:
        visited.append(i)
        return logits[i]

    lazy = verify_tree_greedy(row, tokens, PARENTS)
    assert lazy == verify_tree_greedy(logits, tokens, PARENTS)
    assert visited == [0] + [i + 1 for i in lazy.path]  # the root, then each accepted node: nothing else
    probs = torch.softmax(logits, -1)
    for verify in (verify_tree_sampling, verify_tree_typical):
        a = verify(probs, tokens, PARENTS, torch.Generator().manual_seed(0))
        b = verify(lambda i: probs[i], tokens, PARENTS, torch.Generator().manual_seed(0))
        assert a == b
