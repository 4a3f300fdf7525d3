#!/usr/bin/env bash
# The demo: a real super-cluster on 127.0.0.1, checked end to end, then taken down.
set -euo pipefail
export FERRY_LAB_DIR="${FERRY_LAB_DIR:-$PWD/.ferry-lab}"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step ferry lab up supercluster
trap 'step ferry lab down' EXIT
step ferry lab status
step ferry topology check "$FERRY_LAB_DIR/topology.yaml"
step ferry topology smoke --stream-in east --client-in west --count 5000
