#!/usr/bin/env bash
# The documentation site. `bash scripts/docs.sh serve` (recommended) builds and serves it on
# http://127.0.0.1:8000 with live reload. `bash scripts/docs.sh` builds it into site/
# (gitignored) to open from the file system: page links end in .html (Material's offline
# plugin, mkdocs.yml), so site/index.html works as a file:// URL; its search box needs one
# script from unpkg.com, the served site's does not.
# Sets up .venv first (scripts/setup.sh installs the docs extra with the rest).
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner on every build
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
case "${1:-build}" in
    build) ATTN_DI_DOCS_OFFLINE=true .venv/bin/python -m mkdocs build --strict --site-dir site
           echo "docs: open file://$PWD/site/index.html (or: bash scripts/docs.sh serve," \
               "http://127.0.0.1:8000, search included)" ;;
    serve) exec .venv/bin/python -m mkdocs serve --strict --dev-addr "127.0.0.1:${PORT:-8000}" ;;
    *) echo "usage: bash scripts/docs.sh [build|serve]" >&2; exit 2 ;;
esac
