"""Triton entry point of the specdec_unary model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.serving.triton.unary_model import UnaryModel as TritonPythonModel  # noqa: F401
