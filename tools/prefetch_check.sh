#!/usr/bin/env bash
# Whether the waiting receiver's prefetch is in the built code: the lock-free check that every
# point-to-point wait spins on (ShmChannel::incoming_hint, which inlines RingConsumer::ready_hint)
# must hold a prefetch instruction. A compiler may drop a prefetch it sees no use for (GCC 12
# removed a loop of __builtin_prefetch there; src/shm/parts/ring.h), and no other test would see
# that: messages still arrive, one round of line transfers later. Run by the test suite (ctest
# prefetch_check, optimized builds) on the tdshm tool; skipped (77) where the machine is not x86-64.
#
#   tools/prefetch_check.sh BINARY
set -euo pipefail
binary="${1:?usage: tools/prefetch_check.sh BINARY}"
symbol="_ZNK5tdshm6detail10ShmChannel13incoming_hintEv"
if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "prefetch_check: skipped on $(uname -m) (checks x86-64 code)"
  exit 77
fi
code="$(objdump -d --no-show-raw-insn "--disassemble=${symbol}" "${binary}")"
if ! grep -q "<${symbol}>:" <<<"${code}"; then
  echo "prefetch_check: ${binary} has no ${symbol} (renamed? update this check)" >&2
  exit 1
fi
if ! grep -q "prefetcht0" <<<"${code}"; then
  echo "prefetch_check: ShmChannel::incoming_hint in ${binary} holds no prefetcht0: the compiler" >&2
  echo "dropped the waiting receiver's prefetch (RingView::prefetch_after, src/shm/parts/ring.h)" >&2
  exit 1
fi
echo "prefetch_check: ShmChannel::incoming_hint prefetches ($(grep -c prefetcht0 <<<"${code}") instruction(s))"
