"""Triton entry point of the specdec model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.triton_model import SpecdecModel as TritonPythonModel  # noqa: F401
