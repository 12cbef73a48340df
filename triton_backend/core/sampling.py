"""Logits -> probabilities under penalties / temperature / top-k / top-p, applied
identically to the target (p) and the draft (q) so the rejection rule compares like with like.

History-dependent settings (TensorRT-LLM's semantics), applied to the raw logits first:

- **repetition penalty** ``r``: the logit of every token seen in the prompt or the output so
  far is divided by ``r`` when positive, multiplied by ``r`` when negative;
- **presence / frequency penalty**: ``presence * [count > 0] + frequency * count`` is
  subtracted, ``count`` being the token's occurrences in the *output* so far (prompt not counted);
- **min_tokens**: the end tokens are masked (-inf) while fewer than ``min_tokens`` tokens are out;
- **bad words**: a token sequence never generated: its last token is masked whenever the
  tokens before it end the history (a one-token bad word is always masked).

A row's history is the committed tokens plus, when verifying or drafting speculatively, the
draft tokens before that row: exactly the history plain decoding would have there. The
committed part is tracked incrementally per request (:class:`TokenHistory`); a row adds only
its few draft tokens (:class:`RowHistory`).

Structured output (a request's guide): each row is masked to the tokens the grammar allows
after that row's history (:class:`~triton_backend.core.grammar.GuideMatcher`), after the rules
above and before temperature / top-k / top-p, so the target (p) and a drafter (q) are
constrained identically and greedy decoding takes the argmax of the allowed tokens.

Log probabilities (``return_log_probs``) are those of the processed target distribution
*before* top-k / top-p truncation: ``log_softmax(penalised_logits / T)``, ``T`` the
temperature (1 for greedy decoding); ``top_log_probs`` alternatives are the most likely tokens
of that same distribution (:meth:`LogitsProcessor.log_probs_and_top`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from triton_backend.core.config import SamplingParams, TopLogProbs
from triton_backend.core.grammar import GuideMatcher


class TokenHistory:
    """One request's committed tokens, counted incrementally: seen in prompt or output
    (repetition), occurrences in the output (presence / frequency), and the tail bad words need.
    Only ever fed committed tokens (:meth:`sync`); drafts ride on a :class:`RowHistory`."""

    def __init__(self, prompt_len: int, tail: int) -> None:
        self.prompt_len = prompt_len
        self.tail_len = tail
        self.tokens: list[int] = []
        self._counted = 0  # tokens reflected in the tensors below
        self.seen: torch.Tensor | None = None  # [vocab] bool
        self.counts: torch.Tensor | None = None  # [vocab] float32: output occurrences

    def sync(self, committed: Sequence[int]) -> None:
        """Catch up with the committed tokens (a longer list than last time, same prefix)."""
        if len(committed) < len(self.tokens):
            raise ValueError("committed tokens never shrink")
        self.tokens.extend(int(t) for t in committed[len(self.tokens):])

    def tensors(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seen is None or self.counts is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.counts = torch.zeros(vocab, dtype=torch.float32)
        new = self.tokens[self._counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long)
            self.seen[ids] = True
            out = self.tokens[max(self._counted, self.prompt_len):]
            if out:
                self.counts.index_add_(0, torch.tensor(out, dtype=torch.long), torch.ones(len(out)))
            self._counted = len(self.tokens)
        return self.seen, self.counts


@dataclass(frozen=True)
class RowHistory:
    """One logits row's history: the request's committed tokens plus ``extra`` drafts."""

    base: TokenHistory
    extra: tuple[int, ...] = ()

    @property
    def generated(self) -> int:
        return max(0, len(self.base.tokens) - self.base.prompt_len) + len(self.extra)

    def tail(self, n: int) -> list[int]:
        """The last ``n`` tokens of the history."""
        if n <= 0:
            return []
        extra = list(self.extra[-n:])
        need = n - len(extra)
        return (self.base.tokens[-need:] if need > 0 else []) + extra


@dataclass(frozen=True)
class LogitsProcessor:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()  # masked until min_tokens
    bad_words: tuple[tuple[int, ...], ...] = ()
    history: TokenHistory | None = field(default=None, compare=False, repr=False)  # set: history-dependent
    penalised: bool = False  # penalties, min_tokens or bad words apply (else the history is the guide's alone)
    guide: GuideMatcher | None = field(default=None, compare=False, repr=False)  # structured output

    @classmethod
    def from_params(cls, params: SamplingParams, *, prompt_len: int = 0, end_ids: Sequence[int] = (),
                    bad_words: Sequence[Sequence[int]] = (), guide: GuideMatcher | None = None) -> "LogitsProcessor":
        """A request's processor. ``end_ids``: the tokens min_tokens holds back; ``bad_words``:
        token sequences beyond ``params.bad_token_ids`` (the tokenized ``params.bad_words``);
        ``guide``: the request's grammar state (structured output)."""
        banned = tuple(tuple(int(t) for t in w) for w in (*params.bad_token_ids, *bad_words) if len(w))
        history = None
        if params.history_dependent or guide is not None:
            history = TokenHistory(prompt_len, max((len(w) for w in banned), default=1) - 1)
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                   repetition_penalty=float(params.repetition_penalty), presence_penalty=float(params.presence_penalty),
                   frequency_penalty=float(params.frequency_penalty), min_tokens=params.min_tokens,
                   end_ids=tuple(sorted(set(int(t) for t in end_ids))), bad_words=banned, history=history,
                   penalised=params.history_dependent, guide=guide)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    # -- histories ------------------------------------------------------------------------
    def rows(self, committed: Sequence[int], extras: Sequence[Sequence[int]]) -> list[RowHistory] | None:
        """Histories of rows that follow ``committed`` then each of ``extras`` (None when the
        settings do not depend on history: every call below then ignores them)."""
        if self.history is None:
            return None
        self.history.sync(committed)
        if self.guide is not None:
            self.guide.sync(committed)
        return [RowHistory(self.history, tuple(int(t) for t in extra)) for extra in extras]

    def chain_rows(self, committed: Sequence[int], drafts: Sequence[int]) -> list[RowHistory] | None:
        """The ``len(drafts) + 1`` rows of a verified chain: row ``j`` follows ``drafts[:j]``."""
        return self.rows(committed, [drafts[:j] for j in range(len(drafts) + 1)])

    def scores(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None = None) -> torch.Tensor:
        """``logits`` [n, vocab] with the penalties, min_tokens and bad words of each row's
        history applied (float32; unchanged when ``histories`` is None)."""
        if logits.ndim != 2:
            raise ValueError(f"expected logits of shape [n, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        if histories is None:
            return logits
        if len(histories) != logits.shape[0]:
            raise ValueError(f"{len(histories)} histories for {logits.shape[0]} logits rows")
        return torch.stack([self._process(row, h) for row, h in zip(logits, histories)])

    def _process(self, row: torch.Tensor, history: RowHistory) -> torch.Tensor:
        penalised = self._penalise(row, history) if self.penalised else row
        if self.guide is None:
            return penalised
        return self.guide.constrain(penalised, history.extra, fallback=row)

    def _penalise(self, row: torch.Tensor, history: RowHistory) -> torch.Tensor:
        vocab = row.shape[0]
        seen, counts = history.base.tensors(vocab)
        if history.extra:
            extra = torch.tensor(history.extra, dtype=torch.long)
            seen = seen.clone()
            seen[extra] = True
            counts = counts.index_add(0, extra, torch.ones(len(extra)))
        if self.repetition_penalty != 1.0:
            r = self.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            row = row - self.presence_penalty * (counts > 0).float() - self.frequency_penalty * counts
        banned = [w[-1] for w in self.bad_words if len(w) == 1 or history.tail(len(w) - 1) == list(w[:-1])]
        if history.generated < self.min_tokens:
            banned.extend(self.end_ids)
        if banned:
            row = row.index_fill(0, torch.tensor([t for t in banned if t < vocab], dtype=torch.long), float("-inf"))
        return row

    def log_probs(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None,
                  tokens: Sequence[int]) -> list[float]:
        """Log probability of ``tokens[i]`` at row ``i`` (see the module doc for which distribution)."""
        return self.log_probs_and_top(logits, histories, tokens, 0)[0]

    def log_probs_and_top(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None,
                          tokens: Sequence[int], top: int) -> tuple[list[float], list[TopLogProbs]]:
        """:meth:`log_probs`, and per row the ``top`` most likely tokens of the same distribution
        with their log probabilities, most likely first (``[]`` when ``top`` is 0)."""
        scores = self.scores(logits, histories)  # [n, vocab]
        temperature = 1.0 if self.greedy else max(self.temperature, 1e-6)
        logp = torch.log_softmax(scores / temperature, dim=-1)
        chosen = [float(logp[i, t]) for i, t in enumerate(tokens)]
        if top <= 0:
            return chosen, []
        values, ids = torch.topk(logp[: len(tokens)], min(top, logp.shape[-1]), dim=-1)
        return chosen, [(tuple(i), tuple(v)) for i, v in zip(ids.tolist(), values.tolist())]

    def argmax(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None = None) -> torch.Tensor:
        """Greedy choice per row: the argmax of the penalised logits ``[n]``."""
        return self.scores(logits, histories).argmax(dim=-1)

    def draw(self, logits: torch.Tensor, history: RowHistory | None,
             generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """One token from one row of ``logits`` (``[1, vocab]``) after ``history``: the argmax
        when greedy (no distribution), else a sample from the processed distribution ``q``
        ``[vocab]``, returned with it (a drafter's proposal carries it to the verifier)."""
        histories = None if history is None else [history]
        if self.greedy:
            return int(self.argmax(logits, histories)[0].item()), None
        q = self.probs(logits, histories)[0]
        return sample(q, generator), q

    def probs(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None = None) -> torch.Tensor:
        """``logits`` [n, vocab] -> probabilities [n, vocab] (float32), after each row's
        history-dependent processing (``histories``, from :meth:`rows`).

        Greedy parameters give the one-hot distribution of the argmax."""
        logits = self.scores(logits, histories)
        if self.greedy:
            out = torch.zeros_like(logits)
            out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            return out
        # shifted by the row's maximum first (softmax is shift-invariant): a tiny temperature then
        # sends the others to -inf instead of turning every logit into +-inf and the softmax into NaN
        temperature = max(self.temperature, torch.finfo(logits.dtype).tiny)  # 5e-324 is 0.0 in float32
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
        vocab = logits.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (the top-1 always stays)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop_sorted = mass_before >= self.top_p
            drop_sorted[..., 0] = False  # even when top_p rounds to 0 in float32
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability vector (or unnormalised weights) ``[vocab]``: every
    sampled token of the loop is drawn here."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))
    return gen
