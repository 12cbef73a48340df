"""``specbuild train-medusa`` and ``specbuild distill`` end to end on a tiny budget with the
real target (3 prompts x 8 tokens): data generated and resumed, artifacts saved and loaded
back through the runtime, reports written; bad settings refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from builder.cli.main import main
from builder.errors import BuildSpecError
from builder.train.target_data import TargetDataConfig, generate_target_data, iter_records

pytestmark = pytest.mark.slow

TINY = ["--max-prompts", "3", "--max-new-tokens", "8", "--gen-batch-size", "3", "--shard-size", "2", "--epochs", "1",
        "--eval-count", "1", "--eval-max-tokens", "8", "--quiet"]


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Target data shared by the tests (with hidden states, so both commands can use it)."""
    folder = tmp_path_factory.mktemp("data") / "target"
    generate_target_data(TargetDataConfig(target="smollm2-135m-instruct", out_dir=str(folder), max_prompts=3,
                                          max_new_tokens=8, batch_size=3, shard_size=2), progress=False)
    return folder


def test_target_data_is_the_targets_greedy_output_and_resumes(data_dir):
    records = list(iter_records(data_dir))
    assert len(records) == 3 and len(list(data_dir.glob("shard-*.pt"))) == 2
    for rec in records:
        start = int(rec["prompt_length"])
        ids = rec["input_ids"]
        assert 1 <= ids.shape[0] - start <= 8
        # responses are greedy: each response token is the target's top-ranked one
        assert torch.equal(rec["topk_ids"][start - 1:, 0].long(), ids[start:])
        assert rec["hidden"].shape == (ids.shape[0] - 1, 576) and rec["topk_ids"].shape[1] == 32
    stamps = {p: p.stat().st_mtime_ns for p in data_dir.glob("shard-*.pt")}
    generate_target_data(TargetDataConfig(target="smollm2-135m-instruct", out_dir=str(data_dir), max_prompts=3,
                                          max_new_tokens=8, batch_size=1, shard_size=2), progress=False)
    assert {p: p.stat().st_mtime_ns for p in data_dir.glob("shard-*.pt")} == stamps  # nothing regenerated
    with pytest.raises(BuildSpecError, match="other settings"):
        generate_target_data(TargetDataConfig(target="smollm2-135m-instruct", out_dir=str(data_dir), max_prompts=3,
                                              max_new_tokens=9, shard_size=2), progress=False)


def test_train_medusa_end_to_end(data_dir, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    heldout = tmp_path / "heldout"
    code = main(["train-medusa", "--data-dir", str(data_dir), "--heldout-data-dir", str(heldout), "--out", str(out),
                 "--num-heads", "2", "--tree-size", "4", "--candidate-vocab", "256", *TINY])
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out top-1 accuracy" in printed and "held-out acceptance" in printed
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert len(report["training"]["top1"]) == 2 and len(report["training"]["medusa_choices"]) == 4
    assert report["acceptance"]["drafted_tokens"] > 0 and report["acceptance"]["mode"] == "medusa"
    from triton_backend.speculation.drafters.medusa_model import load_medusa

    loaded = load_medusa(out)
    assert loaded.info.num_heads == 2 and loaded.candidate_vocab.shape == (256,)


def test_distill_end_to_end_and_run_with_the_draft(data_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    code = main(["distill", "--data-dir", str(data_dir), "--out", str(out), "--init-layers", "0",
                 "--draft-vocab", "512", "--batch-size", "2", *TINY])
    assert code == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["training"]["steps"] >= 1 and report["acceptance"]["drafted_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "specbuild_subset_llama" and config["num_hidden_layers"] == 1
    capsys.readouterr()
    assert main(["run", "--draft", str(out), "--speculation", "draft", "--max-tokens", "6", "--prompt", "Hi"]) == 0
    assert "method=draft" in capsys.readouterr().out


def test_draft_logits_are_minus_infinity_outside_its_vocabulary(data_dir, tmp_path):
    from builder.train.distill import DistillConfig, distill
    from triton_backend.engines.torch.hf_engine import TorchEngine
    from triton_backend.engines.torch.model_loading import load_model

    out = tmp_path / "draft"
    distill(DistillConfig(target="smollm2-135m-instruct", data_dir=str(data_dir), out_dir=str(out), init_layers=(0,),
                          draft_vocab=64, epochs=1, time_limit_s=30), progress=False)
    engine = TorchEngine(load_model(str(out)), name="draft")
    assert engine.vocab_size == 49152
    logits = engine.new_session().logits([1, 2, 3], 1)[0]
    assert int(torch.isfinite(logits).sum()) == 64


def test_bad_settings_are_refused(tmp_path):
    from builder.train.distill import DistillConfig

    with pytest.raises(BuildSpecError):
        DistillConfig(target="x", data_dir="d", out_dir="o", init_layers=())
    with pytest.raises(BuildSpecError, match="no data shards"):
        list(iter_records(tmp_path))
    assert main(["distill", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                 "--prompts", str(tmp_path / "missing.txt"), "--quiet"]) == 2


def test_timed_schedule_anneals_by_steps_or_by_time():
    from builder.train.schedule import TimedCosine

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = TimedCosine(opt, total_steps=100, time_limit_s=3600.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # warm-up starts low
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)  # warm-up done (5%)
    for _ in range(45):
        sched.step()
    assert 0.4 < opt.param_groups[0]["lr"] < 0.6 and not sched.done
    for _ in range(50):
        sched.step()
    assert sched.done and opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)
    timed = TimedCosine(opt, total_steps=10**9, time_limit_s=1e-6)  # out of time: done, learning rate ~0
    assert timed.done and timed.factor() == pytest.approx(0.0, abs=1e-9)
