"""What the README tells a new user to run is what CI runs, and llama.cpp is the build it prescribes."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_ONLY_INSTALL_FLAGS = ("-q", "--no-cache-dir")  # quiet, and a build from nothing: CI plays a new machine


def readme_commands() -> list[str]:
    """The commands of the README's first code block, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def ci_command(program: str, ci_only: tuple[str, ...] = ()) -> str:
    """The line of .ci/run that runs ``program`` (after any VAR=value), less the flags only CI adds."""
    lines = (ROOT / ".ci/run").read_text().splitlines()
    line = next(line for line in lines if re.match(rf"(\S+=\S+ )*{program} ", line))
    return " ".join(word for word in line.split() if word not in ci_only)


def test_ci_installs_and_tests_as_the_readme_says():
    install, _run, test = readme_commands()
    assert ci_command("pip", CI_ONLY_INSTALL_FLAGS) == install
    assert ci_command("python -m pytest") == test
    assert "-c constraints.txt" in install and "-DGGML_NATIVE=OFF" in install


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the build flags are x86-64's")
def test_llama_cpp_is_built_for_every_avx2_cpu():
    """-DGGML_NATIVE=OFF: AVX2, FMA and F16C kernels, none of AVX-512's or AMX's, whatever machine built it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    features = dict(re.findall(r"(\w+) = (\d)", llama_cpp.llama_print_system_info().decode()))
    assert {name: features.get(name) for name in ("AVX2", "FMA", "F16C")} == {"AVX2": "1", "FMA": "1", "F16C": "1"}
    assert not [name for name, on in features.items() if on == "1" and name.startswith(("AVX512", "AMX"))], features
