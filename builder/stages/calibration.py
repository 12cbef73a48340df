"""Calibration texts for quantization: a file of samples separated by blank lines.

The default set (``builder/data/calibration.txt``) was written for this project: short
passages of prose, dialogue, code, SQL, arithmetic and instructions, so every kind of token
the models will see moves the activation ranges modelopt records.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from builder.errors import BuildSpecError
from builder.plan.spec import CalibrationSpec

logger = logging.getLogger(__name__)

DEFAULT_CALIBRATION_FILE = Path(__file__).parents[1] / "data" / "calibration.txt"


def load_calibration_texts(spec: CalibrationSpec) -> list[str]:
    path = Path(spec.text_file) if spec.text_file else DEFAULT_CALIBRATION_FILE
    if not path.is_file():
        raise BuildSpecError(f"calibration text file {path} not found")
    samples = [s.strip() for s in path.read_text(encoding="utf-8").split("\n\n")]
    samples = [s for s in samples if s]
    if not samples:
        raise BuildSpecError(f"calibration text file {path} holds no samples (separate them with blank lines)")
    if len(samples) < spec.num_samples:
        logger.info("calibration: %s has %d samples (asked for %d); using all", path.name, len(samples), spec.num_samples)
    return samples[: spec.num_samples]


def make_forward_loop(tokenizer: Any, texts: list[str], max_length: int, device: str = "cpu") -> Callable[[Any], None]:
    """The ``forward_loop(model)`` modelopt calls to calibrate: one forward pass per sample."""
    import torch

    batches = [tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length) for text in texts]

    def forward_loop(model: Any) -> None:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))

    return forward_loop
