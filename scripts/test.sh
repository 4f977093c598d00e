#!/usr/bin/env bash
# The project's whole test run, what CI runs after scripts/setup.sh: everything `pytest`
# runs by default (tests/ and conformance/), then the e2e tier (`pytest e2e -m e2e`).
#
#   scripts/test.sh [PYTEST ARGS...]   extra arguments go to the default run's session
#   KVFAIL_WORKERS=N scripts/test.sh   that session on N pytest-xdist workers (default: one
#                                      more than the machine's cores, at most 4; 0: one
#                                      process, as plain `pytest`)
#
# Why workers: one process keeps a 2-core machine only about half busy (it mostly waits on
# deadlines, peers and sockets), and so do two workers, one per core; one more keeps the
# cores busy while the others wait, as the audit's child does (kvfail audit --workers).
# `--dist loadgroup` keeps each connector's scenarios on one worker (they share that
# connector's P processes; the suite marks them), spreads the rest test by test, and the
# controller writes the suite's one report and applies its coverage gate
# (docs/testing.md). The e2e tier's real `vllm serve` pairs run alone after it.
#
# The e2e tier runs even when the tests before it failed, so one run reports on both.
# Exit status: 0 only if every pytest session passed and ran at least one test.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTEST_PY:-.venv/bin/python}
# A scenario that stalls shows every thread's Python and native stacks of its P's and D's
# processes (kvfail.peers.stuck_evidence.STUCK_STACKS_ENV): seconds, paid only by a failure.
export KVFAIL_STUCK_STACKS=${KVFAIL_STUCK_STACKS:-1}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/kvfail-test.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT

# Failures and errors in a session's JUnit report (prints the count; exit 1 if unreadable).
report_failures() {
  "$PY" - "$1" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
print(sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites))
PYEOF
}

# pytest's exit 5 is "no tests collected": a run that tested nothing proves nothing. An
# exit 0 is checked against the session's own report: a process that holds NIXL agents
# ends itself with os._exit and must pass pytest's status on, and a slip there once made
# a failing run exit 0.
run_pytest() {
  local report
  report=$(mktemp "$LOGS/session.XXXXXX.xml")
  "$PY" -m pytest --junitxml="$report" "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest $* collected no tests (exit 5); counted as a failure" >&2
    return 1
  fi
  if [ "$rc" -eq 0 ] && [ -s "$report" ]; then  # empty: the caller's own --junitxml won
    local failed
    if ! failed=$(report_failures "$report") || [ "$failed" != 0 ]; then
      echo "test.sh: pytest $* exited 0, but its report lists ${failed:-unreadable} failures or errors; counted as a failure" >&2
      return 1
    fi
  fi
  return "$rc"
}

# The audit's rule, asked of the one function that holds it (2 if it cannot be asked).
DEFAULT_WORKERS=$("$PY" -c 'from kvfail.audit.dynamic_child import workers; print(workers())' \
  2>/dev/null || echo 2)
WORKERS=${KVFAIL_WORKERS:-$DEFAULT_WORKERS}
DIST=()
[ "$WORKERS" != 0 ] && DIST=(-n "$WORKERS" --dist loadgroup)
run_pytest "${DIST[@]}" "$@"
RC=$?
run_pytest e2e -m e2e || RC=1
exit "$RC"
