#!/bin/sh
# `tdshm bench` (the size sweep) stopped by SIGTERM while its ranks run ends by that signal and
# leaves none of its segments or lock files in /dev/shm. (SIGINT and SIGHUP take the same handler,
# but a background job of a non-interactive shell starts with SIGINT ignored, and a test runner
# may ignore SIGHUP: an ignored signal is left ignored.)
#   tests/tools/bench_signal.sh <tdshm>
set -u
tdshm=$1
for sig in TERM; do
  "$tdshm" bench --sizes 8 --transports spin,shm --iters 200000000 >/dev/null 2>&1 &
  pid=$!
  i=0
  while [ $i -lt 200 ] && ! ls /dev/shm/tdshm.tdshm-bench-$pid-* >/dev/null 2>&1; do
    sleep 0.05
    i=$((i + 1))
  done
  if ! ls /dev/shm/tdshm.tdshm-bench-$pid-* >/dev/null 2>&1; then
    echo "SIG$sig: no segment of bench pid $pid appeared within 10 s"
    kill -9 $pid 2>/dev/null
    exit 1
  fi
  kill -$sig $pid
  wait $pid
  status=$?
  # The rank forked by it dies with it (PR_SET_PDEATHSIG); give the kernel a moment.
  i=0
  while [ $i -lt 100 ] && pgrep -f "iters 200000000" >/dev/null 2>&1; do sleep 0.05; i=$((i + 1)); done
  left=$(ls /dev/shm 2>/dev/null | grep "^tdshm\.tdshm-bench-$pid-" || true)
  if [ -n "$left" ]; then
    echo "SIG$sig: left in /dev/shm: $left"
    exit 1
  fi
  if [ $status -lt 128 ]; then
    echo "SIG$sig: bench exited with $status, not by the signal"
    exit 1
  fi
  echo "SIG$sig: ended with status $status, nothing left in /dev/shm"
done
echo "bench signal cleanup ok"
