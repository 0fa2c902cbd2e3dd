#!/usr/bin/env bash
# Checks commit messages as CONTRIBUTING.md asks: a subject of at most 72 characters, then a
# blank line and a body.
#
#   tools/commit_check.sh [BASE]   the commits after BASE up to HEAD (default: every commit since
#                                  the one that added CONTRIBUTING.md, that one included)
#
# Exit 0: every message fits; 1: it lists those that do not.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ $# -ge 1 ]]; then
  range="$1..HEAD"
else
  first=$(git log --diff-filter=A --format=%H -- CONTRIBUTING.md | tail -n 1)
  if [[ -z "$first" ]]; then
    echo "commit_check: CONTRIBUTING.md is not committed yet: nothing checked" >&2
    exit 0
  fi
  # The commit that added it, and every one after it.
  if git cat-file -e "${first}^" 2>/dev/null; then range="${first}^..HEAD"; else range="HEAD"; fi
fi

bad=0
checked=0
while IFS= read -r sha; do
  checked=$((checked + 1))
  subject=$(git log -1 --format=%s "$sha")
  blank=$(git log -1 --format=%B "$sha" | sed -n 2p)
  body=$(git log -1 --format=%b "$sha" | tr -d '[:space:]')
  why=()
  ((${#subject} <= 72)) || why+=("subject of ${#subject} characters (at most 72)")
  [[ -z "$blank" ]] || why+=("no blank line after the subject")
  [[ -n "$body" ]] || why+=("no body saying why")
  if ((${#why[@]})); then
    bad=1
    printf '%s %s\n' "${sha:0:12}" "$subject"
    printf '    %s\n' "${why[@]}"
  fi
done < <(git rev-list --no-merges "$range")

if ((bad)); then
  echo "commit_check: reword the commits above (CONTRIBUTING.md, \"Commit messages\")" >&2
  exit 1
fi
echo "commit_check: $checked commit message(s) fit"
