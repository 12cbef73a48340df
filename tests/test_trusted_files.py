"""Files the runtime loads code or objects from: the row kernel's cached shared library is
checked (hash recorded at build, owner, mode) before it is loaded, and a training checkpoint
loads tensors and plain containers only (``torch.load(weights_only=True)``). No server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from builder.errors import BuildSpecError
from triton_backend.engines.torch import row_gemm


def _library(folder: Path) -> Path:
    folder.mkdir(mode=0o755)
    library = folder / "row_gemm-test.so"
    library.write_bytes(b"\x7fELF pretend library")
    os.chmod(library, 0o755)
    record = folder / "row_gemm-test.so.sha256"
    record.write_text(row_gemm._file_sha256(library) + "\n")
    os.chmod(record, 0o644)
    return library


def test_a_library_as_built_may_be_loaded_and_any_change_is_caught(tmp_path: Path) -> None:
    library = _library(tmp_path / "kernels")
    assert row_gemm.verify_library(library) is None
    library.write_bytes(b"\x7fELF something else")
    assert "does not match the hash" in row_gemm.verify_library(library)


@pytest.mark.parametrize("what", ["library", "record", "folder"])
def test_a_library_others_may_write_is_not_loaded(tmp_path: Path, what: str) -> None:
    library = _library(tmp_path / "kernels")
    path = {"library": library, "record": Path(f"{library}.sha256"), "folder": library.parent}[what]
    os.chmod(path, path.stat().st_mode | 0o002)
    assert "writable by others" in row_gemm.verify_library(library)


def test_a_library_without_its_record_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    library = _library(tmp_path / "kernels")
    Path(f"{library}.sha256").unlink()
    assert "missing" in row_gemm.verify_library(library)


def test_the_kernel_loads_through_the_check() -> None:
    """The machine's real kernel (built once per machine; rebuilt when its record is missing)."""
    isa = row_gemm.cpu_isa()
    if isa is None:
        pytest.skip("no AVX2 here: the row kernel does not run")
    assert row_gemm._load(isa) is not None
    library = next(row_gemm._kernel_dir().glob(f"row_gemm-{isa}-{row_gemm.kernel_digest(isa)}.so"))
    assert row_gemm.verify_library(library) is None


class _Payload:
    def __reduce__(self):  # what a crafted checkpoint would run at load with weights_only=False
        return (os.getpid, ())


def test_an_eagle_checkpoint_with_objects_is_refused(tmp_path: Path) -> None:
    from builder.train.eagle import _resume

    path = tmp_path / "resume.pt"
    torch.save({"identity": "x", "payload": _Payload()}, path)
    with pytest.raises(BuildSpecError, match="not a training checkpoint this version can load safely"):
        _resume(path, None, None, None)  # type: ignore[arg-type]


def test_what_eagle_training_saves_loads_with_weights_only(tmp_path: Path) -> None:
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    progress = {"steps": 3, "seconds": 1.5, "positions": 96, "curve": [[1, 0.5]], "epoch": 0}
    torch.save({"identity": {"lr": 1e-3, "layers": [0, 1]}, "net": net.state_dict(), "opt": opt.state_dict(),
                "progress": progress}, tmp_path / "resume.pt")
    state = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert state["progress"] == progress
    opt.load_state_dict(state["opt"])


def test_an_eagle3_checkpoint_with_objects_is_refused_and_its_own_saves_load(tmp_path: Path) -> None:
    from builder.train.eagle3 import CurvePoint, Eagle3TrainConfig, _resume, _save_state

    cfg = Eagle3TrainConfig(target="t", features_dir="f", heldout_dir="h", out=str(tmp_path))
    path = tmp_path / "train_state.pt"
    torch.save({"identity": cfg.identity(), "payload": _Payload()}, path)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with pytest.raises(BuildSpecError, match="not a training checkpoint this version can load safely"):
        _resume(path, cfg, net, opt)  # type: ignore[arg-type]
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    curve = [CurvePoint(steps=3, positions=96, seconds=1.5, acceptance=[0.5, 0.25])]
    _save_state(path, cfg, net, opt, {"steps": 3, "positions": 96}, curve, 1.5)  # type: ignore[arg-type]
    state, again = _resume(path, cfg, torch.nn.Linear(4, 4), torch.optim.AdamW(net.parameters()))  # type: ignore[arg-type]
    assert state == {"steps": 3, "positions": 96, "seconds": 1.5} and again == curve
