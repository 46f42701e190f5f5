#!/usr/bin/env bash
# Build the documentation site into site/ (gitignored): `bash scripts/docs.sh`.
# `bash scripts/docs.sh serve` builds and serves it on http://127.0.0.1:8000 with live reload.
# Sets up .venv first (scripts/setup.sh installs the docs extra with the rest).
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner on every build
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
case "${1:-build}" in
    build) .venv/bin/python -m mkdocs build --strict --site-dir site
           echo "docs: site/index.html (bash scripts/docs.sh serve: http://127.0.0.1:8000)" ;;
    serve) exec .venv/bin/python -m mkdocs serve --strict --dev-addr "127.0.0.1:${PORT:-8000}" ;;
    *) echo "usage: bash scripts/docs.sh [build|serve]" >&2; exit 2 ;;
esac
