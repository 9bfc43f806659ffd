#!/usr/bin/env bash
# Regenerate the images' hash-locked requirements from pyproject.toml (run from anywhere; needs `uv`:
# pip install uv). Each lock is resolved for the image's Python and platform, not this machine's.
#   requirements-serve.txt      Dockerfile.cpu     python:3.11 slim (Debian bookworm)   [cpu,tracing], no torch
#   requirements-serve-gpu.txt  Dockerfile.gpu     Ubuntu 24.04 python3.12              [gpu,tracing], no torch
#   requirements-export.txt     Dockerfile.export  python:3.11 slim                     [cpu,export] + CPU torch
#   requirements-build.txt      all three          the build backend (pyproject's [build-system] requires)
# The CPU torch wheel comes from the PyTorch index; pass its location as TORCH_FIND_LINKS (a directory holding
# the wheel, or https://download.pytorch.org/whl/cpu/torch/) so the lock records its hash.
set -euo pipefail
cd "$(dirname "$0")/../.."

# manylinux_2_31: llguidance publishes no older wheels; both images' glibc (bookworm 2.36, noble 2.39) is newer.
compile() {
    uv pip compile "$@" --python-platform x86_64-manylinux_2_31 --generate-hashes --quiet
}

compile pyproject.toml --extra cpu --extra tracing --python-version 3.11 -o deploy/docker/requirements-serve.txt
compile pyproject.toml --extra gpu --extra tracing --python-version 3.12 -o deploy/docker/requirements-serve-gpu.txt
compile pyproject.toml deploy/docker/torch-cpu.in --extra cpu --extra export --python-version 3.11 \
    --find-links "${TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}" \
    -o deploy/docker/requirements-export.txt
# The project is built inside the images without build isolation (no index there): its backend is locked too.
python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' |
    compile - --python-version 3.11 -o deploy/docker/requirements-build.txt
