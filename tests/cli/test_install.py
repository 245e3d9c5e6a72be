"""The install and the path it gives: the package's own build makes ggml's kernels (or says why
not and still installs), and every start names the kernels that compute, with a warning where the
fast CPU kernels are missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from shardwire.weights import ggml_cpu
from shardwire.weights.in_use import WITHOUT_KERNELS, compute_line

from paths import REPO
from workers import WorkerProcess

pytestmark = pytest.mark.slow  # worker processes, a wheel built

ROOT = REPO


def _device_lines(worker: WorkerProcess, timeout: float = 30.0) -> list[str]:
    """The worker's lines after the one it listens with, once its devices are listed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line.strip() for line in worker.log if line.startswith("  ")]
        if lines:
            time.sleep(0.2)  # a warning follows the device lines
            return [line.strip() for line in worker.log if line.startswith("  ")]
        time.sleep(0.05)
    raise AssertionError("the worker printed no device line:\n" + "".join(worker.log))


def test_the_install_built_the_kernels_where_this_machine_can_build_them():
    """A machine with compilers and cmake gets ggml's kernels from the plain install."""
    if not (shutil.which("cmake") and shutil.which("c++") and shutil.which("cc")):
        pytest.skip("no compiler or cmake here: the install gives PyTorch's kernels by design")
    if os.environ.get(ggml_cpu.OFF) == "0":
        pytest.skip(f"{ggml_cpu.OFF}=0 turns them off in this run")
    assert ggml_cpu.available(), f"the kernels were not built: {ggml_cpu.MISSING}"
    assert compute_line("cpu").startswith(f"ggml {ggml_cpu.ggml.ggml_version().decode()}")


@pytest.mark.skipif(not ggml_cpu.available(), reason=f"ggml's kernels are not built here: {ggml_cpu.MISSING}")
def test_a_worker_names_its_kernels_at_start(tmp_path):
    with WorkerProcess(tmp_path / "w") as worker:
        lines = _device_lines(worker)
    assert lines[0].startswith("cpu: ") and lines[0].endswith(f"GiB available; {ggml_cpu.describe()}")
    assert not any(line.startswith("warning:") for line in lines)


def test_a_worker_without_the_kernels_says_what_it_loses(tmp_path):
    with WorkerProcess(tmp_path / "w", env={ggml_cpu.OFF: "0"}) as worker:
        lines = _device_lines(worker)
    assert "GiB available; PyTorch " in lines[0] and f"turned off by {ggml_cpu.OFF}=0" in lines[0]
    warning = next(line for line in lines if line.startswith("warning:"))
    assert f"decoded at {WITHOUT_KERNELS} llama.cpp's speed" in warning and f"unset {ggml_cpu.OFF}" in warning


