#!/usr/bin/env bash
# `make test`: the main suite with PYTHON in the foreground and `make test-sdk` (the SDK mirror's
# install and sessions) beside it: the main suite keeps about one of CI's two cores busy, and the
# two share only the test cache, whose writers publish by rename (testing/publish.py). The mirror
# runs in its own process group, stopped with this script (an interrupt, CI's timeout); its output
# follows the main suite's. Either failing fails the run.
# usage: PYTEST_ARGS="..." tools/test_side_by_side.sh PYTHON
set -uo pipefail
python=$1
log=$(mktemp)
setsid "${MAKE:-make}" --no-print-directory test-sdk >"$log" 2>&1 &
sdk=$!
trap 'kill -TERM -- -$sdk 2>/dev/null; rm -f "$log"' EXIT
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words, as in the Makefile
"$python" -m pytest -m "not xla" ${PYTEST_ARGS:-}
main=$?
wait "$sdk"
sdk_rc=$?
echo "===== SDK environment: make test-sdk, run beside the main suite ====="
cat "$log"
echo "main suite: exit $main; SDK environment: exit $sdk_rc"
[ "$main" -eq 0 ] && [ "$sdk_rc" -eq 0 ]
