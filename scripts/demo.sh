#!/usr/bin/env bash
# The demo: a real super-cluster on 127.0.0.1; a stream moved from east to west under core and
# JetStream load, then the audit that proves nothing was lost or duplicated.
# FERRY_DEMO_SECURE=1: the same on a secured super-cluster (operator mode, .creds files, TLS with
# client certificates on every port, HAProxy checking the nodes over TLS).
set -euo pipefail
export FERRY_LAB_DIR="${FERRY_LAB_DIR:-$PWD/.ferry-lab}"
OUT="${FERRY_DEMO_OUT:-$PWD/demo-out}"
RATE="${FERRY_DEMO_RATE:-3500}"
rm -rf "$OUT" && mkdir -p "$OUT"
export FERRY_STATE_DIR="$OUT/state"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*" >&2; "$@"; }
step_to() { local file=$1; shift; printf '\n\033[1m$ %s > %s\033[0m\n' "$*" "$file" >&2; "$@" > "$file"; }

SECURE=()
if [ "${FERRY_DEMO_SECURE:-0}" = 1 ]; then SECURE=(--secure); fi
step ferry lab up supercluster --haproxy "${SECURE[@]}"   # with ferry serve (the console) and Prometheus
trap 'step ferry lab down' EXIT
step ferry topology check "$FERRY_LAB_DIR/topology.yaml"
step ferry stream add ORDERS --cluster east --placement east --subject 'orders.>' --replicas 3

# producers on west: fire-and-forget core publishes (no msg id) and JetStream publishes with retries
step ferry load nats://west --subject 'orders.core.{n}' --no-msg-id --rate "$RATE" --duration 14 \
     --ledger "$OUT/ledger/kind=core" &
CORE=$!
step ferry load jetstream://west --subject 'orders.js.{n}' --producers 2 --rate "$RATE" --duration 14 \
     --ledger "$OUT/ledger/kind=js" &
JS=$!
sleep 4
python - "$FERRY_LAB_DIR/supercluster/state.json" <<'PY'
import json, sys
lb = json.load(open(sys.argv[1]))["lb"]
print(f"\nwatch the move: {lb['serve']}/ (bearer token in {lb['token_file']}); Prometheus: {lb['prometheus']}")
PY
step ferry move ORDERS --to west
wait "$CORE" "$JS"

step_to "$OUT/move.json" ferry move --status ORDERS --json
step_to "$OUT/audit.json" ferry audit --ledger "$OUT/ledger" --tier west=jetstream://west/ORDERS --html "$OUT/audit.html" --json
python - "$OUT/move.json" "$OUT/audit.json" <<'PY'
import json, sys
move = json.load(open(sys.argv[1]))["result"]
audit = json.load(open(sys.argv[2]))
west = audit["tiers"]["west"]
print(f"\nmoved ORDERS {move['from']} -> {move['cluster']} under load: sent {west['sent']:,}, "
      f"lost {west['lost']}, duplicated {west['extra_copies']}, "
      f"unavailability window {move['unavailable_s'] * 1000:.1f} ms, move took {move['took_s']:.1f} s "
      f"(the stream missed {move['missed']}: ferry re-published {move['reinjected']}, producer retries "
      f"had stored {move['already_stored']})")
delay = west.get("delay") or {}
print(f"reordered {west['reordered']:,} (per subject and producer: re-published and retried messages land after later ones), "
      f"delay p99 {delay.get('p99_ms', 0):.1f} ms, max {delay.get('max_ms', 0):.1f} ms")
sys.exit(0 if audit["pass"] and west["lost"] == 0 and west["extra_copies"] == 0 else 1)
PY
echo "audit report: $OUT/audit.html"
