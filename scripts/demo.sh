#!/usr/bin/env bash
# The demo: a real super-cluster on 127.0.0.1, a load with a ledger, and the audit that proves it.
set -euo pipefail
export FERRY_LAB_DIR="${FERRY_LAB_DIR:-$PWD/.ferry-lab}"
OUT="${FERRY_DEMO_OUT:-$PWD/demo-out}"
rm -rf "$OUT" && mkdir -p "$OUT"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step ferry lab up supercluster
trap 'step ferry lab down' EXIT
step ferry topology check "$FERRY_LAB_DIR/topology.yaml"
step ferry stream add ORDERS --cluster east --subject 'orders.>' --replicas 3

# producers on west publish into the stream placed in east, in the background
step ferry load jetstream://west --subject 'orders.{n}' --producers 2 --rate 3500 --duration 10 \
     --ledger "$OUT/ledger" &
LOAD=$!
step ferry stream info ORDERS --cluster east
wait "$LOAD"

step ferry snapshot jetstream://east/ORDERS --out "$OUT/snapshot"
step ferry audit --ledger "$OUT/ledger" --tier east="$OUT/snapshot" --html "$OUT/audit.html"
echo
echo "audit report: $OUT/audit.html"
