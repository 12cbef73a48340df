"""Weight-only quantized CPU matmuls against the float32 row kernel, on SmolLM2-135M's shapes.

For each shape class (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536: 30 distinct
matrices each, as a decode step streams them; the LM head 49152x576 once) and M rows in, the time
of one call per matrix, for:

A group of 128 does not divide 576: those classes run group 64 in the ``g128`` rows.

- ``fp32``: the float32 row kernel (:mod:`triton_backend.engines.torch.row_gemm`);
- ``int8``, ``int4-g{32,64,128}``, ``fp16``, ``bf16``: the compact-weight kernel
  (:mod:`triton_backend.engines.torch.weight_gemm`; weights decoded in registers, float32 chain);
- ``ort-fp32``, ``ort-q4-g*`` / ``ort-q8-g*`` (``--ort``): ONNX Runtime's MatMul and block-wise
  ``MatMulNBits`` (accuracy level 4, its fastest), one session per class whose graph holds all of the
  class's matrices (one ``run`` per class: ORT's per-call overhead left out, its best case).

Variants are interleaved within each repeat on this busy machine; the table gives the median over
repeats (ms per class, and the whole step: all classes) and each variant's speed-up over ``fp32``,
then the step from each class's minimum (a busy machine only ever adds time).
``--check`` also says whether row i of an 8-row call equals row i alone (row invariance). One thread::

    .venv/bin/python scripts/analysis/quant_matmul.py --rows 1,2,4,8 --repeats 7 --ort --check
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from triton_backend.engines.torch.quantize_weights import quantize_int4, quantize_int8
from triton_backend.engines.torch.row_gemm import load_row_gemm
from triton_backend.engines.torch.weight_gemm import load_weight_gemm, pack_float, pack_int4, pack_int8

CLASSES = {"q/o 576x576": ((576, 576), 60), "k/v 192x576": ((192, 576), 60), "gate/up 1536x576": ((1536, 576), 60),
           "down 576x1536": ((576, 1536), 30), "head 49152x576": ((49152, 576), 1)}
Layer = Callable[[torch.Tensor], torch.Tensor]


def fit(group: int, w: torch.Tensor) -> int:
    return group if w.shape[1] % group == 0 else 64


def our_variants(weights: dict[str, list[torch.Tensor]], groups: list[int]) -> dict[str, dict[str, list[Layer]]]:
    row, qk = load_row_gemm(), load_weight_gemm()
    if row is None or qk is None:
        raise SystemExit("the row kernels do not build here")
    out: dict[str, dict[str, list[Layer]]] = {"fp32": {}, "int8": {}, "fp16": {}, "bf16": {}}
    out.update({f"int4-g{g}": {} for g in groups})
    for name, ws in weights.items():
        out["fp32"][name] = [row.bind(w) for w in ws]
        out["int8"][name] = [qk.bind(pack_int8(*quantize_int8(w))) for w in ws]
        out["fp16"][name] = [qk.bind(pack_float(w.half())) for w in ws]
        out["bf16"][name] = [qk.bind(pack_float(w.bfloat16())) for w in ws]
        for g in groups:  # a group that does not divide the width falls back to 64 (the planner's rule)
            out[f"int4-g{g}"][name] = [qk.bind(pack_int4(*quantize_int4(w, fit(g, w)), fit(g, w))) for w in ws]
    return out


def ort_variants(weights: dict[str, list[torch.Tensor]], groups: list[int]) -> dict[str, dict[str, Callable]]:
    """One ONNX Runtime session per (variant, class): x -> every matrix of the class."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL

    def session(ws: list[torch.Tensor], bits: int, block: int) -> Callable:
        k = ws[0].shape[1]
        nodes, inits, outs = [], [], []
        for i, w in enumerate(ws):
            n = w.shape[0]
            y = f"y{i}"
            outs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", n]))
            if bits == 32:
                inits.append(numpy_helper.from_array(w.T.contiguous().numpy(), f"w{i}"))
                nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [y]))
                continue
            block = fit(block, w)
            levels, zero = (1 << bits) - 1, 1 << (bits - 1)
            blocks = w.view(n, k // block, block)
            scale = blocks.abs().amax(-1).clamp_min(1e-12) / (zero - 1)
            q = (torch.round(blocks / scale[..., None]) + zero).clamp(0, levels).to(torch.uint8)
            if bits == 4:
                q = q[..., 0::2] | (q[..., 1::2] << 4)
            inits += [numpy_helper.from_array(q.contiguous().numpy(), f"b{i}"),
                      numpy_helper.from_array(scale.reshape(-1).numpy().astype(np.float32), f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"b{i}", f"s{i}"], [y], domain="com.microsoft", K=k, N=n,
                                          bits=bits, block_size=block, accuracy_level=4))
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])], outs,
                                  initializer=inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return lambda x: sess.run(None, {"x": x.numpy()})

    out: dict[str, dict[str, Callable]] = {"ort-fp32": {}}
    for name, ws in weights.items():
        out["ort-fp32"][name] = session(ws, 32, 0)
        for g in groups:
            for bits in (4, 8):
                out.setdefault(f"ort-q{bits}-g{g}", {})[name] = session(ws, bits, g)
    return out


