"""Builds kvcopy's Cython driver layer as C++ against cuda-python's cydriver.

cuda.h is searched in this order: $KVCOPY_CUDA_INCLUDE, $CUDA_HOME/include or
$CUDA_PATH/include, the nvidia-cuda-runtime wheel of the build environment,
/usr/local/cuda/include. The kernel sources in include/kvcopy/ are copied into
the package so that an installed kvcopy can compile them with NVRTC.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
HEADERS = ROOT / "include"


def _wheel_include_dirs() -> list[Path]:
    """include/ folders of nvidia-* wheels on sys.path (13.x then 12.x layouts)."""
    found = []
    for entry in sys.path:
        nvidia = Path(entry) / "nvidia"
        if not nvidia.is_dir():
            continue
        found += [nvidia / "cu13" / "include", nvidia / "cuda_runtime" / "include"]
        found += sorted(nvidia.glob("*/include"))
    return found


def cuda_include_dirs() -> list[str]:
    candidates: list[Path] = []
    if os.environ.get("KVCOPY_CUDA_INCLUDE"):
        candidates.append(Path(os.environ["KVCOPY_CUDA_INCLUDE"]))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates += _wheel_include_dirs()
    candidates.append(Path("/usr/local/cuda/include"))
    cuda_h = next((c for c in candidates if (c / "cuda.h").is_file()), None)
    if cuda_h is None:
        raise RuntimeError(
            "kvcopy: cuda.h not found. Set KVCOPY_CUDA_INCLUDE or CUDA_HOME, or install "
            "the nvidia-cuda-runtime wheel. Looked in: " + ", ".join(map(str, candidates))
        )
    dirs = [cuda_h]
    # cuda-bindings' pxd also includes cudaProfiler.h, which may live in another wheel.
    if not (cuda_h / "cudaProfiler.h").is_file():
        dirs += [c for c in candidates if (c / "cudaProfiler.h").is_file()][:1]
    return [str(d) for d in dirs]


class BuildPyWithKernelSources(build_py):
    """Ships include/kvcopy/ inside the package as kvcopy/_include/kvcopy/."""

    def run(self) -> None:
        target = ROOT / "kvcopy" / "_include" / "kvcopy"
        target.mkdir(parents=True, exist_ok=True)
        for src in HEADERS.joinpath("kvcopy").iterdir():
            shutil.copy2(src, target / src.name)
        super().run()


def extensions() -> list[Extension]:
    from Cython.Build import cythonize

    driver = Extension(
        "kvcopy._driver",
        ["kvcopy/_driver.pyx"],
        include_dirs=[str(HEADERS)] + cuda_include_dirs(),
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
    )
    planner = Extension("kvcopy._plan", ["kvcopy/_plan.pyx"], language="c++",
                        extra_compile_args=["-O3"])
    return cythonize([driver, planner], compiler_directives={"language_level": "3"})


setup(ext_modules=extensions(), cmdclass={"build_py": BuildPyWithKernelSources})
