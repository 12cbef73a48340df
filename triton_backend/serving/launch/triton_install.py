"""Finding and preparing a Triton installation (see :mod:`triton_backend.serving.launch.triton_server`).

Two installations are supported (:class:`TritonSource`):

- ``pytriton``: the ``tritonserver`` that ``nvidia-pytriton`` bundles, with its Python
  backend. It is copied once into the cache (``$SPECBUILD_CACHE_DIR/tritonserver/...``)
  with the Python backend stub for this interpreter's version, and run with
  ``LD_LIBRARY_PATH`` = the bundled libraries + the folder holding ``libpythonX.Y.so``,
  and this interpreter's ``bin`` first on ``PATH`` (the stub finds its Python there).
- ``path``: a ``tritonserver`` on ``PATH`` (NVIDIA's Triton container images) with its
  own backends.

``auto`` takes a ``tritonserver`` on ``PATH`` when there is one, else the bundled one.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from triton_backend.core.errors import SpecbuildError
from triton_backend.core.reference_model import cache_dir

logger = logging.getLogger(__name__)


class ServerError(SpecbuildError, RuntimeError):
    """Triton could not be found, started, or did not become ready."""

    code = "server"


class TritonSource(str, enum.Enum):
    AUTO = "auto"
    PYTRITON = "pytriton"
    PATH = "path"


@dataclass(frozen=True)
class TritonInstallation:
    binary: Path
    backend_dir: Path | None  # None: the installation's default
    env: dict[str, str] = field(default_factory=dict)  # variables to set for the server
    description: str = ""


def _package_root() -> Path:
    """The folder holding the ``triton_backend`` package (put on the stub's PYTHONPATH)."""
    import triton_backend

    return Path(triton_backend.__file__).resolve().parent.parent


def _libpython_dir() -> Path:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    name = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and ".so" in name and (Path(libdir) / name).exists():
        return Path(libdir)
    raise ServerError(
        f"this Python ({sys.executable}) has no shared libpython (LDLIBRARY={name!r} in {libdir!r}); the bundled "
        "Triton Python backend needs one: use a Python built with --enable-shared "
        "(pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
    )


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError:
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed: "
                          "pip install 'nvidia-pytriton==0.7.0' or run inside NVIDIA's Triton image") from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise ServerError(f"nvidia-pytriton at {root.parent} has no bundled tritonserver")
    return root


def _copy_bundled_server(root: Path, stub: Path) -> Path:
    """Copy the bundled server + the stub into the cache once; return the copy."""
    from importlib.metadata import version

    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = cache_dir() / "tritonserver" / f"pytriton-{version('nvidia-pytriton')}-py{pyver}"
    if (dest / "backends" / "python" / "triton_python_backend_stub").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".copy-", dir=dest.parent))
    shutil.copytree(root, tmp / "server", ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub, tmp / "server" / "backends" / "python" / "triton_python_backend_stub")
    try:
        os.rename(tmp / "server", dest)
    except OSError:  # another process made it first
        if not dest.exists():
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared the bundled Triton server in %s", dest)
    return dest


def pytriton_installation() -> TritonInstallation:
    root = _pytriton_root()
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {pyver}")
    copy = _copy_bundled_server(root, stub)
    libs = root.parent.parent / "nvidia_pytriton.libs"
    ld = [str(libs), str(_libpython_dir())]
    if os.environ.get("LD_LIBRARY_PATH"):
        ld.append(os.environ["LD_LIBRARY_PATH"])
    env = {"LD_LIBRARY_PATH": os.pathsep.join(ld),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return TritonInstallation(copy / "bin" / "tritonserver", copy / "backends", env,
                              f"tritonserver bundled with nvidia-pytriton (Python {pyver} backend)")


def find_installation(source: TritonSource = TritonSource.AUTO) -> TritonInstallation:
    on_path = shutil.which("tritonserver")
    if source is TritonSource.PATH or (source is TritonSource.AUTO and on_path):
        if not on_path:
            raise ServerError("no tritonserver on PATH")
        return TritonInstallation(Path(on_path), None, {}, f"tritonserver on PATH ({on_path})")
    return pytriton_installation()


def server_environment(installation: TritonInstallation) -> dict[str, str]:
    """The server's environment: ours, the installation's, this project on PYTHONPATH and
    the cache folder (the model loads its weights from it)."""
    env = dict(os.environ)
    env.update(installation.env)
    paths = [str(_package_root())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SPECBUILD_CACHE_DIR"] = str(cache_dir())
    return env


__all__ = ["ServerError", "TritonInstallation", "TritonSource", "find_installation", "pytriton_installation",
           "server_environment"]
