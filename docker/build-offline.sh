#!/usr/bin/env bash
# Builds the CPU image (docker/Dockerfile.cpu) without network access from Docker: everything the
# image installs is prepared here on the host first.
#
#   docker/build-offline.sh [--tag specbuild:cpu] [--base-image IMAGE] [--prepare-only]
#   docker/build-offline.sh --gpu [--tag specbuild:gpu] [--base-image IMAGE] [--prepare-only]
#
#   1. base image: --base-image IMAGE if given (for example the official python:3.11 slim image,
#      already loaded); otherwise specbuild-base:bookworm, imported from a Debian bookworm root
#      made with `debootstrap --variant=minbase` (Python 3.11 with its shared libpython, which the
#      Triton Python backend stub needs). Needs root and debootstrap; the trimmed root filesystem
#      is kept as a tarball in the cache folder and imported again from there next time.
#   2. wheelhouse (docker/offline/wheels): `pip download` of pyproject.toml's dependencies for the
#      image's platform (CPython 3.11, manylinux x86_64), the pinned torch being the CPU wheel
#      (from pip's own configuration when that yields a +cpu build, otherwise from PyTorch's
#      CPU index), plus the build backend of specbuild itself. Kept in the cache folder.
#   3. reference model (docker/offline/cache): the converted SmolLM2-135M-Instruct from the host's
#      $SPECBUILD_CACHE_DIR (run `specbuild fetch-model` first), so the image never downloads it.
#   4. row-invariant matmul kernel (docker/offline/cache/kernels): compiled here with the host's
#      C++ compiler for this CPU (the image carries no compiler); without it the image runs
#      torch's kernels (logged).
#   5. docker build -f docker/Dockerfile.cpu --build-arg BASE_IMAGE=... -t TAG .
#
# --gpu does the same for docker/Dockerfile.gpu: the wheelhouse (docker/offline/wheels-gpu) holds
# docker/requirements-gpu.txt for CPython 3.12 (NVIDIA's image keeps its own torch, TensorRT-LLM
# and their companions), and the base is NVIDIA's Triton image, which must already be loaded
# (`docker load`; default tag nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3).
#
# Variables: SPECBUILD_DOCKER_CACHE (cache folder, default ~/.cache/specbuild-docker),
# SPECBUILD_CACHE_DIR (host model cache, default ~/.cache/specbuild), PYTHON (runs pip; default
# the repository's .venv, else python3), DEBIAN_MIRROR, TORCH_CPU_INDEX.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OFFLINE="$REPO/docker/offline"
CACHE="${SPECBUILD_DOCKER_CACHE:-$HOME/.cache/specbuild-docker}"
MODEL_CACHE="${SPECBUILD_CACHE_DIR:-$HOME/.cache/specbuild}"
MODEL_NAME=smollm2-135m-instruct
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
BASE_TAG=specbuild-base:bookworm
TAG=""
BASE_IMAGE=""
BUILD=1
KIND=cpu
if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="${PYTHON:-$REPO/.venv/bin/python}"; else PYTHON="${PYTHON:-python3}"; fi

die() { echo "build-offline: $*" >&2; exit 1; }
say() { echo "build-offline: $*" >&2; }

while [ "$#" -gt 0 ]; do
    case "$1" in
        --tag) TAG="${2:?--tag needs a value}"; shift 2 ;;
        --base-image) BASE_IMAGE="${2:?--base-image needs a value}"; shift 2 ;;
        --prepare-only) BUILD=0; shift ;;
        --gpu) KIND=gpu; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

# -- 1. base image ---------------------------------------------------------------------------
bootstrap_base_tarball() {
    local tarball="$1" root
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap), or pass --base-image"
    [ "$(id -u)" -eq 0 ] || die "debootstrap needs root, or pass --base-image"
    root="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    say "debootstrap bookworm (minbase + python3.11) into $root"
    debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,libstdc++6,zlib1g,libexpat1 \
        bookworm "$root" "$DEBIAN_MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { rm -rf "$root"; die "debootstrap failed, see $CACHE/debootstrap.log"; }
    # what a container never needs: downloaded packages, package lists, documentation, locales
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
        "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*
    tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
}

ensure_base_image() {
    if [ -n "$BASE_IMAGE" ]; then
        docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || die "base image $BASE_IMAGE is not loaded (docker load it first)"
        return
    fi
    BASE_IMAGE="$BASE_TAG"
    if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
        say "base image $BASE_TAG is present"
        return
    fi
    local tarball="$CACHE/bookworm-minbase.tar"
    [ -s "$tarball" ] || bootstrap_base_tarball "$tarball"
    say "docker import $tarball as $BASE_TAG"
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_TAG" >/dev/null
}

# -- 2. wheelhouse ---------------------------------------------------------------------------
pip_download() {
    "$PYTHON" -m pip download --disable-pip-version-check --progress-bar off -q "$@"
}

image_platform_flags() {  # $1: the image's Python version, e.g. 3.11
    local m abi="cp${1/./}"
    printf '%s\n' --only-binary=:all: --python-version "$1" --implementation cp --abi "$abi" --abi abi3 --abi none
    for m in $(seq 36 -1 5); do printf -- '--platform\nmanylinux_2_%s_x86_64\n' "$m"; done
    printf -- '--platform\n%s\n' manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64
}

