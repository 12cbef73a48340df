"""Triton entry point of the ensemble model (rendered by specbuild): the adapter lives in triton_backend."""

from triton_backend.serving.triton.forward_model import ForwardModel as TritonPythonModel  # noqa: F401
