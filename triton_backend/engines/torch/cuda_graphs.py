"""Run a :class:`~triton_backend.engines.torch.static_decode.StaticDecoder`'s passes eagerly, as
one CUDA graph per bucket, or through ``torch.compile(mode="reduce-overhead")``.

- ``eager``: the pass as written (every device; what CPU runs).
- ``graph``: per bucket, static input buffers, a warm-up on a side stream, one
  ``torch.cuda.CUDAGraph`` capture; later passes of that bucket copy their inputs into the
  buffers and replay (a few microseconds of host time for the whole pass). Graphs share one
  memory pool; replays are sequential, so they never overlap.
- ``compile``: ``torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)``:
  Inductor's fused kernels, captured by its own CUDA graphs, one compilation per bucket shape.
  The KV cache is marked a static address so its in-place writes stay inside the graph.

The logits a graph returns live in its static output buffer: valid until the next pass of the
same bucket (read or copy them first). CUDA-only modes refuse a CPU decoder with a clear error.
"""

from __future__ import annotations

import enum
import logging
from typing import Callable

import torch

from triton_backend.engines.torch.static_decode import Bucket, StaticDecoder, StaticInputs

logger = logging.getLogger(__name__)


class PassMode(str, enum.Enum):
    EAGER = "eager"
    GRAPH = "graph"
    COMPILE = "compile"


class _Captured:
    def __init__(self, inputs: StaticInputs, output: torch.Tensor, graph: torch.cuda.CUDAGraph) -> None:
        self.inputs, self.output, self.graph = inputs, output, graph


class PassRunner:
    """``runner(bucket, inputs) -> logits [R, T, vocab]`` in one :class:`PassMode`."""

    def __init__(self, decoder: StaticDecoder, mode: PassMode | str = PassMode.EAGER, *, warmup: int = 2) -> None:
        self.decoder, self.mode = decoder, PassMode(mode)
        if self.mode is not PassMode.EAGER and decoder.device.type != "cuda":
            raise ValueError(f"pass mode {self.mode.value!r} needs a CUDA device; this decoder is on {decoder.device}")
        self.warmup = warmup
        self._graphs: dict[Bucket, _Captured] = {}
        self._pool = None
        self._compiled: Callable[[StaticInputs, int], torch.Tensor] | None = None
        if self.mode is PassMode.COMPILE:
            for t in (decoder.cache.keys, decoder.cache.values):
                torch._dynamo.mark_static_address(t)
            self._compiled = torch.compile(decoder.step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    @property
    def captured(self) -> int:
        """Buckets captured so far (graph mode)."""
        return len(self._graphs)

    def __call__(self, bucket: Bucket, inputs: StaticInputs) -> torch.Tensor:
        with torch.no_grad():
            if self.mode is PassMode.EAGER:
                return self.decoder.step(inputs, bucket.context)
            if self.mode is PassMode.COMPILE:
                assert self._compiled is not None
                return self._compiled(inputs, bucket.context)
            entry = self._graphs.get(bucket)
            if entry is None:
                entry = self._graphs[bucket] = self._capture(bucket, inputs)
            else:
                entry.inputs.copy_(inputs)
            entry.graph.replay()
            return entry.output

    def _capture(self, bucket: Bucket, inputs: StaticInputs) -> _Captured:
        """Warm up on a side stream (library handles, allocator), then capture. Every warm-up pass
        and the capture write the same keys and values at the same positions: idempotent."""
        static = StaticInputs(**{k: v.clone() for k, v in inputs.tensors().items()})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.decoder.step(static, bucket.context)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.decoder.step(static, bucket.context)
        logger.info("captured bucket %s as a CUDA graph", bucket)
        return _Captured(static, output, graph)


__all__ = ["PassMode", "PassRunner"]
