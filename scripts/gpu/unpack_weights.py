"""Rebuild a model folder from the packed bfloat16 weights a GPU run receives in parts.

The device machine cannot download weights and takes at most 64 MiB per call, so the reference
target travels as its weights rounded to bfloat16, split in byte planes (the high bytes
lzma-compressed, the low bytes raw) and cut into parts sent over several calls
(``scripts/gpu/pack_weights.py`` makes them). This joins ``blob.part*`` in ``STAGE``, checks the
size, and writes ``OUT/model.safetensors`` (float32 values of the bfloat16 weights) beside the
config and tokenizer files found in ``STAGE``.
Usage: python scripts/gpu/unpack_weights.py STAGE OUT
"""

import json
import lzma
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pack_weights import copy_model_files  # this folder's (Python puts a script's own folder first on its import path)


def main() -> None:
    stage, out = Path(sys.argv[1]), Path(sys.argv[2])
    index = json.loads((stage / "index.json").read_text())
    blob = b"".join(p.read_bytes() for p in sorted(stage.glob("blob.part*")))
    if len(blob) != index["total"]:
        raise SystemExit(f"packed weights incomplete: {len(blob)} of {index['total']} bytes in {stage}")
    hi = np.frombuffer(lzma.decompress(blob[:index["hi_compressed"]]), dtype=np.uint8)
    lo = np.frombuffer(blob[index["hi_compressed"]:], dtype=np.uint8)
    pairs = np.stack([lo, hi], axis=1).reshape(-1).copy()
    flat = torch.from_numpy(pairs.view(np.int16)).view(torch.bfloat16)
    tensors = {e["name"]: flat[e["offset"]:e["offset"] + e["numel"]].reshape(e["shape"]).float().contiguous()
               for e in index["index"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_model_files(stage, out)
    print(f"{len(tensors)} tensors, {flat.numel()} values -> {out}")


if __name__ == "__main__":
    main()
