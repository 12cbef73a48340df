"""Triton entry point of the specdec model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.serving.triton.specdec_model import SpecdecModel as TritonPythonModel  # noqa: F401
