"""The build's one step beyond pyproject.toml: exactspec's C kernels (exactspec/backends/fused/: fused.h and one .c file
per concern, the fused CPU pass and the row kernels the torch runtime multiplies and attends with), compiled into one
extension with the C compiler that llama-cpp-python's build already needs. It is optional: where it does not build,
the install still succeeds, the torch runtime computes with the libraries' kernels and says where its rows then depend
on the pass, and exactspec says why once when the fused runtime is asked for (exactspec/backends/native.py)."""

from glob import glob

from setuptools import Extension, setup

KERNELS = "exactspec/backends/fused"

setup(
    ext_modules=[
        Extension(
            "exactspec.backends._fused",
            sources=sorted(glob(f"{KERNELS}/*.c")),
            depends=sorted(glob(f"{KERNELS}/*.h")),  # rebuilt when a header changes; shipped in the sdist
            extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off"],
            libraries=["pthread", "m"],
            optional=True,
        )
    ]
)
