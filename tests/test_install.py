"""What the README tells a new user to run is what CI runs, and llama.cpp is the build it prescribes."""

from __future__ import annotations

import importlib
import os
import platform
import re
import subprocess
import sys
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


def ci_script(name: str):
    """A module of .ci/ (check_lock, resolve_lock), imported as CI runs it: with .ci/ on the path."""
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / ".ci"))


def test_the_lock_pins_no_local_version_label():
    """PyPI never serves a local version (``+cpu``): a lock with one resolves only where the wheel lies on disk."""
    check_lock = ci_script("check_lock")
    pins = check_lock.locked(ROOT / "constraints.txt")
    assert check_lock.local_pins(pins, "constraints.txt") == []
    assert pins["torch"] == "2.13.0"


def test_check_lock_refuses_a_local_label_and_says_why():
    check_lock = ci_script("check_lock")
    [problem] = check_lock.local_pins({"torch": "2.13.0+cpu", "numpy": "2.4.6"}, "constraints.txt")
    assert "torch==2.13.0+cpu" in problem and "PyPI" in problem and "pin torch==2.13.0" in problem


def test_a_plain_pin_holds_the_local_build_and_nothing_else():
    """The CPU build installed here (2.13.0+cpu) is the locked torch==2.13.0; another release is not."""
    check_lock = ci_script("check_lock")
    pins = {"torch": "2.13.0", "numpy": "2.4.6"}
    installed = {"torch": "2.13.0+cpu", "numpy": "2.4.5", "left-out": "1.0", "pip": "23.2.1"}
    assert check_lock.off_the_lock(pins, installed, "lock") == [
        "left-out 1.0 is installed but not in lock", "numpy 2.4.5 is installed; lock locks 2.4.6"]


def test_the_resolution_reads_no_pip_configuration_of_this_machine(monkeypatch):
    """The wheel folder and local indexes this workplace names in pip's configuration are out of the dry run's reach:
    pip, run in its environment, lists no configuration but the switch that turns its files off."""
    resolve_lock = ci_script("resolve_lock")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    env = resolve_lock.pypi_only_environment()
    assert not [key for key in env if key.startswith("PIP_") and key != "PIP_CONFIG_FILE"]
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.splitlines() == [f":env:.config-file='{os.devnull}'"]


def report_entry(name: str, version: str, requires: list[str] = (), url: str = "https://files.example/x.whl"):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "download_info": {"url": url}}


def test_the_resolution_allows_only_the_lock_and_what_the_cuda_torch_pulls():
    resolve_lock = ci_script("resolve_lock")
    pins = {"torch": "2.13.0", "numpy": "2.4.6", "filelock": "4.3.1"}
    report = {"install": [
        report_entry("torch", "2.13.0", ["filelock", "nvidia-cublas==13.1.1.3; platform_system == 'Linux'"]),
        report_entry("nvidia-cublas", "13.1.1.3", ["nvidia-cuda-runtime"]),
        report_entry("nvidia-cuda-runtime", "13.0.96"),
        report_entry("filelock", "4.3.1"),
        report_entry("numpy", "2.4.5", url="file:///opt/wheels/numpy-2.4.5.whl"),
        report_entry("stray", "0.1"),
        report_entry("exactspec", "0.1.0", url=f"file://{ROOT}"),
    ]}
    found, cuda = resolve_lock.problems(report, pins)
    assert cuda == {"nvidia-cublas", "nvidia-cuda-runtime"}
    assert found == ["numpy 2.4.5 would be installed; the lock pins 2.4.6",
                     "stray would be installed but the lock lacks it",
                     "numpy would come from file:///opt/wheels/numpy-2.4.5.whl, not an index"]