def time_once(layers: list[Layer] | Callable, x: torch.Tensor) -> float:
    start = time.perf_counter()
    if isinstance(layers, list):
        for layer in layers:
            layer(x)
    else:
        layers(x)
    return time.perf_counter() - start


def row_invariant(layers: list[Layer] | Callable, k: int) -> bool:
    x = torch.randn(8, k)
    run = (lambda v: [layer(v) for layer in layers]) if isinstance(layers, list) else layers
    batched = [torch.as_tensor(y) for y in run(x)]
    for i in range(8):
        alone = [torch.as_tensor(y) for y in run(x[i:i + 1].clone())]
        if not all(torch.equal(a[0], b[i]) for a, b in zip(alone, batched)):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--ort", action="store_true", help="add ONNX Runtime's MatMul / MatMulNBits")
    parser.add_argument("--check", action="store_true", help="report row invariance (8 rows vs each alone)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = [int(g) for g in a.groups.split(",")]
    weights = {name: [torch.randn(shape) * 0.02 for _ in range(count)] for name, (shape, count) in CLASSES.items()}
    variants: dict[str, dict] = our_variants(weights, groups)
    if a.ort:
        variants.update(ort_variants(weights, groups))
    for m in [int(r) for r in a.rows.split(",")]:
        times: dict[tuple[str, str], list[float]] = {}
        xs = {name: torch.randn(m, shape[1]) for name, (shape, _) in CLASSES.items()}
        for _ in range(a.repeats):
            for variant, per_class in variants.items():
                for name, layers in per_class.items():
                    times.setdefault((variant, name), []).append(time_once(layers, xs[name]))
        med = {key: statistics.median(v[1:] if len(v) > 2 else v) * 1e3 for key, v in times.items()}
        step = {variant: sum(med[(variant, name)] for name in CLASSES) for variant in variants}
        low = {variant: sum(min(times[(variant, name)]) * 1e3 for name in CLASSES) for variant in variants}
        print(f"\n## {m} row(s): median ms per class (one call per matrix), x = fp32 row kernel time / this\n")
        print("| variant | " + " | ".join(CLASSES) + " | step | x fp32 | step (min) | x fp32 (min) |" + (" rows invariant |" if a.check else ""))
        print("|---" * (len(CLASSES) + 5 + bool(a.check)) + "|")
        for variant in variants:
            cells = " | ".join(f"{med[(variant, name)]:.2f}" for name in CLASSES)
            check = ""
            if a.check:
                check = f" {'yes' if row_invariant(variants[variant]['q/o 576x576'], 576) else 'no'} |"
            print(f"| {variant} | {cells} | {step[variant]:.2f} | {step['fp32'] / step[variant]:.2f} | "
                  f"{low[variant]:.2f} | {low['fp32'] / low[variant]:.2f} |{check}")


if __name__ == "__main__":
    main()
