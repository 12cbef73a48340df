"""specbuild runtime: the speculative decoding loop, its engines and drafters.

Plain Python over tensors; nothing here imports Triton. The Triton adapter
(``model_repo/*/1/model.py``) is a thin layer over :mod:`triton_backend.generation`.
"""

from triton_backend.errors import (
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    SpecbuildError,
    VocabMismatchError,
)

__all__ = [
    "ConfigError",
    "ContextLengthError",
    "InvalidRequestError",
    "ModelLoadError",
    "SpecbuildError",
    "VocabMismatchError",
]
