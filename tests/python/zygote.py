#!/usr/bin/env python3
"""Starts the Python ranks of the C++ tests from one warm interpreter.

A fresh python3 spends about a second of CPU on ``import torch`` before a rank does anything,
and the interop and mixed-world tests start a hundred such ranks. This process imports torch,
torch.distributed and numpy once, then forks one child per rank on request: the child runs a
script as ``__main__`` with the modules already loaded.

Protocol (the C++ side is tests/dist/python_launcher.cpp), one JSON object per line:
  stdin:  {"script": path, "args": [...], "env": {name: value}, "log": path or ""}
  stdout: "ready" once the imports are done; then, per request, the child's pid, or
          "error <text>" when the request could not be started.
The child's parent is the test process, not this one: it is forked through a short-lived
middle process whose exit hands it to the nearest child subreaper (the test process sets
PR_SET_CHILD_SUBREAPER), so the test waits for it and kills it like any child of its own. This
process ends at end of input (the test process closed the pipe or died).
"""

import json
import os
import runpy
import sys

import forked
import numpy  # noqa: F401  (imported once for every child)
import torch  # noqa: F401
import torch.distributed  # noqa: F401


def run_script(request):
    """In the rank's process: its environment, sys.argv and sys.path, then the script as __main__."""
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script] + list(request["args"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # PYTHONPATH is read at interpreter start: the rank's own entries go in as it would.
    for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    runpy.run_path(script, run_name="__main__")


def spawn(request, reply_fd):
    """Forks the rank through a middle process; returns the rank's pid."""
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(pid_r)
        try:
            rank = os.fork()
            if rank == 0:
                for fd in (pid_w, reply_fd, 0):
                    os.close(fd)
                forked.run_and_exit(run_script, (request,), request.get("log") or "")
            os.write(pid_w, f"{rank}\n".encode())
        finally:
            os._exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as r:
        text = r.read().decode().strip()
    os.waitpid(middle, 0)
    if not text:
        raise RuntimeError("the middle process could not fork")
    return int(text)


def main():
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # nothing but replies on the reply pipe
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    os.write(reply_fd, b"ready\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = str(spawn(json.loads(line), reply_fd))
        except Exception as e:  # noqa: BLE001: reported to the test, which fails with it
            reply = "error " + f"{type(e).__name__}: {e}".replace("\n", " ")
        os.write(reply_fd, (reply + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
