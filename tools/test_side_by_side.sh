#!/usr/bin/env bash
# `make test`: the main suite with PYTHON in the foreground and `make test-sdk` (the SDK mirror's
# install and sessions) beside it, on CI's two cores. What both sessions may write is named per
# environment (checkpoints and exports carry the library versions) or published whole, by rename
# or under a lock (testing/publish.py, export_cache/store.py); a `vllm serve` checks that the port
# answers with its own model (testing/server.py). The mirror runs in its own process group, stopped
# with this script (an interrupt, CI's timeout); its output follows the main suite's. Either
# failing fails the run.
# usage: tools/test_side_by_side.sh PYTHON [PYTEST_ARG ...]   (make test passes PYTEST_ARGS)
set -uo pipefail
python=$1
shift
log=$(mktemp)
# One OpenMP thread a process: with two sessions on two cores, a torch op's second thread waits
# for the core the other session holds, and spins while it waits.
export OMP_NUM_THREADS=1
setsid "${MAKE:-make}" --no-print-directory test-sdk >"$log" 2>&1 &
sdk=$!
trap 'kill -TERM -- -$sdk 2>/dev/null; rm -f "$log"' EXIT
trap 'exit 130' INT # pytest exits normally on an interrupt: stop here too, not after the mirror
trap 'exit 143' TERM
"$python" -m pytest -m "not xla" "$@"
main=$?
wait "$sdk"
sdk_rc=$?
echo "===== SDK environment: make test-sdk, run beside the main suite ====="
cat "$log"
echo "main suite: exit $main; SDK environment: exit $sdk_rc"
[ "$main" -eq 0 ] && [ "$sdk_rc" -eq 0 ]
