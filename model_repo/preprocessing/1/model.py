"""Triton entry point of the preprocessing model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.serving.triton.tokenizer_models import PreprocessingModel as TritonPythonModel  # noqa: F401
