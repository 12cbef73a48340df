"""An EAGLE-3 drafter for TensorRT-LLM 1.x's Eagle3 speculative decoding.

TensorRT-LLM 1.x runs EAGLE-3 in its PyTorch flow (``LLM(..., speculative_config=...)`` or
``trtllm-serve <target> --extra_llm_api_options <yaml>``), loading the drafter from a Hugging
Face-style folder: ``config.json`` (``LlamaForCausalLMEagle3``, ``draft_vocab_size``) and the
weights under EAGLE-3's names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``), the
layout :func:`~triton_backend.speculation.drafters.eagle3_model.save_eagle3` writes. Its
``trtllm-build`` engine flow has no EAGLE-3 mode (``--speculative_decoding_mode eagle`` builds
EAGLE-1/2 nets, :mod:`builder.stages.eagle_export`), so the export is the drafter folder, the
LLM-API options file and the serve command line, all checked here without TensorRT-LLM.

Options written (``extra_llm_api_options.yaml``)::

    speculative_config:
      decoding_type: Eagle
      max_draft_len: 3
      speculative_model_dir: eagle3
      eagle3_one_model: true
      eagle3_layers_to_capture: [1, 14, 26]   # only when not TensorRT-LLM's default set
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from builder.errors import BuildSpecError
from triton_backend.core.errors import ModelLoadError
from triton_backend.speculation.drafters.eagle3_model import WEIGHTS, default_capture_layers, load_eagle3

DRAFTER_DIR = "eagle3"
OPTIONS = "extra_llm_api_options.yaml"


@dataclass(frozen=True)
class Eagle3Export:
    folder: Path
    drafter: Path
    options: Path
    serve_argv: list[str]

    def serve_shell(self) -> str:
        return " ".join(shlex.quote(a) for a in self.serve_argv)


def llm_api_options(max_draft_len: int, drafter_dir: str, capture_layers: tuple[int, ...], num_target_layers: int,
                    one_model: bool = True) -> str:
    """The ``speculative_config`` YAML (plain text: the keys are fixed, the values simple)."""
    if max_draft_len < 1:
        raise BuildSpecError("max_draft_len must be >= 1")
    lines = ["speculative_config:", "  decoding_type: Eagle", f"  max_draft_len: {int(max_draft_len)}",
             f"  speculative_model_dir: {drafter_dir}", f"  eagle3_one_model: {'true' if one_model else 'false'}"]
    if tuple(sorted(capture_layers)) != default_capture_layers(num_target_layers):
        lines.append(f"  eagle3_layers_to_capture: [{', '.join(str(i) for i in sorted(capture_layers))}]")
    return "\n".join(lines) + "\n"


def export_eagle3(eagle: str | Path, out_dir: str | Path, *, target: str, num_target_layers: int,
                  target_hidden_size: int, target_vocab_size: int, max_draft_len: int = 3, port: int = 8000) -> Eagle3Export:
    """Copy the drafter folder, write the options file and the ``trtllm-serve`` command."""
    try:
        net = load_eagle3(eagle, num_target_layers=num_target_layers)
    except ModelLoadError as exc:
        raise BuildSpecError(str(exc)) from exc
    info = net.info
    if (info.target_hidden_size or info.hidden_size) != target_hidden_size or info.vocab_size != target_vocab_size:
        raise BuildSpecError(f"the drafter was made for hidden size {info.target_hidden_size or info.hidden_size} and "
                             f"vocabulary {info.vocab_size}; the target has {target_hidden_size} and {target_vocab_size}")
    if max(info.capture_layers) >= num_target_layers:
        raise BuildSpecError(f"capture layers {info.capture_layers} exceed the target's {num_target_layers} layers")
    out = Path(out_dir)
    drafter = out / DRAFTER_DIR
    drafter.mkdir(parents=True, exist_ok=True)
    source = Path(eagle)
    for name in ("config.json", WEIGHTS):
        if not (source / name).is_file():
            raise BuildSpecError(f"{source} lacks {name}; save the drafter with specbuild (save_eagle3) first")
        shutil.copyfile(source / name, drafter / name)
    options = out / OPTIONS
    options.write_text(llm_api_options(max_draft_len, DRAFTER_DIR, info.capture_layers, num_target_layers))
    argv = ["trtllm-serve", target, "--backend", "pytorch", "--port", str(port), "--extra_llm_api_options", OPTIONS]
    script = out / "serve.sh"
    script.write_text("#!/usr/bin/env bash\n# Serve the target with the EAGLE-3 drafter (written by specbuild export-eagle3).\n"
                      "set -euo pipefail\ncd \"$(dirname \"$0\")\"\n" + " ".join(shlex.quote(a) for a in argv) + "\n")
    script.chmod(0o755)
    return Eagle3Export(out, drafter, options, argv)


__all__ = ["DRAFTER_DIR", "Eagle3Export", "OPTIONS", "export_eagle3", "llm_api_options"]
