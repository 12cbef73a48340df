"""Rendering a Triton model repository for a deployment.

``render_model_repository(deployment, out_dir)`` writes, for ``ServingConfig()`` defaults::

    out_dir/specdec/config.pbtxt          decoupled Python-backend model (streaming)
    out_dir/specdec/1/model.py            shim: TritonPythonModel = triton_backend.serving.triton.specdec_model.SpecdecModel
    out_dir/specdec/1/deployment.json     the DeploymentConfig it serves
    out_dir/specdec_unary/config.pbtxt    non-decoupled entry point for Triton's infer API
    out_dir/specdec_unary/1/model.py      shim: TritonPythonModel = triton_backend.serving.triton.unary_model.UnaryModel
    out_dir/ensemble, tensorrt_llm_bls,   tensorrtllm_backend's names (r25.05 tensors) in front of specdec:
      tensorrt_llm, preprocessing,        forwarders (triton_backend.serving.triton.forward_model; decoupled
      postprocessing                      as ServingConfig.decoupled_mode says) and the tokenizer models
                                          (triton_backend.serving.triton.tokenizer_models); with
                                          ensemble_mode "pipeline", ensemble is a Triton ensemble
                                          of the other three (builder.stages.ensemble_pipeline)

config.pbtxt is rendered from the typed :class:`~triton_backend.serving.interface.ServingConfig` and
the tensor specs in :mod:`triton_backend.serving.interface`; every placeholder must be filled
(:func:`render_template` raises otherwise).
"""

from __future__ import annotations

import logging
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from builder.stages.ensemble_pipeline import ONE_REQUEST_PER_EXECUTION, render_pipeline_ensemble
from triton_backend.core.errors import SpecbuildError
from triton_backend.serving.interface import INPUTS, OUTPUTS, ServingConfig
from triton_backend.serving.tensors import TensorSpec
from triton_backend.serving.trtllm_interface import (
    BLS_SERVED_INPUTS, ENSEMBLE_SERVED_INPUTS, POST_INPUTS, POST_OUTPUTS, PRE_INPUTS, PRE_OUTPUTS, SERVED_INPUTS,
    SERVED_OUTPUTS, TEXT_SERVED_OUTPUTS, TOKEN_INPUTS, TOKEN_SERVED_OUTPUTS,
)

if TYPE_CHECKING:  # rendering needs no torch: only the config's JSON
    from triton_backend.deployment.deployment_config import DeploymentConfig

logger = logging.getLogger(__name__)

VERSION = "1"

CONFIG_TEMPLATE = """\
# Rendered by specbuild from a typed ServingConfig: change the config, not this file.
name: "${name}"
backend: "python"
max_batch_size: ${max_batch_size}
model_transaction_policy {
  decoupled: ${decoupled}
}
input [
${inputs}
]
output [
${outputs}
]
instance_group [
  {
    count: ${instance_count}
    kind: KIND_CPU
  }
]
${parameters}
"""

MODEL_SHIM = '''\
"""Triton entry point of the ${name} model (rendered by specbuild): the adapter lives in triton_backend."""

from ${module} import ${adapter} as TritonPythonModel  # noqa: F401
'''

_PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_]")


class RenderError(SpecbuildError, ValueError):
    code = "render"


def render_template(template: str, values: Mapping[str, object]) -> str:
    """Fill every ``${name}``; a missing value or a placeholder left in the output raises."""
    try:
        text = string.Template(template).substitute({k: str(v) for k, v in values.items()})
    except (KeyError, ValueError) as exc:
        raise RenderError(f"template placeholder not filled: {exc}") from None
    left = _PLACEHOLDER.search(text)
    if left:
        raise RenderError(f"unfilled placeholder in rendered text near {text[left.start():left.start() + 30]!r}")
    return text


def _tensor_block(spec: TensorSpec, is_input: bool) -> str:
    lines = ["  {", f'    name: "{spec.name}"', f"    data_type: {spec.dtype.value}",
             f"    dims: [ {', '.join(str(d) for d in spec.dims)} ]"]
    if is_input and spec.optional:
        lines.append("    optional: true")
    lines.append("  }")
    return "\n".join(lines)


def _tensors(specs: Sequence[TensorSpec], is_input: bool) -> str:
    return ",\n".join(_tensor_block(s, is_input) for s in specs)


