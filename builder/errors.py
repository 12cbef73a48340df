"""Typed errors of the build half: planning, quantization, export and compile.

Each carries a short message that names the problem and what to change."""

from triton_backend.core.errors import ConfigError, SpecbuildError


class BuildSpecError(ConfigError):
    """The build spec (file or flags) is invalid."""

    code = "build_spec"


class PlanError(SpecbuildError, ValueError):
    """The deployment cannot be planned as asked."""

    code = "plan"


class UnknownGpuError(PlanError):
    """The GPU kind is not in the catalogue."""

    code = "unknown_gpu"


class UnsupportedModelError(PlanError):
    """The model architecture is not one the builder knows how to size, quantize or export."""

    code = "unsupported_model"


class PrecisionError(PlanError):
    """A precision the GPU or the model's shapes cannot run (FP8 without FP8 tensor cores,
    INT4-AWQ with linear sizes that do not split into 128-wide groups, ...)."""

    code = "precision"


class DoesNotFitError(PlanError):
    """The models do not fit the GPUs at any allowed precision and parallelism."""

    code = "does_not_fit"


class BuildError(SpecbuildError, RuntimeError):
    """A build stage failed (quantization, export, compile, render)."""

    code = "build"
