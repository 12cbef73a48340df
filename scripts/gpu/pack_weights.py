"""Pack a model folder's weights for a GPU run that can receive at most 64 MiB per call.

Every tensor is rounded to bfloat16 and split in byte planes: the high bytes (sign, exponent,
top mantissa bit) compress well and are lzma-compressed, the low bytes are kept raw. The planes
go out as ``blob.partNN`` files of at most ``--part-mb`` MiB, with ``index.json`` (names, shapes,
offsets) and the folder's config and tokenizer files; ``scripts/gpu/unpack_weights.py`` rebuilds
the folder on the other side. The values there are the bfloat16 rounding of these weights: what
is measured with them is labelled so.
Usage: python scripts/gpu/pack_weights.py MODEL_DIR OUT_DIR [--part-mb 62]
"""

import argparse
import json
import lzma
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file


MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


def copy_model_files(src: Path, out: Path) -> None:
    """The model folder's config and tokenizer files (those present) from ``src`` to ``out``."""
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--part-mb", type=float, default=62.0)
    args = p.parse_args()
    src, out = Path(args.model_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    index, his, los, offset = [], [], [], 0
    for name in sorted(state):
        value = state[name].to(torch.bfloat16).contiguous()
        pairs = value.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        his.append(pairs[:, 1].copy())
        los.append(pairs[:, 0].copy())
        index.append({"name": name, "shape": list(value.shape), "offset": offset, "numel": value.numel()})
        offset += value.numel()
    hi = lzma.compress(np.concatenate(his).tobytes(), preset=6)
    blob = hi + np.concatenate(los).tobytes()
    (out / "index.json").write_text(json.dumps({"index": index, "hi_compressed": len(hi), "total": len(blob)}))
    step = int(args.part_mb * 2**20)
    for k, lo in enumerate(range(0, len(blob), step)):
        (out / f"blob.part{k:02d}").write_bytes(blob[lo:lo + step])
    copy_model_files(src, out)
    print(f"{len(index)} tensors, {offset} values: {len(blob)} bytes in {-(-len(blob) // step)} parts -> {out}")


if __name__ == "__main__":
    main()