def _parameters(params: Mapping[str, str]) -> str:
    blocks = []
    for key, value in params.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        blocks.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{escaped}" }}\n}}')
    return "\n".join(blocks)


def _config(name: str, *, decoupled: bool, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
            count: int, params: Mapping[str, str], max_batch_size: int) -> str:
    return render_template(CONFIG_TEMPLATE, {
        "name": name, "max_batch_size": max_batch_size, "decoupled": "true" if decoupled else "false",
        "inputs": _tensors(inputs, True), "outputs": _tensors(outputs, False), "instance_count": count,
        "parameters": _parameters(params),
    })


QUEUE_POLICY = """
dynamic_batching {
  max_queue_delay_microseconds: 0
  default_queue_policy { max_queue_size: ${max_queue_size} }
}
"""


def _forwarding(serving: ServingConfig, decoupled: bool) -> tuple[dict[str, str], str]:
    """``(parameters, config tail)`` bounding a forwarding model: a decoupled one forwards at most
    what the serving model can hold (its batch slots and queue, every instance) and refuses the
    rest at once; a non-decoupled one runs a batch's requests side by side and waits in Triton's
    queue, bounded (a full queue is refused at once with UNAVAILABLE)."""
    params = {"target_model": serving.model_name}
    if decoupled:
        capacity = (serving.max_batch_size + serving.max_queue_size) * serving.instance_count
        return {**params, "max_in_flight": str(capacity)}, ""
    return ({**params, "max_in_flight": str(serving.max_batch_size)},
            render_template(QUEUE_POLICY, {"max_queue_size": serving.max_queue_size}))


def render_config_pbtxt(serving: ServingConfig, *, unary: bool = False) -> str:
    """config.pbtxt of the decoupled (serving) model, or of the unary entry point when ``unary``."""
    if unary and serving.unary_model_name is None:
        raise RenderError("this ServingConfig has no unary model")
    if unary:
        params, tail = _forwarding(serving, decoupled=False)
        return _config(serving.unary_model_name, decoupled=False, inputs=INPUTS, outputs=OUTPUTS,
                       count=serving.unary_instance_count, params=params, max_batch_size=serving.max_batch_size) + tail
    return _config(serving.model_name, decoupled=True, inputs=SERVED_INPUTS, outputs=SERVED_OUTPUTS,
                   count=serving.instance_count, params=serving.parameters(), max_batch_size=serving.max_batch_size)


@dataclass(frozen=True)
class FrontModel:
    """A model of tensorrtllm_backend's layout, rendered in front of the serving model."""

    name: str
    decoupled: bool
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    module: str
    adapter: str
    parameters: tuple[tuple[str, str], ...] = ()  # config.pbtxt parameters besides target_model


FORWARD_MODULE = "triton_backend.serving.triton.forward_model"  # the text- and token-level tensorrtllm_backend models
ENSEMBLE_PLATFORM = "ensemble"  # FrontModel.module of a Triton ensemble (ensemble_mode "pipeline"): no model.py


def front_models(serving: ServingConfig) -> list[FrontModel]:
    """The tensorrtllm_backend-named models this ServingConfig renders (names configurable)."""
    names = serving.trtllm_models
    if names is None:
        return []
    forward, tok = (FORWARD_MODULE, "ForwardModel"), "triton_backend.serving.triton.tokenizer_models"
    decoupled = serving.decoupled_mode  # tensorrtllm_backend's decoupled_mode switch
    # tensorrt_llm's parameter; the text-level models inherit it as NVIDIA's do through tensorrt_llm
    exclude = (("exclude_input_in_output", "true" if serving.exclude_input_in_output else "false"),)
    ensemble = (ENSEMBLE_PLATFORM, "") if serving.ensemble_mode == "pipeline" else forward
    specs = [(names.ensemble, decoupled, ENSEMBLE_SERVED_INPUTS, TEXT_SERVED_OUTPUTS, *ensemble, exclude),
             (names.bls, decoupled, BLS_SERVED_INPUTS, TEXT_SERVED_OUTPUTS, *forward, exclude),
             (names.tokens, decoupled, TOKEN_INPUTS, TOKEN_SERVED_OUTPUTS, *forward, exclude),
             (names.preprocessing, False, PRE_INPUTS, PRE_OUTPUTS, tok, "PreprocessingModel"),
             (names.postprocessing, False, POST_INPUTS, POST_OUTPUTS, tok, "PostprocessingModel")]
    return [FrontModel(*spec) for spec in specs if spec[0]]


