"""Rendering a Triton model repository for a deployment.

``render_model_repository(deployment, out_dir)`` writes, for ``ServingConfig()`` defaults::

    out_dir/specdec/config.pbtxt          decoupled Python-backend model (streaming)
    out_dir/specdec/1/model.py            shim: TritonPythonModel = triton_backend.triton_model.SpecdecModel
    out_dir/specdec/1/deployment.json     the DeploymentConfig it serves
    out_dir/specdec_unary/config.pbtxt    non-decoupled entry point for Triton's infer API
    out_dir/specdec_unary/1/model.py      shim: TritonPythonModel = triton_backend.triton_unary.UnaryModel

config.pbtxt is rendered from the typed :class:`~triton_backend.interface.ServingConfig` and
the tensor specs in :mod:`triton_backend.interface`; every placeholder must be filled
(:func:`render_template` raises otherwise).
"""

from __future__ import annotations

import logging
import re
import string
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from triton_backend.errors import SpecbuildError
from triton_backend.interface import INPUTS, OUTPUTS, ServingConfig
from triton_backend.triton_io import TensorSpec

if TYPE_CHECKING:  # rendering needs no torch: only the config's JSON
    from triton_backend.deployment import DeploymentConfig

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


def render_config_pbtxt(serving: ServingConfig, *, unary: bool = False) -> str:
    """config.pbtxt of the decoupled model, or of the unary entry point when ``unary``."""
    if unary and serving.unary_model_name is None:
        raise RenderError("this ServingConfig has no unary model")
    params = {"target_model": serving.model_name} if unary else serving.parameters()
    return render_template(CONFIG_TEMPLATE, {
        "name": serving.unary_model_name if unary else serving.model_name,
        "max_batch_size": serving.max_batch_size,
        "decoupled": "false" if unary else "true",
        "inputs": _tensors(INPUTS, True),
        "outputs": _tensors(OUTPUTS, False),
        "instance_count": serving.unary_instance_count if unary else serving.instance_count,
        "parameters": _parameters(params),
    })


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def render_model_repository(deployment: "DeploymentConfig", out_dir: Path,
                            serving: ServingConfig | None = None) -> Path:
    """Write the model repository serving ``deployment`` into ``out_dir`` (created if needed;
    other models there are left alone) and return ``out_dir``. Stable signature: other
    commands (``specbuild build``) call it."""
    serving = serving or ServingConfig()
    out_dir = Path(out_dir)
    model_dir = out_dir / serving.model_name
    _write(model_dir / "config.pbtxt", render_config_pbtxt(serving))
    _write(model_dir / VERSION / "model.py", render_template(MODEL_SHIM, {
        "name": serving.model_name, "module": "triton_backend.triton_model", "adapter": "SpecdecModel"}))
    _write(model_dir / VERSION / serving.deployment_file, deployment.to_json() + "\n")
    if serving.unary_model_name is not None:
        unary_dir = out_dir / serving.unary_model_name
        _write(unary_dir / "config.pbtxt", render_config_pbtxt(serving, unary=True))
        _write(unary_dir / VERSION / "model.py", render_template(MODEL_SHIM, {
            "name": serving.unary_model_name, "module": "triton_backend.triton_unary", "adapter": "UnaryModel"}))
    logger.info("rendered model repository %s (model %s)", out_dir, serving.model_name)
    return out_dir


def is_model_repository(path: Path) -> bool:
    """A folder with at least one ``<model>/config.pbtxt``."""
    return path.is_dir() and any(p.is_file() for p in path.glob("*/config.pbtxt"))


__all__ = ["RenderError", "is_model_repository", "render_config_pbtxt", "render_model_repository", "render_template"]
