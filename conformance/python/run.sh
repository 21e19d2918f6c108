#!/usr/bin/env bash
# Runs the Python conformance suite against the server named by the environment
# (E2B_API_URL, E2B_API_KEY, E2B_SANDBOX_URL or E2B_DOMAIN). The SDK comes from
# $CONFORMANCE_PYTHON, else ./.venv (make it with: python3 -m venv .venv &&
# .venv/bin/pip install -r requirements.txt), else python3. Exit 77: cannot run here.
set -euo pipefail
cd "$(dirname "$0")"
py=${CONFORMANCE_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" run.py "$@"
