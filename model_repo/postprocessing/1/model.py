"""Triton entry point of the postprocessing model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.serving.triton.tokenizer_models import PostprocessingModel as TritonPythonModel  # noqa: F401
