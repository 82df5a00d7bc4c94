#!/usr/bin/env bash
# The operations files of deploy/ against a live node: the alert rules pass `promtool check rules` and
# their unit tests (`promtool test rules`, which can fail: a rule that stops firing when it should is
# caught); then on the node of tests/gateway_node.sh, tests/dashboard_test.py checks that the Grafana
# dashboard's and the rules' PromQL names only what /metrics exports, and that a real Prometheus server
# scraping the node answers every dashboard query with data and evaluates every rule.
set -euo pipefail
source "$(dirname "$0")/gateway_node.sh"
RULES=$SRC/deploy/prometheus/kvbank-alerts.yml
out=$(promtool check rules "$RULES" 2>&1) || { echo "FAIL - promtool check rules: $out"; exit 1; }
echo "ok   - promtool check rules: $(grep -o 'SUCCESS: [0-9]* rules found' <<<"$out")"
out=$(cd "$SRC/deploy/prometheus" && promtool test rules kvbank-alerts.test.yml 2>&1) ||
    { echo "FAIL - promtool test rules: $out"; exit 1; }
# the unit tests can fail: with a threshold moved they do
mkdir -p "$T/rules"
sed "s/rate(kvbank_preemptions_total\\[5m\\]) > 1/rate(kvbank_preemptions_total[5m]) > 3/" \
    "$RULES" >"$T/rules/kvbank-alerts.yml"
cp "$SRC/deploy/prometheus/kvbank-alerts.test.yml" "$T/rules/"
! cmp -s "$RULES" "$T/rules/kvbank-alerts.yml" || { echo "FAIL - the broken copy of the rules is no different"; exit 1; }
if (cd "$T/rules" && promtool test rules kvbank-alerts.test.yml >/dev/null 2>&1); then
    echo "FAIL - promtool test rules passed with a broken rule"; exit 1
fi
echo "ok   - promtool test rules: the alerts fire (and stop) as their unit tests say; a broken threshold is caught"
gw_node_make
gw_node_start
"$PY" "$SRC/tests/dashboard_test.py" --port "$PORT" --dir "$T" --dashboard "$SRC/deploy/grafana/kvbank-node.json" \
    --rules "$RULES"
gw_node_no_sanitizer_report
