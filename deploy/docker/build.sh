#!/usr/bin/env bash
# Build textgen's images without reaching a package index from inside a build:
#   deploy/docker/build.sh cpu export        (any of: cpu, export, gpu; from anywhere)
# For each image:
#   1. its wheelhouse, deploy/docker/wheels/<image>/: `pip download` on this machine of the image's
#      hash-locked requirements (and of requirements-build.txt, the project's build backend) for the image's
#      Python and platform; files already there are reused;
#   2. `docker build`, which copies the wheelhouse in and installs it with --no-index --require-hashes;
#   3. the tag: the image reference of its Kubernetes manifests (deploy/k8s), so they run what was built.
# BASE_IMAGE: another base than the Dockerfile's default, e.g. the local one deploy/docker/build_base.sh makes
#   where the public registry cannot be reached (the GPU image's base is NVIDIA's CUDA image).
# PYTHON: the interpreter whose pip downloads (default python3).
# TORCH_FIND_LINKS: where the exporter's CPU torch wheel is (a local folder holding the locked wheel works
#   too; default https://download.pytorch.org/whl/cpu/torch/).
set -euo pipefail
cd "$(dirname "$0")/../.."

DOCKER_DIR=deploy/docker
PYTHON="${PYTHON:-python3}"
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"

# image -> Dockerfile, lock, the image's Python version, the kustomization that names the image.
declare -A DOCKERFILE=([cpu]=Dockerfile.cpu [export]=Dockerfile.export [gpu]=Dockerfile.gpu)
declare -A LOCK=(
    [cpu]=requirements-serve.txt [export]=requirements-export.txt [gpu]=requirements-serve-gpu.txt
)
declare -A PYVER=([cpu]=3.11 [export]=3.11 [gpu]=3.12)
declare -A KUSTOMIZATION=(
    [cpu]=deploy/k8s/overlays/cpu [export]=deploy/k8s/export [gpu]=deploy/k8s/overlays/gpu
)

# newName:newTag of the one `images:` entry of a kustomization.yaml.
image_ref() {
    awk '$1 == "newName:" {name = $2} $1 == "newTag:" {tag = $2} END {print name ":" tag}' \
        "$1/kustomization.yaml"
}

# --platform for every manylinux glibc up to the locks' 2.31 (older pips do not widen the one they are given).
manylinux_platforms() {
    local minor
    for minor in $(seq 31 -1 5); do printf -- '--platform\nmanylinux_2_%s_x86_64\n' "$minor"; done
    printf -- '--platform\n%s\n' manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64
}

fill_wheelhouse() {
    local image="$1" wheels="$DOCKER_DIR/wheels/$1" version="${PYVER[$1]}"
    local links=() platforms
    mapfile -t platforms < <(manylinux_platforms)
    [[ "$image" == export ]] && links=(--find-links "$TORCH_FIND_LINKS")
    mkdir -p "$wheels"
    for lock in "${LOCK[$image]}" requirements-build.txt; do
        "$PYTHON" -m pip download --quiet --dest "$wheels" --require-hashes --no-deps --only-binary=:all: \
            "${platforms[@]}" --implementation cp --python-version "$version" \
            --abi "cp${version/./}" "${links[@]}" -r "$DOCKER_DIR/$lock"
    done
}

build() {
    local image="$1" ref size
    ref="$(image_ref "${KUSTOMIZATION[$image]}")"
    local args=(--file "$DOCKER_DIR/${DOCKERFILE[$image]}" --tag "$ref")
    [[ -n "${BASE_IMAGE:-}" ]] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    fill_wheelhouse "$image"
    docker build "${args[@]}" .
    size="$(docker image inspect --format '{{.Size}}' "$ref")"
    echo "built $ref: $((size / 1000000)) MB"
}

[[ $# -gt 0 ]] || { echo "usage: $0 cpu|export|gpu..." >&2; exit 2; }
for image in "$@"; do
    [[ -n "${DOCKERFILE[$image]:-}" ]] || { echo "$0: unknown image $image (cpu, export, gpu)" >&2; exit 2; }
    build "$image"
done
