#!/usr/bin/env bash
# `pip install .` as a user does it (docs/python-install.md), from a clean copy of this checkout:
# the files git tracks, as they are in the working tree (so the test checks what is being
# changed, and fails if a file the build needs is not tracked). A venv with
# --system-site-packages (Debian's torch), pip install --no-build-isolation --no-index, then
# two ranks started with the venv's python from a folder outside the source tree send and
# receive tensors over the "shm" backend with the installed package; then pip uninstall.
# Everything it makes lives in one temporary folder, removed at exit (not when SIGKILL ends it,
# as ctest's timeout does).
#
#   tests/python/pip_install.sh <python3 with torch> <source dir> [<built module>]
#
# With <built module> (a tdshm/_C*.so this checkout's build made: what tools/dev.sh test passes)
# setup.py packages that module instead of compiling the library again (TDSHM_PREBUILT_MODULE):
# the packaging, the install, the import from outside the tree and the uninstall are checked in
# seconds. Without it, pip compiles everything as a user's `pip install .` does (CI runs that).
#
# Exit code 77 (skipped): no git checkout, or the interpreter lacks torch, venv
# (Debian: python3-venv), setuptools or wheel.
set -euo pipefail
python=$1
src=$(cd "$2" && pwd)
prebuilt=${3:-}
if [[ -n "$prebuilt" ]]; then
  [[ -f "$prebuilt" ]] || { echo "no built module $prebuilt"; exit 1; }
  prebuilt=$(cd "$(dirname "$prebuilt")" && pwd)/$(basename "$prebuilt")
fi

skip() {
  echo "skipped: $*"
  exit 77
}
command -v git >/dev/null || skip "git not found"
git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1 || skip "$src is not a git checkout"
"$python" -c "import torch" 2>/dev/null || skip "$python cannot import torch"
# Debian ships venv's ensurepip in python3-venv; without it `python3 -m venv` fails.
"$python" -c "import venv, ensurepip" 2>/dev/null || skip "$python has no venv with ensurepip (Debian: python3-venv)"
"$python" -c "import setuptools, wheel" 2>/dev/null || skip "$python lacks setuptools or wheel (the build backend)"

work=$(mktemp -d "${TMPDIR:-/tmp}/tdshm-pip-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== copy of the tracked files of $src"
mkdir "$work/src"
# A tracked file deleted in the working tree is left out, as a commit of the tree would.
git -C "$src" ls-files -z |
  while IFS= read -r -d '' f; do
    if [[ -e "$src/$f" || -L "$src/$f" ]]; then printf '%s\0' "$f"; fi
  done |
  tar -C "$src" --null -T - -cf - | tar -C "$work/src" -xf -

echo "== venv"
"$python" -m venv --system-site-packages "$work/venv"
venv_python=$work/venv/bin/python
# The installed package only, whatever the caller's environment holds.
unset PYTHONPATH
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

echo "== pip install --no-build-isolation --no-index ."
# pip's and setup.py's temporary folders (the CMake build) inside ours too.
mkdir "$work/tmp"
start=$(date +%s)
(cd "$work/src" && TMPDIR=$work/tmp CMAKE_BUILD_PARALLEL_LEVEL=2 TDSHM_PREBUILT_MODULE=$prebuilt \
  "$venv_python" -m pip install --no-build-isolation --no-index --no-cache-dir .)
echo "pip install took $(($(date +%s) - start)) s"

echo "== two ranks with the installed package"
mkdir "$work/run"
cat >"$work/run/ranks.py" <<'EOF'
"""Two ranks over "shm" with the installed tdshm: ranks.py <venv> (driver), ranks.py <rank> <init> <dir>."""
import os
import subprocess
import sys
import time
from datetime import timedelta


def rank_main(rank, init_method, outdir):
    import importlib.metadata

    import torch
    import torch.distributed as dist

    import tdshm

    if rank == 0:
        print("tdshm", tdshm.__version__, "from", tdshm.__file__, flush=True)
    # The package's version (read from CMakeLists.txt) is the module's.
    assert importlib.metadata.version("tdshm") == tdshm.__version__, importlib.metadata.version("tdshm")
    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, tdshm.ProcessGroupShm), type(pg)
    if rank == 0:
        with open(os.path.join(outdir, "segment"), "w") as f:
            f.write(pg.segment_name)
    ping = torch.arange(12, dtype=torch.float64).reshape(3, 4) * 1.5
    pong = torch.arange(1000, dtype=torch.int64) - 7
    if rank == 0:
        dist.send(ping, dst=1)
        got = torch.zeros_like(pong)
        dist.recv(got, src=1)
        assert torch.equal(got, pong), got
    else:
        got = torch.zeros_like(ping)
        dist.recv(got, src=0)
        assert torch.equal(got, ping), got
        dist.send(pong, dst=0)
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def driver(venv):
    import tdshm

    where = os.path.realpath(tdshm.__file__)
    if not where.startswith(os.path.realpath(venv) + os.sep):
        sys.exit(f"tdshm imported from {where}, not from the venv {venv}")
    outdir = os.path.dirname(os.path.abspath(__file__))
    init = "file://" + os.path.join(outdir, "rendezvous")
    ranks = [subprocess.Popen([sys.executable, __file__, str(r), init, outdir]) for r in (0, 1)]
    deadline = time.monotonic() + 120
    failed = False
    for r, p in enumerate(ranks):
        try:
            code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "still running after 120 s"
        if code != 0:
            print(f"rank {r}: {code}", flush=True)
            failed = True
    for p in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()
    if not failed:
        # The last rank to leave removed the group's segment and its lock file.
        with open(os.path.join(outdir, "segment")) as f:
            name = f.read()
        left = [p for p in (f"/dev/shm/tdshm.{name}", f"/dev/shm/tdshm.{name}.lock") if os.path.exists(p)]
        if left:
            print("left in /dev/shm:", left, flush=True)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if len(sys.argv) == 2:
        driver(sys.argv[1])
    else:
        rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
EOF
# From a folder outside the source tree, so that the import is the installed package.
(cd "$work/run" && "$venv_python" ranks.py "$work/venv")

echo "== pip uninstall"
"$venv_python" -m pip uninstall -y tdshm
if (cd "$work/run" && "$venv_python" -c "import tdshm" 2>/dev/null); then
  echo "tdshm still imports after pip uninstall"
  exit 1
fi
echo "pip install test ok"
