#!/usr/bin/env bash
# Installs, builds, and runs the main job: `kda check` (every path against the float64 oracle),
# then `kda bench` (speed at a Kimi Linear layer's shape). Arguments go to `kda` (see `kda --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
exec "${KDA_BUILD_DIR:-build}/kda" "$@"
