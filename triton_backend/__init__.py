"""specbuild runtime, in layers (each imports only the ones before it):

``core`` (configs, errors, sampling, text, tree topology) -> ``engines`` (``torch``, ``trtllm``) ->
``speculation`` (loop, rounds, controller and gain rule, verification, drafters) -> ``batching``
(in-flight scheduler) -> ``deployment`` -> ``serving`` (no Triton imports) -> ``serving.triton``
(the Python-backend models ``model_repo/*/1/model.py`` loads).
"""
