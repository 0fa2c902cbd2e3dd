#!/usr/bin/env bash
# Checks that the C++ lines a change touches are formatted as .clang-format says (Debian's
# clang-format-14); lines nobody touched keep their shape, so the check never asks for a
# whole-file reformat.
#
#   tools/format_check.sh [BASE]   the lines changed between BASE and the working tree
#                                  (default: the commit that added .clang-format, so that CI
#                                  checks every line changed since the formatter came in)
#   tools/format_check.sh --fix [BASE]   formats those lines in place instead
#
# Exit 0: formatted (or nothing to check); 1: the diff it prints is what clang-format wants.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

fix=0
if [[ "${1:-}" == "--fix" ]]; then
  fix=1
  shift
fi
tool=git-clang-format-14
binary=clang-format-14
command -v "$tool" >/dev/null || { echo "format_check: $tool not found (Debian: clang-format-14)" >&2; exit 1; }
base=${1:-$(git log --diff-filter=A --format=%H -- .clang-format | tail -n 1)}
if [[ -z "$base" ]] || ! git cat-file -e "${base}^{commit}" 2>/dev/null; then
  echo "format_check: no base commit to compare with (a shallow clone?): nothing checked" >&2
  exit 0
fi
if ((fix)); then
  "$tool" --binary "$binary" --extensions cpp,h --force "$base" || true
  exit 0
fi
out=$("$tool" --binary "$binary" --extensions cpp,h --diff "$base" 2>&1 || true)
if [[ "$out" == diff* ]]; then
  printf '%s\n' "$out"
  echo "format_check: lines changed since ${base:0:12} are not formatted; tools/format_check.sh --fix" >&2
  exit 1
fi
echo "format_check: the lines changed since ${base:0:12} are formatted"
