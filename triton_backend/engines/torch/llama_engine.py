"""The slot engine: the compact Llama forward over a static KV cache (the :class:`BatchedEngine`
contract of :mod:`triton_backend.engines.batch`), plus per-sequence sessions over a slot
(:class:`SlotSession`) for the speculative loop and drafters.

A session remembers the tokens its slot holds. The loop's token lists extend what is cached
(the committed prefix plus new drafts), so a call checks lengths and the last few cached
tokens instead of diffing the whole list; a list that ends differently from the cache
(rollback) is compared to find where they part. Rollback itself is bookkeeping: the next row
starts earlier.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.engines.torch.cpu_cores import usable_cores
from triton_backend.engines.torch.compact_weights import (HEAD, LAYER_LINEARS, CompactLinear, compact_linear, compact_linears,
                                                          head_precision, linear_names)
from triton_backend.engines.torch.weight_gemm import WeightFormat, load_weight_gemm
from triton_backend.engines.batch import BatchRow, RowOutput
from triton_backend.engines.torch.kv_cache import SlotKVCache
from triton_backend.engines.torch.llama_forward import LlamaForward, RowPlan, run_layers
from triton_backend.engines.torch.row_gemm import RowGemm, load_row_gemm
from triton_backend.engines.torch.heap import trim_heap
from triton_backend.engines.torch.hf_engine import configure_threads
from triton_backend.core.eos import eos_token_ids as model_eos
from triton_backend.core.errors import ContextLengthError, InvalidRequestError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_TAIL = 16  # cached tokens compared on the fast path


def _row_kernel(runtime: RuntimeConfig, device: torch.device) -> RowGemm | None:
    """The row-invariant CPU matmul where this runtime can use it (float32, one torch thread)."""
    if not runtime.row_kernel or device.type != "cpu" or runtime.dtype != "float32":
        return None
    if runtime.num_threads != 1:
        logger.info("the row-invariant CPU kernel runs with one torch thread: %d threads keep torch's kernels",
                    runtime.num_threads)
        return None
    kernel = load_row_gemm()
    if kernel is not None:
        kernel.set_threads(kernel_threads(runtime.kernel_threads))
    return kernel


def kernel_threads(configured: int) -> int:
    """The row kernel's thread count for ``runtime.kernel_threads`` (0: the cores this process may
    run on, within its cgroup CPU quota, at most 8)."""
    return configured if configured else usable_cores(8)


def _quantize_at_load(model: PreTrainedModel, runtime: RuntimeConfig) -> dict[str, CompactLinear]:
    """The model's decoder linears in ``runtime.weights`` (round to nearest), and its LM head in the
    same precision when ``runtime.quantize_lm_head``, else in float16 (as TensorRT-LLM checkpoints keep it)."""
    tensors = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        compact = compact_linears(tensors, linear_names(len(model.base_model.layers), head=False), runtime.weights,
                                  runtime.int4_group_size)
        head = model.get_output_embeddings()
        if isinstance(head, torch.nn.Linear):
            group = next(iter(compact.values())).weight.group  # the decoder's int4 group (0 for other formats)
            compact[HEAD] = compact_linear(head.weight.detach(), head_precision(runtime), group)
    return compact


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: a pass on an accelerator hands its logits to the host, where verification,
    sampling and logits processing run (one copy per pass); hidden states and captured features stay
    on the device for the drafters, which run beside the target."""
    return t if t.device.type == "cpu" else t.to("cpu")


