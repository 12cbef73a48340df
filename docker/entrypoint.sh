#!/bin/sh
# Entrypoint of both specbuild images (Dockerfile.gpu, Dockerfile.cpu), also run as is outside
# a container by the tests.
#
#   no arguments             -> specbuild deploy, configured by SPECBUILD_* variables
#   arguments starting "-"   -> specbuild deploy with these flags (they win over the variables)
#   anything else            -> run it as a command (specbuild generate ..., bash, ...)
#
# `specbuild deploy` builds (or reuses, keyed by the spec's hash) the engines and the model
# repository of $SPECBUILD_SPEC in $SPECBUILD_ENGINE_CACHE, then runs Triton in the
# foreground; SIGTERM stops Triton cleanly (in-flight requests finish). See docker/README.md.
set -eu
PYTHON="${SPECBUILD_PYTHON:-python3}"
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    exec "$PYTHON" -m builder.cli.deploy "$@"
fi
exec "$@"
