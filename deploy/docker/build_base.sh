#!/usr/bin/env bash
# Build a local stand-in for the images' public base (python:3.11-slim-bookworm) from Debian's own packages,
# for machines that cannot pull from a public image registry (air-gapped clusters, CI without Docker Hub):
# a minimal Debian bookworm with its python3.11 and venv, made by mmdebstrap and loaded with `docker import`.
#   deploy/docker/build_base.sh [TAG]          (default textgen-base:python3.11-bookworm; needs root)
# Then build any image on it: BASE_IMAGE=textgen-base:python3.11-bookworm deploy/docker/build.sh cpu
# MIRROR and SECURITY_MIRROR select the Debian mirrors (defaults: deb.debian.org).
set -euo pipefail

TAG="${1:-textgen-base:python3.11-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

if ! command -v mmdebstrap >/dev/null; then
    echo "build_base.sh: needs mmdebstrap (apt-get install mmdebstrap)" >&2
    exit 1
fi

# minbase: Debian's essential packages and apt, like the slim image. Documentation is left out, as there.
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm - \
    "deb $MIRROR bookworm main" \
    "deb $MIRROR bookworm-updates main" \
    "deb $SECURITY_MIRROR bookworm-security main" |
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$TAG"
docker run --rm "$TAG" python3 -c 'import sys, venv; print("base python", sys.version.split()[0])'
