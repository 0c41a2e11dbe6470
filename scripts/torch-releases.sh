#!/usr/bin/env bash
# Prints torch releases from cmake/torch-releases.txt (the releases CI tests):
#   scripts/torch-releases.sh            every release, oldest first
#   scripts/torch-releases.sh --pinned   the pinned one (the README's two commands)
#   scripts/torch-releases.sh --others   every release but the pinned one
set -euo pipefail
file="$(dirname "${BASH_SOURCE[0]}")/../cmake/torch-releases.txt"
case "${1:-}" in
  "") awk '!/^#/ && NF {print $1}' "$file" ;;
  --pinned) awk '!/^#/ && $2 == "pinned" {print $1}' "$file" ;;
  --others) awk '!/^#/ && NF && $2 != "pinned" {print $1}' "$file" ;;
  *) echo "usage: $0 [--pinned | --others]" >&2; exit 2 ;;
esac