def _source_copy(into: Path) -> Path:
    """This tree's files that an sdist holds, without its built kernels."""
    tree = into / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("_ggml", "__pycache__", "*.egg-info")
    for folder in ("shardwire", "shardwire_kit", "kernels"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    return tree


def _wheel_without_kernels(tmp_path: Path, **env: str) -> tuple[Path, str]:
    """A wheel of this tree built with `env`, which stops the kernels' build: it and why not."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist"]
        + [_source_copy(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("shardwire-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # no libraries in it
    with zipfile.ZipFile(wheel) as z:
        assert not any("/_ggml/lib/" in n for n in z.namelist())
        return wheel, z.read("shardwire/_ggml/NOT_BUILT").decode()


def test_an_install_without_a_compiler_succeeds_and_its_worker_says_why_and_how(tmp_path):
    """No C++ compiler: the wheel still builds (pure Python, with NOT_BUILT saying why) and its
    worker computes on PyTorch, warning with the reason, the measured ratio and the pip command."""
    wheel, reason = _wheel_without_kernels(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert "no-such-c++ is not a C++ compiler" in reason

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel], check=True, timeout=120
    )
    with WorkerProcess(tmp_path / "w", env={"PYTHONPATH": str(target)}, cwd=tmp_path) as worker:
        lines = _device_lines(worker)
    assert "GiB available; PyTorch " in lines[0] and "no-such-c++ is not a C++ compiler" in lines[0]
    warning = next(line for line in lines if line.startswith("warning:"))
    assert f"decoded at {WITHOUT_KERNELS} llama.cpp's speed" in warning and "-m pip install" in warning


def test_an_install_that_cannot_download_the_kernels_sources_succeeds_and_says_so(tmp_path):
    wheel, reason = _wheel_without_kernels(tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_NO_CACHE_DIR="1")
    assert reason.startswith("pip could not download ggml-python==0.0.45: ")


@pytest.mark.skipif(not ggml_cpu.available(), reason=f"ggml's kernels are not built here: {ggml_cpu.MISSING}")
def test_kernels_built_for_another_cpu_are_refused_before_they_run(tmp_path):
    """A wheel carries kernels for the CPU that built it: on a CPU without one of its flags they
    are not loaded (their first such instruction would stop the process), and the start says why."""
    copy = tmp_path / "site" / "shardwire"
    shutil.copytree(ROOT / "shardwire", copy, ignore=shutil.ignore_patterns("__pycache__"))
    build = copy / "_ggml" / "BUILD"
    build.write_text(build.read_text().replace("cpu flags:", "cpu flags: shardwire_imaginary_isa"))
    probe = (
        "from shardwire.weights import ggml_cpu, in_use; print(ggml_cpu.available()); print(in_use.compute_line('cpu'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(copy.parent)),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    available, line = out.stdout.splitlines()
    assert available == "False" and "built on another CPU: this one lacks shardwire_imaginary_isa" in line


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler here")
def test_the_cpu_probe_turns_off_what_does_not_run():
    """What this CPU lists and cannot run (AMX on some hosts) is found by running it once; both
    shardwire's ggml and the llama.cpp it is measured against are built without it then."""
    sys.path.insert(0, str(ROOT / "kernels"))
    import cpu_probe

    assert cpu_probe._runs("int main(void) { return 0; }", [])
    assert not cpu_probe._runs("int main(void) { return 1; }", [])
    assert not cpu_probe._runs("not C at all", [])
    runs = cpu_probe._lists_amx() and cpu_probe._runs(cpu_probe.AMX_PROBE, ["-mamx-tile"])
    assert cpu_probe.unusable_flags() == ([] if runs or not cpu_probe._lists_amx() else cpu_probe.NO_AMX)


def test_a_long_reason_still_fits_the_line_a_worker_sends(monkeypatch):
    """What stopped the build may be a compiler's whole complaint: the start line keeps its first
    line, short enough for DEVICES, and the warning the rest of that line."""
    from shardwire.weights import in_use
    from shardwire.wire.messages import DeviceInfo, Devices

    reason = "cmake exited with 1: " + "x" * 500 + "\n-- Configuring incomplete, errors occurred!"
    monkeypatch.setattr(ggml_cpu, "available", lambda: False)
    monkeypatch.setattr(ggml_cpu, "MISSING", reason)
    line = compute_line("cpu")
    assert line.startswith("PyTorch ") and "cmake exited with 1: xxx" in line and "Configuring" not in line
    sent = Devices("w", "0.1.0", [DeviceInfo("cpu", 1, 2, "float32", False, {}, compute=line)])
    assert Devices.parse(sent.to_wire()).devices[0].compute == line
    assert "cmake exited with 1: xxx" in in_use.missing_kernels_warning()


def test_the_llama_cpp_sdist_is_kept_once_and_reused_only_with_its_pinned_hash(tmp_path, monkeypatch):
    """The build keeps the 76 MB sdist it fetched for the next build and for llama.cpp's converter;
    a kept copy whose bytes are not the pinned ones is not used, and a cache that cannot be written
    keeps nothing without failing the build."""
    sys.path.insert(0, str(ROOT / "kernels"))
    import ggml_source

    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    download = tmp_path / "download.tar.gz"
    download.write_bytes(b"not the pinned sdist")
    ggml_source.keep_sdist(download)
    assert ggml_source.kept_llama_cpp().read_bytes() == download.read_bytes()
    assert ggml_source.kept_sdist() is None  # its hash is not the pinned one: fetched again

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(blocked))
    ggml_source.keep_sdist(download)
    assert ggml_source.kept_sdist() is None
