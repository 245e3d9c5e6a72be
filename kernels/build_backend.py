"""Builds ggml-python 0.0.45 (the bindings shardwire's `cpu` extra pins) with the ggml that
llama.cpp's release 0.3.36 ships instead of the one the bindings vendor: the same C API, and the
kernels llama.cpp computes with today (its tiled K-quant products read a prompt chunk of stored
Q4_K-Q6_K weights about twice as fast as the older ggml's). Both sources are the sdists on PyPI,
checked against the hashes below; the build itself is ggml-python's (scikit-build-core, cmake).

The wheel is ggml-python 0.0.45+llamacpp.0.3.36, so it satisfies `ggml-python==0.0.45`:
`pip install -e '.[cpu]' ./kernels` installs shardwire with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import scikit_build_core.build as scikit_build

BINDINGS = ("ggml-python", "0.0.45", "10aac52075cf3c7ef2b00d6c35b1c23f7b018dbeff8ae8df67339b4be1166f05")
LLAMA_CPP = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
LOCAL_VERSION = f"{BINDINGS[1]}+llamacpp.{LLAMA_CPP[1]}"
GGML_PARTS = ("CMakeLists.txt", "cmake", "include", "src")  # the rest of the vendored folder stays


def _sdist(name: str, version: str, sha256: str, into: Path) -> Path:
    """The sdist of name==version from the package index pip is configured with; pip checks its
    hash before it reads anything in it."""
    pinned = into / f"{name}.txt"
    into.mkdir(parents=True, exist_ok=True)
    pinned.write_text(f"{name}=={version} --hash=sha256:{sha256}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
         "--quiet", "-d", str(into), "-r", str(pinned)],
        check=True,
        env={k: v for k, v in os.environ.items() if "BACKEND_PATH" not in k},  # this hook's, not the sdist's
    )  # fmt: skip
    return into / f"{name.replace('-', '_')}-{version}.tar.gz"


def _extract(archive: Path, into: Path, under: str = "") -> Path:
    """The sdist's top folder, extracted (only `under` within it where given)."""
    with tarfile.open(archive) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        prefix = f"{top}/{under}".rstrip("/")
        members = [m for m in tar.getmembers() if m.name == prefix or m.name.startswith(prefix + "/")]
        tar.extractall(into, members=members, filter="data")
    return into / top


def _prepared_source(work: Path) -> Path:
    """ggml-python's source tree with llama.cpp's ggml in place of its vendored one."""
    downloads = work / "sdists"
    bindings = _extract(_sdist(*BINDINGS, downloads), work)
    llama_cpp = _extract(_sdist(*LLAMA_CPP, downloads), work, "vendor/llama.cpp/ggml")
    vendored, newer = bindings / "vendor" / "ggml", llama_cpp / "vendor" / "llama.cpp" / "ggml"
    for part in GGML_PARTS:
        target = vendored / part
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        (shutil.copytree if (newer / part).is_dir() else shutil.copy2)(newer / part, target)
    init = bindings / "ggml" / "__init__.py"
    text = init.read_text()
    if f'__version__ = "{BINDINGS[1]}"' not in text:
        raise RuntimeError(f"{init}: no version line {BINDINGS[1]!r} to mark")
    init.write_text(text.replace(f'__version__ = "{BINDINGS[1]}"', f'__version__ = "{LOCAL_VERSION}"'))
    return bindings


def get_requires_for_build_wheel(config_settings=None):
    return scikit_build.get_requires_for_build_wheel(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = os.path.abspath(wheel_directory)
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="shardwire-kernels-") as work:
        os.chdir(_prepared_source(Path(work)))
        try:
            return scikit_build.build_wheel(wheel_directory, config_settings)
        finally:
            os.chdir(here)
