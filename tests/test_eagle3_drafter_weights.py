"""An EAGLE-3 drafter's weights held in fp8, int8 or int4 on the compact-weight kernel
(``runtime.drafter_weights``): the drafter's products run on the weights it was given, its
drafts stay close to the float32 drafter's, its cost identity names the precision (a cached
draft cost is not reused across precisions), output stays plain decoding's token for token,
alone and batched, and a deployment's setting reaches the drafter."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_engine
from test_eagle3_serving import _net, assert_exact_chains_and_trees
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.engines.torch.weight_gemm import load_weight_gemm
from triton_backend.speculation.drafters.eagle3 import Eagle3Drafter
from triton_backend.speculation.drafters.eagle3_model import save_eagle3


def _kernels_or_skip(target):
    if target.forward_impl.kernel is None or load_weight_gemm() is None:
        pytest.skip("needs the row and compact-weight CPU kernels (x86-64 with AVX2 + FMA)")


@pytest.mark.parametrize("weights", [WeightPrecision.FP8, WeightPrecision.INT8, WeightPrecision.INT4])
def test_a_drafter_served_in_a_compact_precision_stays_exact(weights):
    target = tiny_engine(0, layers=4)
    _kernels_or_skip(target)
    net = _net(target.model.config, scale=0.1)
    full = Eagle3Drafter(net, target, WeightPrecision.FLOAT32)
    compact = Eagle3Drafter(net, target, weights)
    assert compact._step is not None and compact._step.name.endswith(f":{weights.value}")
    assert full._step is not None and full._step.name.startswith("row_gemm")
    assert compact.cost_identity() != full.cost_identity() and weights.value in compact.cost_identity()
    g = torch.randn(3, net.info.hidden_size, generator=torch.Generator().manual_seed(0))
    close, far = full._small_logits(g), compact._small_logits(g)
    assert not torch.equal(close, far)  # the products ran on the rounded weights
    tolerance = 0.15 if weights is WeightPrecision.INT4 else 0.08
    assert (far - close).abs().max() <= tolerance * close.abs().max()
    compact.relative_cost = 0.01
    assert_exact_chains_and_trees(target, compact)


def test_stored_keeps_the_files_precision_and_the_runtime_setting_parses(tmp_path):
    target = tiny_engine(0, layers=4)
    _kernels_or_skip(target)
    net = _net(target.model.config, scale=0.1)
    folder = str(save_eagle3(tmp_path / "half", net, dtype=torch.bfloat16))
    assert Eagle3Drafter.from_folder(folder, target)._step.name.endswith(":bfloat16")  # None: as stored
    assert Eagle3Drafter.from_folder(folder, target, WeightPrecision.FP8)._step.name.endswith(":fp8")
    assert RuntimeConfig().drafter_weights is WeightPrecision.INT8  # the default
    assert RuntimeConfig(drafter_weights="stored").drafter_weights is None
    assert RuntimeConfig(drafter_weights=None).drafter_weights is None
    assert RuntimeConfig(drafter_weights="int8").drafter_weights is WeightPrecision.INT8
    with pytest.raises(ConfigError, match="drafter_weights must be stored or one of"):
        RuntimeConfig(drafter_weights="int3")


def test_a_deployments_drafter_weights_reach_the_drafter(tmp_path):
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.deployment.torch_deployment import _eagle_drafter

    target = tiny_engine(0, layers=4)
    _kernels_or_skip(target)
    folder = str(save_eagle3(tmp_path / "drafter", _net(target.model.config, scale=0.1), dtype=torch.float16))
    for setting, name in (("int8", ":int8"), ("stored", ":float16"), (None, ":int8")):
        runtime = {} if setting is None else {"drafter_weights": setting}
        config = DeploymentConfig.from_dict({"eagle": folder, "runtime": runtime})
        assert _eagle_drafter(config, target)._step.name.endswith(name)


def test_specbuild_run_takes_the_drafter_weights():
    import argparse

    from builder.ops.local_run import LocalRunConfig, add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    runtime = lambda *flags: LocalRunConfig.from_args(parser.parse_args(list(flags))).deployment.runtime  # noqa: E731
    assert runtime().drafter_weights is WeightPrecision.INT8
    assert runtime("--drafter-weights", "stored").drafter_weights is None
    assert runtime("--drafter-weights", "fp8").drafter_weights is WeightPrecision.FP8
    with pytest.raises(SystemExit):
        runtime("--drafter-weights", "int3")