def _placed(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` on ``device`` with floating tensors in ``dtype``, in eval mode. Tensors without storage
    (meta: linears a streamed load never materialised, or released) stay as they are."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return model.to(device=device, dtype=dtype).eval()

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)

    return model._apply(move).eval()


def _precision_of(compact: Mapping[str, CompactLinear]) -> WeightPrecision:
    """The precision of the decoder linears (the LM head may differ: a checkpoint keeps it 16-bit)."""
    formats = {c.weight.format for name, c in compact.items() if name != HEAD}
    if len(formats) != 1:
        raise ValueError(f"the decoder linears mix weight formats: {sorted(f.name for f in formats)}")
    return {WeightFormat.INT8: WeightPrecision.INT8, WeightFormat.INT4: WeightPrecision.INT4,
            WeightFormat.FLOAT16: WeightPrecision.FLOAT16, WeightFormat.BFLOAT16: WeightPrecision.BFLOAT16,
            WeightFormat.FP8: WeightPrecision.FP8}[formats.pop()]


class LlamaEngine:
    """A Llama-family model on the compact forward with ``runtime.max_batch_size`` slots of
    ``runtime.max_seq_len`` positions. ``model`` (the Hugging Face module whose parameters the
    forward shares) stays reachable for its config, LM head and reference forwards."""

    def __init__(self, model: PreTrainedModel, *, name: str = "model", runtime: RuntimeConfig | None = None,
                 eos_token_ids: Sequence[int] | None = None, max_context: int | None = None,
                 compact: Mapping[str, CompactLinear] | None = None) -> None:
        """``compact``: linears already in a compact precision (a checkpoint's quantized tensors,
        :mod:`~triton_backend.engines.torch.trtllm_weights`); else ``runtime.weights`` other than
        float32 quantizes the model's float weights here."""
        runtime = runtime or RuntimeConfig()
        configure_threads(runtime.num_threads)
        self.runtime = runtime
        self.device = torch.device(runtime.device)
        self.model = _placed(model, self.device, _DTYPES[runtime.dtype])
        self.name = name
        pack = runtime.packed_gemm_rows if self.device.type == "cpu" else 0
        row_gemm = _row_kernel(runtime, self.device)
        if compact is None and runtime.weights is not WeightPrecision.FLOAT32:
            compact = _quantize_at_load(self.model, runtime)
        weight_gemm = load_weight_gemm() if compact and row_gemm is not None else None
        if compact and weight_gemm is None:
            logger.warning("%s: no compact-weight kernel here (%s): its %s weights run decoded to float32 on torch's "
                           "kernels (same values, float speed)", name, self.device, _precision_of(compact).value)
        self.forward_impl = LlamaForward.from_module(self.model, pack_rows=pack, invariant=runtime.batch_invariant,
                                                     row_gemm=row_gemm, compact=compact, weight_gemm=weight_gemm)
        self.weights = _precision_of(compact) if compact else WeightPrecision.FLOAT32  # what the decoder linears hold
        # all-decode batches attend in one padded product unless rows must be bit-identical to alone
        self.batched_decode = not (runtime.batch_invariant or self.forward_impl.row_invariant)
        kernel = self.forward_impl.kernel
        self.kernel_name = kernel.name if kernel is not None else "torch"  # which matmul kernels run (logged, cache keys)
        self.threads = kernel.threads if kernel is not None else torch.get_num_threads()  # CPU threads a pass runs on
        if weight_gemm is not None:
            self.kernel_name += f"+{weight_gemm.name}"
        shape = self.forward_impl.shape
        self.hidden_size = shape.hidden_size
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "full_vocab_size", None) or head.weight.shape[0])
        limit = int(max_context or getattr(model.config, "max_position_embeddings", runtime.max_seq_len))
        self.max_context = min(limit, runtime.max_seq_len)
        self.num_slots = runtime.max_batch_size
        self.dtype = self.model.dtype  # read once: the module's property walks its parameters (every pass did)
        self.cache = SlotKVCache(shape.num_layers, self.num_slots, shape.num_kv_heads, self.max_context,
                                 shape.head_dim, self.dtype, self.device)
        self.eos_token_ids = (model_eos(model.config) if eos_token_ids is None
                              else frozenset(int(t) for t in eos_token_ids))
        self.forward_calls = 0
        logger.info("slot engine %r: %d slots x %d positions, KV cache %.1f MiB (%s, %s), matmul kernel %s", name,
                    self.num_slots, self.max_context, self.kv_cache_bytes() / 2**20, self.model.dtype, self.device,
                    self.kernel_name)

    # -- the BatchedEngine contract ---------------------------------------------------------
    def allocate(self) -> int:
        return self.cache.allocate()

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes()

    def linear_weight_bytes(self) -> int:
        """What the engine holds for its linear layers beside the module's parameters: float32
        panels of the row kernel, or the compact weights (int8/int4 values and scales, 16-bit values)."""
        return self.forward_impl.packed_bytes()

    def release_float_linears(self, *, keep_head: bool = False) -> int:
        """Free the module's float weights of the linears this engine holds in compact weights: every
        decoder linear, and the LM head unless ``keep_head`` or it is the embedding too. They become
        meta tensors (shape and dtype kept, no storage), so the process holds the compact weights
        beside the float embedding and norms. For the loader that knows nothing else reads them (a
        drafter sharing the target's layers or head does); the module's own forward no longer runs.
        Returns the bytes released (0 when the linears are float32)."""
        if self.weights is WeightPrecision.FLOAT32:
            return 0
        modules = [layer.get_submodule(name) for layer in self.model.base_model.layers for name in LAYER_LINEARS]
        head = self.model.get_output_embeddings()
        head_compact = self.forward_impl.head is not None and self.forward_impl.head.compact is not None
        if head_compact and not keep_head and head.weight is not self.model.get_input_embeddings().weight:
            modules.append(head)
        freed = 0
        for module in modules:
            weight = module.weight
            if weight.is_meta:
                continue
            freed += weight.numel() * weight.element_size()
            module.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        del weight
        trim_heap()
        logger.info("%s: released %.1f MiB of float linear weights (%d layers; compact copies serve them)", self.name,
                    freed / 2**20, len(modules))
        return freed

    def resident_weight_bytes(self) -> int:
        """The weights this engine holds: the module's parameters that have storage (a tied one
        once), the linears' compact weights or kernel panels, and float32 decodings of compact
        weights where no compact kernel runs."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta)
        decoded = sum(l.weight.numel() * l.weight.element_size() for l in self.forward_impl.linears
                      if l.compact is not None and l.weight is not None)
        return params + self.linear_weight_bytes() + decoded

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return _to_host(self.forward_impl.head_logits(hidden))

    def keep_tree_path(self, slot: int, root_length: int, path: Sequence[int]) -> None:
        self.cache.check_taken(slot)
        if any(b <= a for a, b in zip(path, path[1:])) or any(i < 0 for i in path):
            raise ValueError(f"a tree path lists ascending node indices, got {list(path)}")
        if path and root_length + path[-1] >= self.max_context:
            raise ValueError("tree path lies beyond the slot")
        if list(path) != list(range(len(path))):  # nodes already in place need no move
            self.cache.move_positions(slot, [root_length + i for i in path], root_length)

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Exact: a position's keys and values depend only on the tokens up to it (the same
        property that lets a long prompt prefill in chunks)."""
        self.cache.check_taken(source)
        self.cache.check_taken(destination)
        if not 0 <= length <= self.max_context:
            raise ValueError(f"cannot copy {length} positions of a {self.max_context}-position slot")
        self.cache.copy_prefix(source, destination, length)

    def copy_kv_from(self, source: "LlamaEngine", source_slot: int, slot: int, start: int, end: int,
                     layers: Sequence[int] | None = None) -> None:
        """Positions ``start .. end - 1`` of ``source``'s slot into ``slot``: a draft over the same
        model taking the target's keys and values for context it would otherwise prefill itself.
        ``layers``: the ``source`` layer of each of this engine's layers (a layer-skip draft's kept
        layers; None: the same layers). Not exact for this engine's own forward (the values are the
        source's): for a draft, whose every token is verified."""
        source.cache.check_taken(source_slot)
        self.cache.check_taken(slot)
        mine, theirs = self.forward_impl.shape, source.forward_impl.shape
        wanted = list(range(mine.num_layers)) if layers is None else list(layers)
        if (len(wanted) != mine.num_layers or any(not 0 <= i < theirs.num_layers for i in wanted)
                or (mine.num_kv_heads, mine.head_dim) != (theirs.num_kv_heads, theirs.head_dim)
                or self.dtype != source.dtype):
            raise ValueError(f"{self.name} cannot take keys and values of {source.name} (layers {wanted})")
        if not 0 <= start <= end <= min(self.max_context, source.max_context):
            raise ValueError(f"cannot copy positions {start}..{end} between {self.name} and {source.name}")
        self.cache.copy_from(source.cache, source_slot, slot, start, end, None if layers is None else wanted)

    def forward(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        if not rows:
            return []
        ids, positions, plans, out_index = self._plan(rows)
        capture = frozenset(i for r in rows for i in r.capture)
        if any(not 0 <= i < self.forward_impl.shape.num_layers for i in capture):
            raise ValueError(f"capture layers {sorted(capture)} outside the target's {self.forward_impl.shape.num_layers}")
        with torch.inference_mode():
            hidden, captured = run_layers(self.forward_impl, self.cache, ids, positions, plans, out_index,
                                          batched_decode=self.batched_decode, capture=capture)
            wanted = [i for i, r in enumerate(rows) if r.return_logits]
            logits = self._row_logits(rows, hidden, wanted)
        self.forward_calls += 1
        outputs, at = [], 0
        for i, row in enumerate(rows):
            end = at + row.num_logits
            features = torch.cat([captured[li][at:end] for li in row.capture], -1) if row.capture else None
            outputs.append(RowOutput(logits=logits.get(i), hidden=hidden[at:end] if row.return_hidden else None,
                                     features=features))
            at = end
        return outputs

    def _row_logits(self, rows: Sequence[BatchRow], hidden: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
        """One LM-head product over every row that asked for logits."""
        if not wanted:
            return {}
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + r.num_logits)
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in wanted]).to(self.device)
        logits = _to_host(self.forward_impl.head_logits(hidden.index_select(0, index)))
        out, at = {}, 0
        for i in wanted:
            out[i] = logits[at:at + rows[i].num_logits]
            at += rows[i].num_logits
        return out

    def _plan(self, rows: Sequence[BatchRow]) -> tuple[torch.Tensor, torch.Tensor, list[RowPlan], torch.Tensor]:
        from triton_backend.engines.torch.tree_attention import tree_attention_inputs

        seen: set[int] = set()
        ids: list[int] = []
        positions: list[int] = []
        plans: list[RowPlan] = []
        out_index: list[int] = []
        dtype = self.dtype
        for row in rows:
            if row.slot in seen:
                raise InvalidRequestError(f"slot {row.slot} appears twice in one batched pass")
            seen.add(row.slot)
            self.cache.check_taken(row.slot)
            n, end = len(row.tokens), row.start + len(row.tokens)
            if end > self.max_context:
                raise ContextLengthError(f"sequence of {end} tokens exceeds the engine's context of {self.max_context}")
            offset = len(ids)
            ids.extend(int(t) for t in row.tokens)
            # a "tree" that is a chain (or has no node: a paused tree drafter's row) sees exactly what a
            # causal row sees at the same positions: run it as one (no mask built, the cheap path)
            tree = row.tree_parents is not None and not all(p == i - 1 for i, p in enumerate(row.tree_parents))
            if tree:
                nodes = len(row.tree_parents)
                mask4, pos = tree_attention_inputs(row.tree_parents, row.start, n - nodes, dtype, self.device)
                mask = mask4[0, 0]
                positions.extend(pos[0].tolist())
            else:
                mask = None if n == 1 else _causal_mask(row.start, n, dtype, self.device)
                positions.extend(range(row.start, end))
            plans.append(RowPlan(row.slot, row.start, offset, n, mask, tree=tree))
            out_index.extend(range(offset + n - row.num_logits, offset + n))
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        return as_long(ids), as_long(positions), plans, as_long(out_index)

    # -- per-sequence sessions for the loop -------------------------------------------------
    def new_session(self) -> "SlotSession":
        return SlotSession(self)

    def __repr__(self) -> str:
        return (f"LlamaEngine({self.name!r}, vocab={self.vocab_size}, context={self.max_context}, "
                f"slots={self.num_slots}, device={self.device})")


def _causal_mask(start: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[n, start + n]``: new token ``i`` sees positions ``<= start + i``."""
    full = torch.full((n, start + n), torch.finfo(dtype).min, dtype=dtype, device=device)
    return full.triu(start + 1)


class SlotSession:
    """One sequence on one slot of a :class:`LlamaEngine` (the :class:`EngineSession` protocol,
    plus the tree calls of :mod:`triton_backend.speculation.tree_round`). The slot is allocated at once
    (:class:`SlotsExhaustedError` when none is free) and given back on :meth:`release` or
    when the session is garbage-collected."""

    def __init__(self, engine: LlamaEngine) -> None:
        self._engine = engine
        self.slot: int | None = None
        self._finalizer: weakref.finalize | None = None
        self._acquire()
        self._cached: list[int] = []
        self._tree: list[int] = []  # draft nodes written after the cached tokens, until keep_tree_path
        self.forward_calls = 0
        self.pass_time_s = 0.0  # in the engine's passes and LM-head products (what a round costs beyond them: the rest)

    def _acquire(self) -> int:
        if self.slot is None:
            self.slot = self._engine.allocate()
            self._finalizer = weakref.finalize(self, self._engine.release, self.slot)
        return self.slot

    @property
    def cached_length(self) -> int:
        return len(self._cached)

    def _shared_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the cache holds, in O(``CHECK_TAIL``) where the loop's
        guarantee holds: its lists share the cache's prefix up to the last few positions
        (rejected drafts), so only the last ``CHECK_TAIL`` shared positions are compared. A
        list that already differs at the start of that window is compared from the beginning."""
        cached = self._cached
        m = min(len(cached), len(tokens))
        tail = max(0, m - CHECK_TAIL)
        if list(tokens[tail:m]) == cached[tail:m]:
            return m
        i = tail if tail == 0 or tokens[tail] == cached[tail] else 0
        while i < m and tokens[i] == cached[i]:
            i += 1
        return i

    def _row(self, tokens: Sequence[int], num_last: int, tree: Sequence[int] = (), parents: Sequence[int] | None = None,
             *, hidden: bool = False, logits: bool = True, capture: tuple[int, ...] = ()) -> RowOutput:
        n = len(tokens)
        if n + len(tree) > self._engine.max_context:
            raise ContextLengthError(f"sequence of {n + len(tree)} tokens exceeds the model context of "
                                     f"{self._engine.max_context}")
        self.keep_tree_path([])
        keep = min(self._shared_prefix(tokens), n - num_last)
        new = list(tokens[keep:]) + list(tree)
        row = BatchRow(self._acquire(), keep, new, num_logits=num_last + len(tree), tree_parents=parents,
                       return_hidden=hidden, return_logits=logits, capture=capture)
        started = time.perf_counter()
        out = self._engine.forward([row])[0]
        self.pass_time_s += time.perf_counter() - started
        del self._cached[keep:]
        self._cached.extend(tokens[keep:])
        self._tree = list(tree)
        self.forward_calls += 1
        return out

    def logits(self, tokens: Sequence[int], num_last: int) -> torch.Tensor:
        if not 1 <= num_last <= len(tokens):
            raise ValueError(f"num_last must be in [1, {len(tokens)}], got {num_last}")
        return self._row(tokens, num_last).logits

    def adopt_prefix(self, source: "SlotSession", tokens: Sequence[int], limit: int,
                     layers: Sequence[int] | None = None) -> None:
        """Take the keys and values of the positions before ``limit`` of ``tokens`` that ``source``
        (a session of another engine over the same model) holds and this session does not
        (:meth:`LlamaEngine.copy_kv_from`): a draft taking the target's context."""
        have = self._shared_prefix(tokens)
        end = min(limit, source._shared_prefix(tokens))
        if end > have and source.slot is not None:
            self._engine.copy_kv_from(source._engine, source.slot, self._acquire(), have, end, layers)
            self.keep_tree_path([])
            del self._cached[have:]
            self._cached.extend(tokens[have:end])

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (bookkeeping)."""
        self.keep_tree_path([])
        del self._cached[length:]

    def tree_hidden(self, tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Last hidden states ``[1 + n, hidden]`` for the last committed token and each tree
        node, in one pass with tree attention; the nodes stay in the slot until :meth:`keep_tree_path`."""
        return self._row(tokens, 1, tree_tokens, list(parents), hidden=True, logits=False).hidden

    def tree_features(self, tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
                      capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`tree_hidden` and, from the same pass, the ``capture`` layers' outputs at the
        same rows, concatenated: ``([1 + n, hidden], [1 + n, len(capture) * hidden])``."""
        out = self._row(tokens, 1, tree_tokens, list(parents), hidden=True, logits=False, capture=tuple(capture))
        assert out.hidden is not None and out.features is not None
        return out.hidden, out.features

    def tree_logits(self, tokens: Sequence[int], tree_tokens: Sequence[int],
                    parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._row(tokens, 1, tree_tokens, list(parents), hidden=True)
        return out.logits, out.hidden

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        logits = self._engine.head_logits(hidden)
        self.pass_time_s += time.perf_counter() - started
        return logits

    def keep_tree_path(self, path: Sequence[int]) -> None:
        if not self._tree:
            if path:
                raise ValueError("no draft tree in the cache")
            return
        self._engine.keep_tree_path(self._acquire(), len(self._cached), path)
        self._cached.extend(self._tree[i] for i in path)
        self._tree = []

    def release(self) -> None:
        """Give the slot back (a later call takes a slot again, starting empty)."""
        self._cached = []
        self._tree = []
        if self._finalizer is not None:
            self._finalizer()
        self.slot, self._finalizer = None, None


__all__ = ["LlamaEngine", "SlotSession"]
