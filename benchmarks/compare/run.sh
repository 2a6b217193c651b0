#!/usr/bin/env bash
# Run the side-by-side comparison with the repo's venv; arguments go to run.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$repo/.venv/bin/python" "$repo/benchmarks/compare/run.py" "$@"
