"""Float32 CPU matmul candidates for an M-row pass over a model's linear layers, and the floor.

For every weight matrix of the model (q, k, v, o, gate, up, down of every layer, then the LM
head) one call per pass, M rows in; a pass's time is the sum. Candidates, interleaved in one
process (min over repeats: a busy machine only ever adds time):

- ``mkl``: ``F.linear`` (MKL: a GEMV for one row, other sgemm kernels by M);
- ``packed``: MKL's packed GEMM on weights reordered for 8 rows (the engine's previous path,
  rows padded to >= 4);
- ``mm_t``: ``torch.mm`` against a pre-transposed contiguous ``[in, out]`` weight;
- ``row``: :mod:`triton_backend.engines.torch.row_gemm` (row-invariant by construction).

``--floor`` also times a plain read of every weight (``sum``; the memory-bandwidth floor of a
decode step) and prints whether each candidate is row-invariant (row i of an M-row call equals
row i computed alone, for M = 1..9). Example::

    .venv/bin/python scripts/analysis/matmul_rows.py --rows 1,2,4,8,16 --repeats 5 --floor
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from triton_backend.engines.torch.packed_linear import packed_matmul, packed_weight, packing_available


def model_weights(target: str | None) -> list[torch.Tensor]:
    """The model's linear weights (real ones when ``target`` resolves, else SmolLM2-135M shapes)."""
    if target:
        from triton_backend.engines.torch.llama_forward import load_safetensors_weights
        from triton_backend.engines.torch.model_loading import resolve_model_path

        _, tensors = load_safetensors_weights(resolve_model_path(target)[0])
        names = [k for k in tensors if k.endswith("proj.weight")]
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        return [tensors[k].contiguous() for k in names] + [head.contiguous()]
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
    return [torch.randn(s) * 0.02 for s in shapes]


def candidates(weights: list[torch.Tensor]) -> dict[str, object]:
    out: dict[str, object] = {"mkl": lambda x, i: F.linear(x, weights[i])}
    if packing_available():
        packed = [packed_weight(w, 8) for w in weights]

        def packed_call(x: torch.Tensor, i: int) -> torch.Tensor:
            m = x.shape[0]
            if m == 1:
                return F.linear(x, weights[i])
            if m < 4:
                x = torch.cat([x, x.new_zeros(4 - m, x.shape[1])])
            return packed_matmul(x, packed[i], weights[i], None, 8)[:m]

        out["packed"] = packed_call
    transposed = [w.t().contiguous() for w in weights]
    out["mm_t"] = lambda x, i: torch.mm(x, transposed[i])
    import os

    from triton_backend.engines.torch import row_gemm
    for isa in ("avx2", "avx512"):
        os.environ["SPECBUILD_ROW_KERNEL_ISA"] = isa
        if row_gemm.cpu_isa() == isa:
            fn = row_gemm.load_row_gemm()
            if fn is not None:
                bound = [fn.bind(w) for w in weights]
                out[f"row_{isa}"] = lambda x, i, bound=bound: bound[i](x)
    del os.environ["SPECBUILD_ROW_KERNEL_ISA"]
    return out


def row_invariant(call, weight_index: int, width: int) -> bool:
    x = torch.randn(9, width)
    full = call(x, weight_index)
    return all(torch.equal(call(x[i:i + m], weight_index), full[i:i + m]) for m in range(1, 10) for i in range(10 - m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="model name or folder (default: random SmolLM2-135M shapes)")
    parser.add_argument("--rows", default="1,2,3,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--floor", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = model_weights(args.target)
    calls = candidates(weights)
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {m: {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights} for m in rows}
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    if args.floor:
        print(f"weights: {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MB in {len(weights)} matrices")
        for name, call in calls.items():
            print(f"{name}: row-invariant {row_invariant(call, 4, weights[4].shape[1])}")
    with torch.inference_mode():
        for _ in range(args.repeats):
            if args.floor:
                t0 = time.perf_counter()
                for w in weights:
                    w.sum()
                times[("read", 1)].append(time.perf_counter() - t0)
            for m in rows:
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    for i, w in enumerate(weights):
                        call(inputs[m][w.shape[1]], i)
                    times[(name, m)].append(time.perf_counter() - t0)
    best = {k: min(v) * 1e3 for k, v in times.items()}
    if args.floor:
        print(f"floor: reading every weight once {best[('read', 1)]:.1f} ms")
    step = best[("mkl", 1)]
    print("ms per pass (x the one-row mkl GEMV chain)")
    print("rows " + " ".join(f"{n:>16}" for n in calls))
    for m in rows:
        print(f"{m:4d} " + " ".join(f"{best[(n, m)]:8.1f} ({best[(n, m)] / step:4.2f})" for n in calls))


if __name__ == "__main__":
    main()
