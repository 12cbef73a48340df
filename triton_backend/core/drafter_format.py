"""Which EAGLE drafter a path holds, read from its files (never from its name).

An EAGLE-3 drafter is a folder whose ``config.json`` lists ``LlamaForCausalLMEagle3`` in
``architectures`` (or gives a ``draft_vocab_size``; the layout ``specbuild train-eagle3`` writes and published EAGLE-3
checkpoints use); everything else is the EAGLE-1 ``specbuild-eagle`` safetensors file (or a
folder holding ``eagle.safetensors``). No torch here: the deployment file's reader uses it.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from triton_backend.core.errors import ConfigError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


class EagleFormat(str, Enum):
    EAGLE1 = "eagle1"  # specbuild's EAGLE-1 file: the target's last hidden state
    EAGLE3 = "eagle3"  # EAGLE-3 folder: fused capture-layer features, own draft-vocabulary head

    @classmethod
    def parse(cls, value: "EagleFormat | str") -> "EagleFormat":
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"eagle_format must be one of {', '.join(f.value for f in cls)}, got {value!r}") from None


def detect_eagle_format(path: str | Path) -> EagleFormat:
    """EAGLE-3 when ``path`` is a folder whose ``config.json`` names the EAGLE-3 architecture."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return EagleFormat.EAGLE1
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the EAGLE drafter's {config}: {exc}") from None
    architectures = data.get("architectures") if isinstance(data, dict) else None
    if (isinstance(architectures, list) and EAGLE3_ARCHITECTURE in architectures) or (
            isinstance(data, dict) and "draft_vocab_size" in data):  # what the EAGLE-3 loader accepts
        return EagleFormat.EAGLE3
    raise ConfigError(f"{config} names architectures {architectures!r}, not an EAGLE drafter "
                      f"({EAGLE3_ARCHITECTURE}); an EAGLE-1 drafter is a specbuild-eagle safetensors file")


__all__ = ["EAGLE3_ARCHITECTURE", "EagleFormat", "detect_eagle_format"]
