"""Drafting with an EAGLE drafter on a torch target: the family's core (:class:`FeatureDrafter`,
:class:`EagleSession`) and the EAGLE-1 drafter (:mod:`triton_backend.speculation.drafters.eagle_model`);
the EAGLE-3 drafter is :mod:`triton_backend.speculation.drafters.eagle3`.

The drafter's state per sequence is its layer's KV cache over pairs ``(feature_j,
token_{j+1})`` where ``feature_j`` is the TARGET's last hidden state at position ``j``
(EAGLE-3: its capture layers' outputs there, concatenated).
After each target pass the round (:mod:`triton_backend.speculation.eagle_round`) hands the session the
target's features at the positions it just verified and kept (:meth:`EagleSession.observe`);
at the next proposal they are fed in one step, whose last output is the drafter's guess of
the next feature, hence draft token 1; each further draft token is one more step on the
drafter's own feature (a chain). When sampling, each draft token is sampled from the
drafter's processed distribution ``q`` (over ``candidate_vocab`` when the file has one),
and those rows are the ``q`` of the rejection rule, so output stays the target's.

:meth:`EagleDrafter.draft_chain` is the batched core, a function of (features, tokens) for
many rows at once with one KV cache of ``B`` rows and a committed length per row; a
session is that core with ``B = 1``.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal
from triton_backend.speculation.drafters.eagle_model import EagleCheckpoint, EagleKV, TreeStep, load_eagle
from triton_backend.speculation.drafters.eagle_tree import DraftTree, TreeShape, grow_trees
from triton_backend.core.errors import ModelLoadError
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.row_gemm import BoundGemm, RowGemm


def target_kernel(target: Any) -> RowGemm | None:
    """The row kernel ``target``'s passes run on (a :class:`LlamaEngine` on it: float32 CPU,
    ``runtime.row_kernel``), which the drafter then uses too; None otherwise."""
    return target.forward_impl.kernel if isinstance(target, LlamaEngine) else None


FEED_TOGETHER = 8  # rows whose drafter lacks at most this many pairs are fed in one call; longer backlogs alone


def feed_groups(counts: Sequence[int]) -> list[list[int]]:
    """The rows fed together: every row with a short backlog (``<= FEED_TOGETHER`` new pairs, a
    round's accepted tokens) in one group, each longer one (a prompt) on its own, so a new
    request's prompt never pads the other rows' feed to its length."""
    short = [b for b, n in enumerate(counts) if n <= FEED_TOGETHER]
    groups = [short] if short else []
    return groups + [[b] for b, n in enumerate(counts) if n > FEED_TOGETHER]


class FeatureDrafter(ABC):
    """The EAGLE family's drafting core, shared by the EAGLE-1 drafter (:class:`EagleDrafter`)
    and the EAGLE-3 one (:mod:`triton_backend.speculation.drafters.eagle3`): chains, dynamic trees,
    one batched call for many sessions (:class:`EagleSession`). A subclass says which target
    features it reads (:attr:`capture_layers`), how its net feeds them and steps on its own
    output, and how its head ranks candidate tokens (``vocab``: candidate index -> target id,
    None: the whole vocabulary; ``q`` is zero outside the candidates)."""

    name = "eagle"
    capture_layers: tuple[int, ...] | None = None  # target layers whose outputs it reads; None: the last hidden state
    feature_size: int  # width of one position's target feature
    vocab_size: int  # the target's
    vocab: torch.Tensor | None  # [C] candidate index -> target token id, or None
    embed: torch.Tensor  # [vocab, H] the target's input embedding
    dtype: torch.dtype
    device: torch.device
    relative_cost: float
    kernel_name: str

    @abstractmethod
    def new_cache(self, rows: int, capacity: int = 256) -> EagleKV:
        """An empty drafter cache of ``rows`` rows."""

    @abstractmethod
    def cost_identity(self) -> str:
        """What identifies this drafter's cost on a machine (a cache key)."""

    @abstractmethod
    def _feed_net(self, features: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None) -> torch.Tensor:
        """Target features ``[B, T, feature_size]`` and the next tokens' embeddings ``[B, T, H]``
        at positions ``starts[b] + t`` -> the drafter's outputs ``[B, T, H]``."""

    @abstractmethod
    def _step_net(self, hidden: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None, tree: TreeStep | None = None) -> torch.Tensor:
        """One step on the drafter's own outputs ``[B, T, H]`` (chain positions or tree nodes)."""

    @abstractmethod
    def _small_logits(self, features: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, candidates] float32
        """Candidate logits of the drafter's outputs."""

    def _greedy(self, small: torch.Tensor) -> torch.Tensor:  # [B, candidates] -> token ids [B]
        best = small.argmax(-1)
        return self.vocab[best] if self.vocab is not None else best

    def _logits(self, features: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, vocab] (-inf off the candidates)
        return self._expand(self._small_logits(features))

    def _expand(self, small: torch.Tensor) -> torch.Tensor:  # [B, candidates] -> [B, vocab]
        if self.vocab is None:
            return small
        full = torch.full((small.shape[0], self.vocab_size), float("-inf"), device=small.device)
        full[:, self.vocab] = small
        return full

    @torch.inference_mode()
    def draft_chain(self, kv: EagleKV, starts: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                    counts: torch.Tensor, k: int, processors: Sequence[LogitsProcessor],
                    generators: Sequence[torch.Generator | None],
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` draft tokens per row, batched. Row ``b`` lives in cache row ``slots[b]`` of ``kv``
        (default ``b``; a scheduler keeps one :class:`EagleKV` with a row per engine slot).

        Row ``b`` has cached drafter positions ``< starts[b]`` and ``counts[b] >= 1`` new pairs
        (``features[b, :counts[b]]`` [T, H]: the target's features at ``starts[b] ..``;
        ``tokens[b, :counts[b]]``: the token after each). Padding beyond ``counts[b]`` is
        ignored. Afterwards row ``b``'s committed drafter length is ``starts[b] + counts[b]``
        (entries after it are the chain's own, overwritten next time).
        Returns draft tokens ``[B, k]`` and, when any row samples, ``q`` ``[B, k, vocab]``
        (one-hot rows for greedy rows)."""
        feature = self._feed(kv, starts, features, tokens, counts, processors, generators, slots)
        position = starts + counts
        drafted, qs = [], []
        sampling = any(not p.greedy for p in processors)
        for step in range(k):
            small = self._small_logits(feature)
            if sampling:
                token, q = self._choose(self._expand(small), processors, generators, sampling)
            else:  # every row greedy (drafts take no penalties): the argmax over the candidates
                token, q = self._greedy(small), None
            drafted.append(token)
            qs.append(q)
            if step + 1 < k:
                feature = self._step_net(feature[:, None], self.embed[token][:, None], position, kv, slots)[:, 0]
                position = position + 1
        probs = torch.stack(qs, 1) if sampling else None
        return torch.stack(drafted, 1), probs

    def _feed(self, kv: EagleKV, starts: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, processors: Sequence[LogitsProcessor], generators: Sequence[torch.Generator | None],
              slots: torch.Tensor | None) -> torch.Tensor:
        """Feed each row's new (feature, token) pairs; returns ``[B, H]``: the drafter's guess of
        the feature after each row's last pair (its first draft's feature)."""
        if features.ndim != 3 or tokens.shape != features.shape[:2] or not len(processors) == len(generators) == tokens.shape[0]:
            raise ValueError("features [B, T, H], tokens [B, T] and one processor and generator per row expected")
        groups = feed_groups(counts.tolist())
        if len(groups) == 1:
            rows = torch.arange(tokens.shape[0], device=self.device)
            out = self._feed_net(features.to(self.dtype), self.embed[tokens], starts, kv, slots)  # [B, T, H]
            return out[rows, counts - 1]
        # a long backlog (a prompt that just joined) is fed on its own: the rows with a few new pairs
        # are not padded to its width (each row's outputs are the same whichever rows it is fed with)
        slots = torch.arange(tokens.shape[0], device=self.device) if slots is None else slots
        roots: torch.Tensor | None = None
        for group in groups:
            index = torch.tensor(group, device=self.device)
            width = int(counts[index].max())
            out = self._feed_net(features[index, :width].to(self.dtype), self.embed[tokens[index, :width]], starts[index],
                                 kv, slots[index])
            last = out[torch.arange(len(group), device=self.device), counts[index] - 1]
            if roots is None:
                roots = last.new_empty((tokens.shape[0], last.shape[1]))
            roots[index] = last
        assert roots is not None
        return roots

    @torch.inference_mode()
    def draft_trees(self, kv: EagleKV, starts: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                    counts: torch.Tensor, shapes: Sequence[TreeShape], processors: Sequence[LogitsProcessor],
                    generators: Sequence[torch.Generator | None],
                    slots: torch.Tensor | None = None) -> list[DraftTree]:
        """A dynamic draft tree per row (:mod:`triton_backend.speculation.drafters.eagle_tree`), batched:
        the rows' pairs are fed as :meth:`draft_chain` feeds them, then each tree level is one
        drafter step over every row's frontier. Row ``b``'s committed drafter length is
        ``starts[b] + counts[b]`` afterwards (the tree's entries after it are overwritten next time)."""
        slots = torch.arange(tokens.shape[0], device=self.device) if slots is None else slots
        roots = self._feed(kv, starts, features, tokens, counts, processors, generators, slots)
        committed = (starts + counts).tolist()

        def step(inputs: torch.Tensor, ids: torch.Tensor, placement: TreeStep, rows: list[int]) -> torch.Tensor:
            return self._step_net(inputs, self.embed[ids], starts[rows], kv, slots[rows], placement)

        return grow_trees(roots, committed, shapes, processors, generators, head=self._small_logits, vocab=self.vocab,
                          expand=self._expand, step=step)

    @staticmethod
    def _choose(logits: torch.Tensor, processors: Sequence[LogitsProcessor], generators: Sequence[torch.Generator | None],
                sampling: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, rows = [], []
        for b, (proc, gen) in enumerate(zip(processors, generators)):
            token, q = proc.draw(logits[b:b + 1], None, gen)
            if q is not None:
                rows.append(q)
            elif sampling:
                rows.append(torch.nn.functional.one_hot(torch.tensor(token), logits.shape[-1]).float())
            tokens.append(token)
        return torch.tensor(tokens, device=logits.device), (torch.stack(rows) if sampling else None)

    def propose_trees(self, sessions: Sequence["EagleSession"], tokens: Sequence[Sequence[int]],
                      shapes: Sequence[TreeShape], processors: Sequence[LogitsProcessor],
                      generators: Sequence[torch.Generator | None]) -> list[DraftProposal]:
        """One draft tree per session in ONE batched drafter call (each level one step over all
        rows). Sessions that draft together share one cache (:meth:`EagleSession.bind`), unless
        there is one. A session lacking a feature proposes nothing."""
        ready = [i for i, (s, t) in enumerate(zip(sessions, tokens)) if s.backlog(t) is not None]
        out = [EMPTY_PROPOSAL] * len(sessions)
        if not ready:
            return out
        caches = [sessions[i].cache(len(tokens[i]) + shapes[i].depth) for i in ready]
        if any(c[0] is not caches[0][0] for c in caches):
            raise ValueError("sessions drafting together must share one drafter cache (EagleSession.bind)")
        backlogs = [sessions[i].backlog(tokens[i]) for i in ready]
        width = max(len(ids) for _, ids in backlogs)
        device = self.device
        feats = torch.zeros(len(ready), width, backlogs[0][0].shape[1], dtype=self.dtype, device=device)
        ids = torch.zeros(len(ready), width, dtype=torch.long, device=device)
        for b, (f, t) in enumerate(backlogs):
            feats[b, :len(t)], ids[b, :len(t)] = f, torch.tensor(t, dtype=torch.long)
        counts = torch.tensor([len(t) for _, t in backlogs], device=device)
        trees = self.draft_trees(caches[0][0], torch.tensor([c[2] for c in caches], device=device), feats, ids, counts,
                                    [shapes[i] for i in ready], [processors[i] for i in ready],
                                    [generators[i] for i in ready], torch.tensor([c[1] for c in caches], device=device))
        for i, (_, t), tree in zip(ready, backlogs, trees):
            sessions[i].fed(len(t))
            out[i] = DraftProposal(tree.tokens, tree.probs, tree.parents, tree.ranks, scores=tree.scores)
        return out

    def new_session(self) -> "EagleSession":
        return EagleSession(self)


class EagleDrafter(FeatureDrafter):
    """An EAGLE(-1) drafter reading the target's last hidden state, sharing the target's
    embedding and LM head."""

    def __init__(self, checkpoint: EagleCheckpoint, target: Any) -> None:
        """``target``: a torch-runtime engine (its ``model``, ``device``, ``vocab_size``)."""
        info = checkpoint.info
        config = target.model.config
        if info.hidden_size != int(config.hidden_size) or info.vocab_size != target.vocab_size:
            raise ModelLoadError(f"EAGLE drafter (hidden {info.hidden_size}, vocab {info.vocab_size}) does not fit the "
                                 f"target (hidden {config.hidden_size}, vocab {target.vocab_size})")
        self.info = info
        self.feature_size, self.vocab_size = info.hidden_size, info.vocab_size
        self.dtype, self.device = target.model.dtype, target.device
        self.net = checkpoint.net.to(device=self.device, dtype=self.dtype).eval()
        self.embed = target.model.get_input_embeddings().weight.detach()
        self.vocab = checkpoint.candidate_vocab.to(self.device) if checkpoint.candidate_vocab is not None else None
        head = target.model.get_output_embeddings().weight.detach()
        self.head = head[self.vocab] if self.vocab is not None else head
        layer = sum(p.numel() for p in self.net.parameters())
        self.relative_cost = (layer + self.head.numel()) / max(1, target.num_parameters())
        self.nominal_cost = self.relative_cost  # the parameter ratio: seeded sampling is priced by it
        kernel = target_kernel(target) if (self.dtype == torch.float32 and self.device.type == "cpu") else None
        self._head_gemm: BoundGemm | None = None
        if kernel is not None:  # on a copy: the caller's net (one being trained, say) keeps torch's layers
            self.net = copy.deepcopy(self.net)
            self.net.use_kernel(kernel)
            self._head_gemm = kernel.bind(self.head.contiguous())
        self.kernel_name = kernel.name if kernel is not None else "torch"  # part of its cached draft cost's key

    @classmethod
    def from_file(cls, path: str, target: Any) -> "EagleDrafter":
        return cls(load_eagle(path), target)

    def new_cache(self, rows: int, capacity: int = 256) -> EagleKV:
        return EagleKV.empty(self.info, rows, capacity, self.dtype, self.device)

    def cost_identity(self) -> str:
        return f"eagle:{sum(p.numel() for p in self.net.parameters())}:{int(self.head.shape[0])}:{self.kernel_name}"

    def _feed_net(self, features: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None) -> torch.Tensor:
        return self.net(features, embeds, starts, kv, slots)

    def _step_net(self, hidden: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None, tree: TreeStep | None = None) -> torch.Tensor:
        return self.net(hidden, embeds, starts, kv, slots, tree=tree)

    def _small_logits(self, features: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, candidates]
        if self._head_gemm is not None:
            return self._head_gemm(features.contiguous())
        return (features @ self.head.t()).float()


class EagleSession:
    """One sequence: the drafter's KV cache, its committed length, and target features not fed yet.

    Lazy by construction: while the controller pauses drafting, a round only hands over the
    target's features (kept as a list of chunks, no per-round copy); the drafter's layer runs
    again only at the next proposal, over the whole backlog in one pass."""

    def __init__(self, drafter: FeatureDrafter) -> None:
        self._drafter = drafter
        self._kv: EagleKV | None = None
        self._cached = 0  # drafter positions holding the target's features
        self._pending: list[torch.Tensor] = []  # [n_i, H] chunks: target features at positions _cached ..
        self._pending_len = 0
        self._row = 0  # this sequence's row in _kv

    @property
    def capture_layers(self) -> tuple[int, ...] | None:
        """The target layers whose outputs :meth:`observe` takes (an EAGLE-3 drafter's fused
        features); None: the target's last hidden state (EAGLE-1)."""
        return self._drafter.capture_layers

    @property
    def feature_end(self) -> int:
        """The first position whose target feature the session does not have yet."""
        return self._cached + self._pending_len

    def observe(self, start: int, features: torch.Tensor) -> None:
        """The target's features ``[n, H]`` at positions ``start .. start + n - 1`` (``start`` at
        most :attr:`feature_end`; earlier positions than that replace what was there)."""
        if start > self.feature_end:
            raise ValueError(f"features from position {start} leave a gap after {self.feature_end}")
        if start < self._cached:  # the target rewound past what the drafter cached
            self._cached, self._pending, self._pending_len = start, [], 0
        if start < self.feature_end:  # replace the tail (rare: the loops hand over from feature_end)
            kept = torch.cat(self._pending)[: start - self._cached]
            self._pending, self._pending_len = [kept], int(kept.shape[0])
        self._pending.append(features.detach())
        self._pending_len += int(features.shape[0])

    def bind(self, kv: EagleKV, row: int) -> None:
        """Keep this sequence's drafter cache in row ``row`` of ``kv`` (a batch scheduler's cache
        shared by its EAGLE rows, so one drafter call drafts for all of them); starts empty."""
        self.release()
        self._kv, self._row = kv, row

    def backlog(self, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The pairs the drafter lacks before drafting after ``tokens``: features ``[new, H]`` and
        the tokens after them; None when it lacks a feature (nothing can be drafted)."""
        new = len(tokens) - 1 - self._cached  # pairs (feature_j, token_{j+1}) for j < len(tokens) - 1
        if new < 1 or self._pending_len < new:
            return None
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        return pending[:new], list(tokens[self._cached + 1:])

    def cache(self, length: int) -> tuple[EagleKV, int, int]:
        """(the cache, this sequence's row in it, its committed drafter length) for a proposal
        after ``length`` tokens."""
        if self._kv is None:
            self._kv, self._row = self._drafter.new_cache(1, max(256, length + 16)), 0
        return self._kv, self._row, self._cached

    def fed(self, new: int) -> None:
        """``new`` pairs of the backlog are now in the drafter's cache."""
        self._cached += new
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        rest = pending[new:]
        self._pending, self._pending_len = ([rest] if rest.shape[0] else []), int(rest.shape[0])

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        """``k`` tokens after ``tokens``; needs the target's features up to ``len(tokens) - 2``."""
        backlog = self.backlog(tokens) if k > 0 else None
        if backlog is None:
            return EMPTY_PROPOSAL
        drafter, (features, ids) = self._drafter, backlog
        kv, row, cached = self.cache(len(tokens) + k)
        device = drafter.device
        drafted, probs = drafter.draft_chain(kv, torch.tensor([cached], device=device), features[None],
                                             torch.tensor([ids], dtype=torch.long, device=device),
                                             torch.tensor([len(ids)], device=device), k, [processor], [generator],
                                             torch.tensor([row], device=device))
        self.fed(len(ids))
        return DraftProposal(tokens=drafted[0].tolist(), probs=None if probs is None else probs[0])

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape, processor: LogitsProcessor,
                     generator: torch.Generator | None) -> DraftProposal:
        """A dynamic draft tree of ``shape`` after ``tokens`` (:meth:`EagleDrafter.propose_trees` for one sequence)."""
        return self._drafter.propose_trees([self], [tokens], [shape], [processor], [generator])[0]

    def release(self) -> None:
        self._kv, self._pending, self._pending_len, self._cached, self._row = None, [], 0, 0, 0

