#!/usr/bin/env bash
# The rooms of src/shm and the only direction their includes may go: a file includes headers of
# its own room and of the rooms listed before it on its line below, never of a room above it.
# Run by the test suite (ctest layer_check); prints each include that goes up and fails.
#
#   layout      the segment's bytes (segment_layout.h) and their validation
#   parts       waiting, rings, arenas, matching, trust, process identity: each alone
#   reader      the read-only reader of /dev/shm for operators, and the frozen layouts' readers
#   segment     a segment's lifecycle: create, attach, liveness, locks, room, gc
#   p2p         the point-to-point channel and its loans
#   collective  the collective steps and reductions
#   engine      one rank's engine over the segment, and the collectives over it
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../src/shm"

declare -A below=(
  [layout]=""
  [parts]="layout"
  [reader]="layout parts"
  [segment]="layout parts reader"
  [p2p]="layout parts segment"
  [collective]="layout parts segment"
  [engine]="layout parts segment p2p collective"
)

status=0
for room in */; do
  room="${room%/}"
  if [[ -z "${below[${room}]+set}" ]]; then
    echo "layer_check: src/shm/${room}/ is not a room this script knows; add it above" >&2
    status=1
    continue
  fi
  allowed=" ${room} ${below[${room}]} "
  while IFS=: read -r file _ target; do
    to="$(sed -E 's|.*"shm/([a-z0-9_]+)/.*|\1|' <<<"${target}")"
    if [[ "${allowed}" != *" ${to} "* ]]; then
      echo "layer_check: src/shm/${file} includes shm/${to}/, a room above ${room}/" >&2
      status=1
    fi
  done < <(grep -rn '#include "shm/' "${room}" || true)
done
loose="$(find . -maxdepth 1 -type f -printf '%f\n')"
if [[ -n "${loose}" ]]; then
  echo "layer_check: files outside the rooms of src/shm: ${loose}" >&2
  status=1
fi
if ((status == 0)); then
  echo "layer_check: every include in src/shm goes down or stays in its room"
fi
exit "${status}"
