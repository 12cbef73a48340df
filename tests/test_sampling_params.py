"""Logits processing (temperature/top-k/top-p) and request validation errors."""

from __future__ import annotations

import math

import pytest
import torch

from triton_backend.core.config import DraftLengthConfig, NgramConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.errors import ConfigError, InvalidRequestError
from triton_backend.core.sampling import LogitsProcessor


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    probs = LogitsProcessor(temperature=0.0).probs(logits)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_scales():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = LogitsProcessor(temperature=2.0).probs(logits)
    assert torch.allclose(probs, torch.softmax(logits / 2, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    probs = LogitsProcessor(temperature=1.0, top_k=2).probs(logits)
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_nucleus():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    out = LogitsProcessor(temperature=1.0, top_p=0.7).probs(logits)
    assert (out[0] > 0).tolist() == [True, True, False, False]  # 0.5 < 0.7 so 0.3 is needed too
    assert torch.allclose(out[0, :2], torch.tensor([0.625, 0.375]))
    only_top = LogitsProcessor(temperature=1.0, top_p=0.4).probs(logits)
    assert (only_top[0] > 0).tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": ((),)}, "stop token"),
    ],
)
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_speculation_config_errors():
    with pytest.raises(ConfigError, match="unknown speculation mode"):
        SpeculationConfig(method="telepathy")
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=-1))
    with pytest.raises(ConfigError, match="ngram"):
        SpeculationConfig(ngram=NgramConfig(min_n=3, max_n=2))
    assert SpeculationConfig(method="NGRAM").method is SpeculationMode.NGRAM
