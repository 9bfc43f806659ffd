#!/usr/bin/env bash
# System packages the test suite needs beyond the Python venv: Debian's `prometheus` package provides
# `promtool` (check metrics/rules, rule unit tests) and the `prometheus` server (the scrape integration test).
# Debian 12 (bookworm) offers 2.42.0+ds-5+deb12u1, which has everything the tests use.
# Idempotent: does nothing when both binaries are already on PATH. Runs as root in CI; elsewhere it uses sudo
# when available and otherwise says what to install.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "system-deps: promtool/prometheus missing and not root: install the Debian package 'prometheus'" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
# --no-install-recommends: the package only recommends the node exporter, which the tests do not use.
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null
promtool --version | head -n 1
