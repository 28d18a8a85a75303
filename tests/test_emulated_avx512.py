"""The AVX-512 and AVX512-VNNI tiles' code run on any machine with AVX2: the C kernels built again with their AVX-512
intrinsics supplied by SIMDe (Debian's ``libsimde-dev``, header-only; tests/emulated/avx512_from_simde.h adds the
few it lacks), loaded in place of the installed library (``EXACTSPEC_FUSED_LIBRARY``), and held to the installed
library's bits: every weight format's products and the attention, rows alone and in passes of 2 to 70 (the VNNI row
tiles' groups of up to 6 rows, the GEMM tiles' of up to 12 by 16 outputs), the same digest as this CPU's own tiles
(tests/test_cpu_paths.py's). So a developer without AVX-512 runs the tiles an AVX-512 CPU takes, and a wrong lane
there fails here, not only where CI has AVX-512. Skipped, saying what to install, where SIMDe or gcc is missing."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_cpu_paths import KERNEL_DIGEST, run_here

from exactspec.backends import native

KERNELS = Path(native.__file__).parent / "fused"
SHIM = Path(__file__).parent / "emulated" / "avx512_from_simde.h"
SIMDE = Path("/usr/include/simde/x86/avx512.h")
FLAGS = ["-O2", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-fPIC", "-mavx2", "-mfma", "-mf16c",
         "-DEXACTSPEC_EMULATED", "-include", str(SHIM)]


def build(folder: Path) -> Path:
    """The kernels with AVX-512 emulated, as a shared library in ``folder``."""
    def compile_one(source: Path) -> Path:
        target = folder / f"{source.stem}.o"
        subprocess.run(["gcc", *FLAGS, "-c", str(source), "-o", str(target)], check=True, capture_output=True)
        return target

    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(compile_one, sorted(KERNELS.glob("*.c"))))
    library = folder / "_fused_emulated.so"
    subprocess.run(["gcc", "-shared", *map(str, objects), "-lpthread", "-lm", "-o", str(library)], check=True,
                   capture_output=True)
    return library


@pytest.mark.slow
def test_the_avx512_and_vnni_tiles_emulated_give_this_cpus_bits(tmp_path):
    if native.unavailable():
        pytest.skip(native.unavailable())
    if shutil.which("gcc") is None or not SIMDE.is_file():
        pytest.skip("needs gcc and SIMDe's headers (apt-get install libsimde-dev)")
    library = build(tmp_path)
    emulated = {"EXACTSPEC_FUSED_LIBRARY": str(library)}
    path = run_here(["-c", "from exactspec.backends import native; print(native.integer_peak(1, 0.01).instruction)"],
                    emulated, 120)
    assert path.stdout.strip() == "vpdpbusd (AVX512-VNNI)", path.stdout + path.stderr[-1000:]  # its tiles are taken
    runs = [run_here(["-c", KERNEL_DIGEST], env, 900) for env in ({}, emulated)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    own, vnni = (run.stdout.split() for run in runs)
    assert vnni == own and own[1:] == ["True"] * 3, (own, vnni)
