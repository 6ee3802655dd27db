"""Builds kvcopy's Cython driver layer as C++ against cuda-python's cydriver.

cuda.h is searched in this order: $KVCOPY_CUDA_INCLUDE, $CUDA_HOME/include or
$CUDA_PATH/include, the nvidia-cuda-runtime wheel of the build environment,
/usr/local/cuda/include; the first whose CUDA version fits the cuda-bindings
being built against (same major, at least as new) is used, and the build
stops with both versions named when none does. The kernel sources in
include/kvcopy/ are copied into the package so that an installed kvcopy can
compile them with NVRTC.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError, ExecError as DistutilsExecError

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


def header_version(include: Path) -> tuple[int, int] | None:
    """CUDA_VERSION of the cuda.h in ``include`` as (major, minor), None if absent."""
    try:
        text = (include / "cuda.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", text, re.M)
    if not match:
        return None
    value = int(match.group(1))
    return value // 1000, value % 1000 // 10


def bindings_version() -> tuple[int, int]:
    """The (major, minor) of the cuda-bindings whose cydriver.pxd is compiled against."""
    from cuda import bindings

    major, minor = bindings.__version__.split(".")[:2]
    return int(major), int(minor)


def headers_fit(headers: tuple[int, int], bindings: tuple[int, int]) -> bool:
    """cydriver.pxd names every type of its own CUDA release: the headers must be of
    the same major and at least as new."""
    return headers[0] == bindings[0] and headers >= bindings


def cuda_include_dirs() -> list[str]:
    explicit = os.environ.get("KVCOPY_CUDA_INCLUDE")
    candidates: list[Path] = [Path(explicit)] if explicit else []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates += _wheel_include_dirs()
    candidates.append(Path("/usr/local/cuda/include"))
    want = bindings_version()
    seen = []
    chosen = None
    for folder in candidates:
        found = header_version(folder)
        if found is None:
            continue
        seen.append(f"{folder} (CUDA {found[0]}.{found[1]})")
        if headers_fit(found, want):
            chosen = folder
            break
        if explicit and folder == Path(explicit):
            raise RuntimeError(
                f"kvcopy: KVCOPY_CUDA_INCLUDE={explicit} holds cuda.h of CUDA {found[0]}.{found[1]}, "
                f"but cuda-bindings {want[0]}.{want[1]} needs CUDA {want[0]}.{want[1]} or a newer "
                f"{want[0]}.x"
            )
        print(
            f"kvcopy: skipping {folder}: cuda.h is CUDA {found[0]}.{found[1]}, cuda-bindings "
            f"is {want[0]}.{want[1]}",
            file=sys.stderr,
        )
    if chosen is None:
        # An older header of the same major often still compiles (cydriver only
        # needs the names kvcopy's modules touch); try the newest one, and name
        # both versions if the compiler then fails (BuildExtNamingVersions).
        same_major = [
            (header_version(c), c) for c in candidates if (header_version(c) or (0, 0))[0] == want[0]
        ]
        if not same_major:
            raise RuntimeError(HEADER_ADVICE.format(want=want, seen=", ".join(seen) or "none"))
        chosen = max(same_major)[1]
        print(
            f"kvcopy: warning: no cuda.h of CUDA {want[0]}.{want[1]} or newer; trying {chosen}",
            file=sys.stderr,
        )
    BuildExtNamingVersions.note = (
        f"cuda.h from {chosen} (CUDA {header_version(chosen)}) with cuda-bindings {want[0]}.{want[1]}"
    )
    dirs = [chosen]
    # cuda-bindings' pxd also includes cudaProfiler.h, which may live in another wheel.
    if not (chosen / "cudaProfiler.h").is_file():
        dirs += [c for c in candidates if (c / "cudaProfiler.h").is_file()][:1]
    return [str(d) for d in dirs]


HEADER_ADVICE = (
    "kvcopy: no cuda.h fits cuda-bindings {want[0]}.{want[1]} (needs CUDA {want[0]}.{want[1]} "
    "or a newer {want[0]}.x). Found: {seen}. Install nvidia-cuda-runtime=={want[0]}.{want[1]}.* "
    "in the build environment, or point KVCOPY_CUDA_INCLUDE or CUDA_HOME at a matching toolkit."
)


class BuildExtNamingVersions(build_ext):
    """Cythonizes at build time (so that an sdist holds the .pyx sources and no
    generated C++), compiles against the cuda.h that fits the bindings, and names
    both versions when the compiler fails."""

    note = ""

    def finalize_options(self) -> None:
        super().finalize_options()
        from Cython.Build import cythonize

        includes = [str(HEADERS)] + cuda_include_dirs()
        for ext in self.extensions:
            if ext.name.startswith("kvcopy._cuda."):
                ext.include_dirs = includes + list(ext.include_dirs)
        # setuptools' own Extension objects are kept (it has prepared them); only their
        # sources turn from .pyx into the generated .cpp
        generated = cythonize(
            self.extensions, compiler_directives={"language_level": "3"}, nthreads=os.cpu_count() or 1
        )
        for ext, made in zip(self.extensions, generated):
            ext.sources = made.sources

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except (CompileError, DistutilsExecError) as exc:
            raise RuntimeError(
                f"kvcopy: compiling against {self.note} failed ({exc}). The "
                "headers must be of the bindings' CUDA version or newer: install "
                "the matching nvidia-cuda-runtime, or set KVCOPY_CUDA_INCLUDE or "
                "CUDA_HOME to a matching toolkit."
            ) from exc


class BuildPyWithKernelSources(build_py):
    """Ships include/kvcopy/ inside the package as kvcopy/_include/kvcopy/."""

    def run(self) -> None:
        target = ROOT / "kvcopy" / "_include" / "kvcopy"
        target.mkdir(parents=True, exist_ok=True)
        for src in HEADERS.joinpath("kvcopy").iterdir():
            shutil.copy2(src, target / src.name)
        super().run()


CUDA_MODULES = (
    "driver",
    "memory",
    "classify",
    "describe",
    "dma",
    "ipc",
    "launch",
    "plan_arrays",
    "replay_records",
    "rows",
    "rows_repeat",
    "shared_words",
    "stage",
    "tensor_stamps",
    "testing",
)


# Optimised and without debug information: -g0 overrides the -g of Python's own
# flags, and the linker strips what remains (the wheel is a fifth of the size).
COMPILE_ARGS = ["-O3", "-g0"]
LINK_ARGS = ["-Wl,--strip-all"]


def extensions() -> list[Extension]:
    layer = [
        Extension(
            f"kvcopy._cuda.{name}",
            [f"kvcopy/_cuda/{name}.pyx"],
            language="c++",
            extra_compile_args=COMPILE_ARGS + ["-std=c++17"],
            extra_link_args=LINK_ARGS,
        )
        for name in CUDA_MODULES
    ]
    return layer


setup(
    ext_modules=extensions(),
    cmdclass={"build_py": BuildPyWithKernelSources, "build_ext": BuildExtNamingVersions},
)
