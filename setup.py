"""Builds the Python package tdshm with the repository's CMake project, for `pip install .`.

pyproject.toml holds the metadata; this file adds the version (from CMakeLists.txt), the package
(python/tdshm/) and a build_ext that configures CMake in a temporary folder, builds the target
tdshm_python and copies the module tdshm._C where setuptools packs it into the wheel.
See docs/python-install.md.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cmake_project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*tdshm\s[^)]*\bVERSION\s+([0-9]+(?:\.[0-9]+)*)", text)
    if not match:
        sys.exit("setup.py: no `project(tdshm VERSION ...)` in CMakeLists.txt")
    return match.group(1)


class CMakeExtension(Extension):
    """An extension made by a CMake target rather than by setuptools' compiler."""

    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        prebuilt = os.environ.get("TDSHM_PREBUILT_MODULE")
        if prebuilt:
            # A module this checkout's CMake build made already (tools/dev.sh test passes build/'s,
            # so that its pip test checks the packaging without compiling everything again).
            module = Path(prebuilt)
            if not module.is_file() or not module.name.startswith("_C"):
                sys.exit(f"setup.py: TDSHM_PREBUILT_MODULE={prebuilt} is not a built tdshm/_C module")
            print(f"setup.py: packaging the prebuilt module {module}", flush=True)
            self._install_module(module, ext)
            return
        cmake = shutil.which("cmake")
        if cmake is None:
            sys.exit("setup.py: cmake not found (Debian: apt-get install cmake)")
        # CMake would find this out too, but later and with a less helpful message.
        if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0:
            sys.exit(f"setup.py: {sys.executable} cannot import torch. On Debian install python3-torch and "
                     "make the venv with --system-site-packages, then pip install --no-build-isolation .")

        configure = [cmake, "-S", str(ROOT),
                     "-DCMAKE_BUILD_TYPE=Release",
                     # Built once per install: a unity build parses LibTorch's headers once per
                     # batch of sources, not once per source (about a third of the CPU time).
                     "-DTDSHM_UNITY_BUILD=ON",
                     "-DTDSHM_BUILD_PYTHON=ON",
                     "-DTDSHM_BUILD_TESTS=OFF", "-DTDSHM_BUILD_TOOLS=OFF", "-DTDSHM_BUILD_BENCHMARKS=OFF",
                     # The module must hold the library itself: the build folder is deleted below.
                     "-DBUILD_SHARED_LIBS=OFF",
                     # The interpreter running pip (a venv's): the module is built for it, and
                     # python/CMakeLists.txt checks that it imports torch.
                     f"-DPython_EXECUTABLE={sys.executable}"]
        # CMake reads CMAKE_GENERATOR from the environment itself; without it, Ninja when installed.
        if "CMAKE_GENERATOR" not in os.environ:
            configure += ["-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles"]
        # Without --parallel, `cmake --build` takes CMAKE_BUILD_PARALLEL_LEVEL from the environment.
        parallel = ["--parallel", str(self.parallel)] if self.parallel else []

        # A fresh folder every time: nothing in the source tree, and no stale cache from another
        # interpreter or venv.
        with tempfile.TemporaryDirectory(prefix="tdshm-cmake-") as tmp:
            build = [cmake, "--build", tmp, "--target", ext.target] + parallel
            for command in (configure + ["-B", tmp], build):
                print("setup.py:", " ".join(command), flush=True)
                subprocess.run(command, check=True)
            built = sorted((Path(tmp) / "python" / "tdshm").glob("_C*.so"))
            if len(built) != 1:
                sys.exit(f"setup.py: expected one tdshm/_C*.so in the build folder, found {built}")
            self._install_module(built[0], ext)

    def _install_module(self, module, ext):
        # Under the name setuptools expects for this interpreter (its EXT_SUFFIX).
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(module, target)  # with its mode bits


setup(
    version=cmake_project_version(),
    packages=["tdshm"],
    package_dir={"tdshm": "python/tdshm"},
    ext_modules=[CMakeExtension("tdshm._C", target="tdshm_python")],
    cmdclass={"build_ext": CMakeBuild},
)
