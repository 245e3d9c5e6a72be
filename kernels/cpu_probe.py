"""Compiler flags that keep -march=native code off instructions this CPU lists but cannot run.

Some hosts (VMs, sandboxes) report AMX and then fault on the first tile instruction: ggml's AMX
matmul (Q4_0/Q8_0 with repacking) dies with SIGILL there. One tile instruction is compiled and run
once; where it does not run, ggml is built without AMX. build_backend.py (shardwire's ggml) and
benchmarks/build_llama_cpp.sh (the llama.cpp it is measured against) both ask here, so that both
make the same choice.

    python3 kernels/cpu_probe.py    # the flags, on one line (empty where none are needed)
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]

AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def _lists_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _runs(source: str, flags: list[str]) -> bool:
    compiler = shutil.which("cc")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory(prefix="shardwire-probe-") as work:
        program, binary = Path(work, "probe.c"), Path(work, "probe")
        program.write_text(source)
        try:
            built = subprocess.run([compiler, "-O1", *flags, str(program), "-o", str(binary)], capture_output=True)
            return built.returncode == 0 and subprocess.run([str(binary)], capture_output=True).returncode == 0
        except OSError:
            return False


def unusable_flags() -> list[str]:
    """The flags that turn off what this CPU lists and cannot run (nothing where all runs)."""
    return NO_AMX if _lists_amx() and not _runs(AMX_PROBE, ["-mamx-tile"]) else []


if __name__ == "__main__":
    print(" ".join(unusable_flags()))
