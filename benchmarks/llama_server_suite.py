"""llama.cpp's own HTTP server tests against `shardwire serve`, through llama_server_shim.py.

    python -m benchmarks.llama_server_suite                     # DEFAULT_SELECTION: 9 files, 183 tests
    python -m benchmarks.llama_server_suite unit/test_tokenize.py unit/test_completion.py -k probs

Runs pytest in the suite's folder with the shim as the server binary (LLAMA_SERVER_BIN_PATH), one
server per test as the suite starts them, each test bounded by --test-timeout and the whole run
by --time-limit; then prints pass/fail/skip counts and every failure under its cause. The tests
come from the llama-cpp-python sdist that benchmarks/build_llama_cpp.sh unpacks (MIT; nothing of
them is copied here).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .llama_server_causes import cause_of

HERE = Path(__file__).resolve().parent
SHIM = HERE / "llama_server_shim.py"
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
DEFAULT_SELECTION = (
    "unit/test_basic.py",
    "unit/test_tokenize.py",
    "unit/test_completion.py",
    "unit/test_chat_completion.py",
    "unit/test_ctx_shift.py",
    "unit/test_security.py",
    "unit/test_metrics.py",
    "unit/test_ignore_eos.py",
    "unit/test_template.py",
)


def tests_dir() -> Path:
    """Where build_llama_cpp.sh leaves the suite: $LLAMA_CPP_CACHE (default
    ~/.cache/shardwire/llama.cpp)/src/llama_cpp_python-VERSION/vendor/llama.cpp/tools/server/tests."""
    if os.environ.get("LLAMA_SERVER_TESTS"):
        return Path(os.environ["LLAMA_SERVER_TESTS"])
    cache = os.environ.get("LLAMA_CPP_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "shardwire", "llama.cpp"
    )
    return Path(cache, "src", f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp", "tools", "server", "tests")


@dataclass
class Result:
    test: str  # file::name[params]
    outcome: str  # passed, failed, skipped
    message: str = ""

    @property
    def cause(self) -> str:
        return cause_of(self.test, self.message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    selection: list[str],
    *,
    folder: Path,
    extra: list[str] = (),
    time_limit: float = 1800,
    test_timeout: int = 120,
    keep_report: Path | None = None,
) -> tuple[list[Result], str]:
    """Run the selection under pytest; returns each test's result and pytest's output."""
    with tempfile.TemporaryDirectory(prefix="llama-server-suite-") as scratch:
        report = keep_report or Path(scratch) / "report.xml"
        env = {
            **os.environ,
            "LLAMA_SERVER_BIN_PATH": str(SHIM),
            "SHARDWIRE_PYTHON": sys.executable,
            "PORT": str(_free_port()),
            "LLAMA_SUITE_TEST_TIMEOUT": str(test_timeout),
            "PYTHONPATH": os.pathsep.join([str(folder), str(HERE), os.environ.get("PYTHONPATH", "")]),
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the unpacked sdist
        }
        cmd = [
            sys.executable, "-m", "pytest", *selection,
            "-p", "llama_server_pytest_plugin", "-p", "no:cacheprovider",
            f"--confcutdir={folder / 'unit'}",  # not the suite's conftest.py (see the plugin)
            "-m", "not slow", "-q", "-o", "junit_family=xunit1", f"--junitxml={report}", *extra,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                cmd,
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=time_limit,
            )
            output = done.stdout
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\n--time-limit {time_limit:.0f} s reached: the run was stopped\n"
        results = read_report(report) if report.is_file() else []
    return results, output


def read_report(path: Path) -> list[Result]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "") + "\n" + (child.text or "")
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        out.append(Result(name, outcome, message))
    return out


def summary(results: list[Result]) -> str:
    counts = {k: sum(r.outcome == k for r in results) for k in ("passed", "failed", "skipped")}
    lines = [
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped ({len(results)} tests)"
    ]
    by_cause: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if r.outcome == "failed":
            by_cause[r.cause].append(r.test)
    for cause, tests in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"\n{len(tests):3d}  {cause}")
        lines += [f"       {t}" for t in tests]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="test files or ids, relative to the suite's folder (default: a selection)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--tests-dir", type=Path, default=None, help=f"the suite's folder (default: {tests_dir()})")
    p.add_argument("--time-limit", type=float, default=1800, help="seconds for the whole run (default: %(default)s)")
    p.add_argument("--test-timeout", type=int, default=120, help="seconds per test (default: %(default)s)")
    p.add_argument("--log", type=Path, default=None, help="write pytest's whole output here")
    p.add_argument("--report", type=Path, default=None, help="keep pytest's JUnit XML report here")
    p.add_argument("--summarize", type=Path, default=None, help="only summarize a report kept by --report")
    args = p.parse_args(argv)
    if args.summarize:
        print(summary(read_report(args.summarize)))
        return 0
    folder = args.tests_dir or tests_dir()
    if not (folder / "utils.py").is_file():
        print(
            f"llama.cpp's server tests are not at {folder}\n"
            "they come with the llama-cpp-python sdist: `bash benchmarks/build_llama_cpp.sh` downloads and unpacks it "
            "(or set LLAMA_SERVER_TESTS / --tests-dir to a llama.cpp checkout's tools/server/tests)",
            file=sys.stderr,
        )
        return 2
    extra = ["-k", args.k] if args.k else []
    started = time.monotonic()
    results, output = run(
        list(args.files) or list(DEFAULT_SELECTION),
        folder=folder,
        extra=extra,
        time_limit=args.time_limit,
        test_timeout=args.test_timeout,
        keep_report=args.report.resolve() if args.report else None,
    )
    if args.log:
        args.log.write_text(output)
    if not results:
        print(output[-4000:])
        print("no results: pytest did not run", file=sys.stderr)
        return 2
    print(f"llama.cpp server tests in {folder}, {time.monotonic() - started:.0f} s")
    print(summary(results))
    return 0 if all(r.outcome != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