ensure_wheelhouse() {
    local wheels="$CACHE/wheels-cp311" torch_pin requirements
    mkdir -p "$wheels"
    torch_pin="$(grep -o '"torch==[^"]*"' "$REPO/pyproject.toml" | tr -d '"')"
    [ -n "$torch_pin" ] || die "pyproject.toml pins no torch version"
    if ! ls "$wheels"/torch-*+cpu-cp311-*.whl >/dev/null 2>&1; then
        local tmp
        tmp="$(mktemp -d "$CACHE/torch.XXXXXX")"
        say "pip download $torch_pin (CPU build)"
        pip_download --no-deps -d "$tmp" "$torch_pin" || true
        if ! ls "$tmp"/torch-*+cpu-cp311-*.whl >/dev/null 2>&1; then
            rm -f "$tmp"/*.whl
            pip_download --no-deps -d "$tmp" --index-url "$TORCH_CPU_INDEX" "$torch_pin" \
                || die "could not download the CPU build of $torch_pin"
        fi
        mv "$tmp"/torch-*.whl "$wheels"/
        rm -rf "$tmp"
    fi
    requirements="$(mktemp)"
    pyproject_requirements project >"$requirements"
    download_into "$wheels" 3.11 "$requirements" "$OFFLINE/wheels"
}

pyproject_requirements() {  # $1: project (its dependencies and build backend) or build (the backend)
    "$PYTHON" - "$REPO/pyproject.toml" "$1" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)
backend = project["build-system"]["requires"]
print("\n".join(backend if sys.argv[2] == "build" else project["project"]["dependencies"] + backend))
EOF
}

download_into() {  # $1: cache folder, $2: the image's Python, $3: requirements file (removed), $4: context folder
    local flags=()
    mapfile -t flags < <(image_platform_flags "$2")
    say "pip download for CPython $2 manylinux x86_64 into $1"
    pip_download -d "$1" --find-links "$1" "${flags[@]}" -r "$3" || { rm -f "$3"; die "pip download failed"; }
    rm -f "$3"
    mirror "$1" "$4" '*.whl'
}

mirror() {  # $1 -> $2, files matching $3: hard links where possible; unchanged files stay untouched
    # (Docker's build cache keys a COPY on the files and their times: an unchanged folder stays cached)
    local src="$1" dest="$2" pattern="$3" file name
    mkdir -p "$dest"
    for file in "$dest"/$pattern; do
        [ -e "$file" ] || continue
        name="$(basename "$file")"
        [ "$file" -ef "$src/$name" ] || cmp -s "$file" "$src/$name" || rm -f "$file"
    done
    for file in "$src"/$pattern; do
        name="$(basename "$file")"
        [ -e "$dest/$name" ] || cp -pl "$file" "$dest/$name" 2>/dev/null || cp -p "$file" "$dest/$name"
    done
}

ensure_gpu_wheelhouse() {
    local requirements
    requirements="$(mktemp)"
    { grep -v '^#' "$REPO/docker/requirements-gpu.txt"; pyproject_requirements build; } >"$requirements"
    mkdir -p "$CACHE/wheels-cp312"
    download_into "$CACHE/wheels-cp312" 3.12 "$requirements" "$OFFLINE/wheels-gpu"
}

# -- 3. reference model ----------------------------------------------------------------------
ensure_model_cache() {
    local src="$MODEL_CACHE/models/$MODEL_NAME" dest="$OFFLINE/cache/models/$MODEL_NAME"
    [ -f "$src/.specbuild-complete" ] || die "no converted reference model in $src: run \`specbuild fetch-model\` first"
    mirror "$src" "$dest" '*'
    mirror "$src" "$dest" '.specbuild-complete'
}

# -- 4. row-invariant matmul kernel -----------------------------------------------------------
ensure_kernel_cache() {
    if SPECBUILD_CACHE_DIR="$OFFLINE/cache" PYTHONPATH="$REPO" "$PYTHON" -c \
        "import sys; from triton_backend.engines.torch.row_gemm import load_row_gemm; sys.exit(load_row_gemm() is None)"; then
        say "row-invariant matmul kernel in $OFFLINE/cache/kernels"
    else
        say "the row-invariant matmul kernel could not be built here: the image will run torch's kernels"
    fi
}

mkdir -p "$CACHE"
if [ "$KIND" = gpu ]; then ensure_gpu_wheelhouse; else ensure_wheelhouse; fi
ensure_model_cache
if [ "$KIND" = cpu ]; then ensure_kernel_cache; fi
if [ "$BUILD" -eq 0 ]; then
    say "prepared $OFFLINE for the $KIND image; not building"
    exit 0
fi
command -v docker >/dev/null || die "no docker client on PATH"
docker info >/dev/null 2>&1 || die "no Docker engine answers (is dockerd running?)"
if [ "$KIND" = gpu ]; then
    # NVIDIA's registry may be out of reach: the image must be loaded already (docker load)
    BASE_IMAGE="${BASE_IMAGE:-nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3}"
fi
ensure_base_image
TAG="${TAG:-specbuild:$KIND}"
say "docker build -f docker/Dockerfile.$KIND --build-arg BASE_IMAGE=$BASE_IMAGE -t $TAG"
docker build -f "$REPO/docker/Dockerfile.$KIND" --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$TAG" "$REPO"