def render_front_config(serving: ServingConfig, model: FrontModel) -> str:
    if model.module == ENSEMBLE_PLATFORM:
        return render_pipeline_ensemble(serving, _tensors)
    params, tail = {"target_model": serving.model_name}, ""
    if model.module == FORWARD_MODULE:
        params, tail = _forwarding(serving, model.decoupled)
        pipeline = serving.ensemble_mode == "pipeline" and serving.trtllm_models is not None
        if pipeline and model.name == serving.trtllm_models.tokens and tail:  # one request per execution
            tail = tail.replace("dynamic_batching {\n", "dynamic_batching {\n" + ONE_REQUEST_PER_EXECUTION, 1)
    return _config(model.name, decoupled=model.decoupled, inputs=model.inputs, outputs=model.outputs,
                   count=serving.unary_instance_count if model.module == FORWARD_MODULE and not model.decoupled else 1,
                   params={**params, **dict(model.parameters)}, max_batch_size=serving.max_batch_size) + tail


def _write(path: Path, text: str) -> bool:
    """Write ``text`` unless the file holds it already (a cached build stays untouched); changed?"""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def _write_model(out_dir: Path, name: str, config: str, module: str, adapter: str) -> Path:
    _write(out_dir / name / "config.pbtxt", config)
    _write(out_dir / name / VERSION / "model.py",
           render_template(MODEL_SHIM, {"name": name, "module": module, "adapter": adapter}))
    return out_dir / name


def deployment_dir(out_dir: Path, serving: ServingConfig | None = None) -> Path:
    """The folder a rendering into ``out_dir`` writes the deployment file into (relative model
    paths in that file are read relative to it)."""
    return Path(out_dir) / (serving or ServingConfig()).model_name / VERSION


def render_model_repository(deployment: "DeploymentConfig", out_dir: Path,
                            serving: ServingConfig | None = None) -> Path:
    """Write the model repository serving ``deployment`` into ``out_dir`` (created if needed;
    other models there are left alone) and return ``out_dir``. Stable signature: other
    commands (``specbuild build``) call it."""
    serving = serving or ServingConfig()
    out_dir = Path(out_dir)
    _write_model(out_dir, serving.model_name, render_config_pbtxt(serving),
                 "triton_backend.serving.triton.specdec_model", "SpecdecModel")
    _write(deployment_dir(out_dir, serving) / serving.deployment_file, deployment.to_json() + "\n")
    if serving.unary_model_name is not None:
        _write_model(out_dir, serving.unary_model_name, render_config_pbtxt(serving, unary=True),
                     "triton_backend.serving.triton.unary_model", "UnaryModel")
    render_front_models(serving, out_dir)
    logger.info("rendered model repository %s (model %s; %s)", out_dir, serving.model_name,
                ", ".join(m.name for m in front_models(serving)) or "no tensorrtllm_backend names")
    return out_dir


def render_front_models(serving: ServingConfig, out_dir: Path) -> list[Path]:
    """(Re)write the tensorrtllm_backend-named models of ``serving`` into ``out_dir`` (they hold
    no state: a built repository takes another ``decoupled_mode`` this way); the files changed."""
    changed = []
    for model in front_models(serving):
        config = Path(out_dir) / model.name / "config.pbtxt"
        if _write(config, render_front_config(serving, model)):
            changed.append(config)
        shim = Path(out_dir) / model.name / VERSION / "model.py"
        if model.module == ENSEMBLE_PLATFORM:  # a version folder, no code; a forwarder's shim goes
            shim.parent.mkdir(parents=True, exist_ok=True)
            if shim.is_file():
                shim.unlink()
                changed.append(shim)
        elif _write(shim, render_template(MODEL_SHIM, {"name": model.name, "module": model.module,
                                                       "adapter": model.adapter})):
            changed.append(shim)
    return changed


def is_model_repository(path: Path) -> bool:
    """A folder with at least one ``<model>/config.pbtxt``."""
    return path.is_dir() and any(p.is_file() for p in path.glob("*/config.pbtxt"))


__all__ = ["FrontModel", "RenderError", "deployment_dir", "front_models", "render_front_models", "is_model_repository", "render_config_pbtxt", "render_model_repository", "render_template"]
