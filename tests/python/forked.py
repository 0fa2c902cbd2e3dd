"""Ranks as forked children of a Python test that has already imported torch.

A fresh python3 spends about a second of CPU on ``import torch``; a child forked from the test
starts with it loaded (as torch.multiprocessing's "fork" start does). Used by
test_shm_backend.py, run_peer_selftest.py and zygote.py.
"""

import os
import signal
import sys
import time
import traceback


def start(fn, args, log):
    """Forks a child that runs ``fn(*args)`` with stdout and stderr into the file ``log``
    (run_and_exit). Returns the pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        run_and_exit(fn, args, log)
    return pid


def run_and_exit(fn, args, log):
    """In a fresh child: stdout and stderr into the file ``log`` (or, when it is empty, stdout
    onto stderr), then ``fn(*args)``. Exits with fn's int result (0 for None), SystemExit's
    code, or 1 when fn raised (its traceback on stderr). Never returns."""
    code = 1
    try:
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        else:
            os.dup2(2, 1)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        result = fn(*args)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001: whatever the rank raised ends it with 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_all(pids, timeout):
    """Waits for every pid for at most ``timeout`` seconds in all, then SIGKILLs those still running.
    Returns one status per pid, as subprocess reports them (an exit code, or -signal), and whether
    any had to be killed."""
    deadline = time.monotonic() + timeout
    status = {}
    killed = False
    while len(status) < len(pids):
        for pid in pids:
            if pid in status:
                continue
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(raw)
        if len(status) == len(pids):
            break
        if time.monotonic() >= deadline:
            for pid in pids:
                if pid not in status:
                    os.kill(pid, signal.SIGKILL)
                    status[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    killed = True
            break
        time.sleep(0.005)
    return [status[pid] for pid in pids], killed
