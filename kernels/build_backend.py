"""shardwire's build: its CPU kernels (ggml_source.py's ggml, built with cmake for this machine's
CPU, as llama.cpp builds by default) into shardwire/_ggml, then setuptools for the package around
them. So `pip install .`, `pip install -e .` and `python -m build` all give the kernels that
shardwire's figures were measured with.

Where they cannot be built (no compiler, no cmake, the sources cannot be downloaded, a platform
ggml does not build on) the install still succeeds: shardwire/_ggml then holds only NOT_BUILT,
which says why, and shardwire computes on PyTorch's kernels and says so at every start.

A build is kept in shardwire/_ggml with its key (the kernels' sources, this machine's CPU and
compiler settings): installing the same tree again rebuilds only what changed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import cpu_probe
import ggml_source
from setuptools import build_meta as setuptools_build

HERE = Path(__file__).resolve().parent
KERNELS = Path("shardwire", "_ggml")  # in the tree being built
BUILD, NOT_BUILT = "BUILD", "NOT_BUILT"
CMAKE_MINIMUM = (3, 21)  # ggml-python's CMakeLists


class BuildFailed(Exception):
    pass


def _version(tool: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ()
    words = out.split()
    digits = next((w for w in words if w[:1].isdigit()), "")
    return tuple(int(p) for p in digits.split(".")[:2] if p.isdigit())


def _tools() -> list[str]:
    """What the build needs from the package index beyond setuptools: pip and scikit-build-core to
    fetch the sdists (pip reads their metadata), cmake and ninja where this machine lacks them."""
    needs = ["pip", "scikit-build-core>=0.10"]
    if _version("cmake") < CMAKE_MINIMUM:
        needs.append("cmake>=%d.%d" % CMAKE_MINIMUM)
    if not shutil.which("ninja") and not shutil.which("make"):
        needs.append("ninja")
    return needs


def _cpu() -> str:
    """What the compiler's -march=native sees: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _key() -> str:
    """The build's inputs: change any and the kernels are built again."""
    h = hashlib.sha256()
    for path in sorted(HERE.iterdir()):
        if path.suffix in (".py", ".cpp"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (
        sys.platform,
        platform.machine(),
        _cpu(),
        *(os.environ.get(v, "") for v in ("CC", "CXX", "CMAKE_ARGS")),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _run(command: list, what: str) -> None:
    print(f"shardwire kernels: {what}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    except OSError as e:
        raise BuildFailed(f"{what}: {command[0]} could not run ({e})") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise BuildFailed(f"{what}: {command[0]} exited with {done.returncode}:\n{tail}")


def _check_compilers() -> None:
    """Fail before any download where no compiler would build the kernels."""
    for language, variable, names in (("C", "CC", ("cc", "gcc", "clang")), ("C++", "CXX", ("c++", "g++", "clang++"))):
        chosen = os.environ.get(variable)
        if chosen and not shutil.which(shlex.split(chosen)[0]):
            raise BuildFailed(f"{variable}={chosen} is not a {language} compiler found on PATH")
        if not chosen and not any(shutil.which(n) for n in names):
            raise BuildFailed(f"no {language} compiler found ({', '.join(names)})")


def _built(work: Path, key: str) -> Path:
    """The bindings and ggml's libraries, built in `work`: the folder to put at KERNELS."""
    _check_compilers()
    source = ggml_source.prepared_source(work)
    build, stage = work / "build", work / "stage"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    unusable = " ".join(cpu_probe.unusable_flags())  # what this CPU lists and cannot run
    flags = [f"-DCMAKE_C_FLAGS={unusable}", f"-DCMAKE_CXX_FLAGS={unusable}"] if unusable else []
    configure = [
        "cmake", "-S", source, "-B", build, *generator,
        "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={stage}",
        "-DGGML_NATIVE=ON", "-DGGML_LLAMAFILE=ON",  # as shardwire's figures were measured
        "-DSKBUILD_STATE=wheel", f"-DSKBUILD_PLATLIB_DIR={stage}",  # where ggml-python's rules install
        "-DSKBUILD_PROJECT_NAME=ggml_python", f"-DSKBUILD_PROJECT_VERSION={ggml_source.BINDINGS[1]}",
        *flags, *shlex.split(os.environ.get("CMAKE_ARGS", "")),
    ]  # fmt: skip
    _run(configure, "configuring ggml (cmake)")
    _run(["cmake", "--build", build, "--parallel", str(os.cpu_count() or 1)], "compiling ggml")
    _run(["cmake", "--install", build], "installing ggml's libraries")
    package = stage / "ggml"
    if not any((package / "lib").glob("*ggml*")):
        raise BuildFailed(f"the build left no ggml library in {package / 'lib'}")
    for name in ("__init__.py", "ggml.py"):
        shutil.copy2(source / "ggml" / name, package / name)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpu().splitlines() if line.startswith(("flags", "Features"))), ""
    )
    (package / BUILD).write_text(f"{key}\nggml-python {ggml_source.LOCAL_VERSION}\ncpu flags: {cpu}\n")
    return package


def build_kernels(root: Path) -> None:
    """The kernels at root/KERNELS, built unless a build of the same key is there; NOT_BUILT there
    instead, saying why, where they cannot be built."""
    target, key = root / KERNELS, _key()
    kept = target / BUILD
    if kept.is_file() and kept.read_text().split("\n", 1)[0] == key:
        print(f"shardwire kernels: kept from an earlier build in {target}", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory(prefix="shardwire-kernels-") as work:
        try:
            built = _built(Path(work), key)
            reason = None
        except Exception as e:  # noqa: BLE001 (whatever stops the kernels, the install goes on without them)
            built, reason = None, str(e)
        shutil.rmtree(target, ignore_errors=True)
        if built is not None:
            shutil.copytree(built, target)
            return
    target.mkdir(parents=True)
    (target / NOT_BUILT).write_text(reason + "\n")
    print(f"shardwire kernels: NOT BUILT, shardwire will compute on PyTorch's kernels: {reason}", file=sys.stderr)


# PEP 517: setuptools builds the package; the kernels are built first into the tree it packs.


def get_requires_for_build_wheel(config_settings=None):
    return setuptools_build.get_requires_for_build_wheel(config_settings) + _tools()


def get_requires_for_build_editable(config_settings=None):
    return setuptools_build.get_requires_for_build_editable(config_settings) + _tools()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    build_kernels(Path.cwd())
    return setuptools_build.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    build_kernels(Path.cwd())
    return setuptools_build.build_editable(wheel_directory, config_settings, metadata_directory)


get_requires_for_build_sdist = setuptools_build.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = setuptools_build.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = setuptools_build.prepare_metadata_for_build_editable
build_sdist = setuptools_build.build_sdist
