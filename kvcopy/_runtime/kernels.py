"""The copy kernel: NVRTC compilation, on-disk cache, per-context modules.

The CUDA source ships in include/kvcopy/ (installed as kvcopy/_include/kvcopy/).
It is compiled at first use for the GPU's architecture into a cubin, which is
cached in memory and on disk (keyed by source, architecture and NVRTC version)
under $KVCOPY_CACHE_DIR, else $XDG_CACHE_HOME/kvcopy, else ~/.cache/kvcopy.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from kvcopy._runtime import persist
from kvcopy._cuda import driver, launch, rows
from kvcopy.config import MAX_THREADS_PER_CTA, cache_dir, kernel_unroll
from kvcopy.errors import KVCopyError

_SOURCE_FILES = ("copy_kernel.cuh", "descriptor.h", "rows.h", "rows_kernel.cuh")
_OPTIONS = (
    "-std=c++17",
    "-default-device",
    f"-DKVCOPY_UNROLL={kernel_unroll()}",
    f"-DKVCOPY_MAX_THREADS={MAX_THREADS_PER_CTA}",
)  # the kernel's __launch_bounds__


class KernelUnavailable(KVCopyError):
    """NVRTC could not build the copy kernel; DMA paths still work."""


def _source_dir() -> Path:
    here = Path(__file__).resolve().parent
    package = here.parent  # kvcopy/
    for candidate in (package / "_include" / "kvcopy", package.parent / "include" / "kvcopy"):
        if (candidate / "copy_kernel.cuh").is_file():
            return candidate
    raise KernelUnavailable("kvcopy's kernel source (copy_kernel.cuh) is not installed")


def kernel_sources() -> dict[str, str]:
    """File name -> text of the kernel source and its header."""
    folder = _source_dir()
    return {name: (folder / name).read_text() for name in _SOURCE_FILES}


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise KernelUnavailable(f"cuda.bindings.nvrtc cannot be imported: {exc}") from exc
    return nvrtc


def _nvrtc_call(nvrtc, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelUnavailable(f"{what} failed: {err.name}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        major, minor = _nvrtc_call(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    except KernelUnavailable:
        raise
    except Exception as exc:  # libnvrtc missing: DynamicLibNotFoundError and kin
        raise KernelUnavailable(
            f"NVRTC is not available ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc "
            "(pip install 'kvcopy-cuda[cu13]', or '[cu12]' with CUDA 12) for the copy kernel"
        ) from exc
    return int(major), int(minor)


def cache_key(sources: dict[str, str], arch: int, version: tuple[int, int]) -> str:
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    digest.update(f"sm_{arch}|nvrtc {version[0]}.{version[1]}|{' '.join(_OPTIONS)}".encode())
    return digest.hexdigest()[:32]


def compile_cubin(arch: int) -> bytes:
    """Compile the copy kernel for sm_<arch> with NVRTC (no GPU needed)."""
    return _compile(arch)[0]


def registers_per_thread(arch: int) -> dict[str, int]:
    """Registers each kernel entry point uses on sm_<arch>, as ptxas reports them
    (a CTA of config.MAX_THREADS_PER_CTA threads must fit in the register file)."""
    report = _compile(arch, verbose=True)[1]
    found: dict[str, int] = {}
    name = ""
    for line in report.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used and name:
            found[name] = int(used.group(1))
    return found


def _compile(arch: int, verbose: bool = False) -> tuple[bytes, str]:
    """The cubin for sm_<arch>, and NVRTC's log (ptxas' resource report when verbose)."""
    nvrtc = _nvrtc()
    sources = kernel_sources()
    headers = [n for n in _SOURCE_FILES if n != "copy_kernel.cuh"]
    prog = _nvrtc_call(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            sources["copy_kernel.cuh"].encode(),
            b"kvcopy_copy_kernel.cu",
            len(headers),
            [sources[h].encode() for h in headers],
            [h.encode() for h in headers],
        ),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode()] + [o.encode() for o in _OPTIONS]
        if verbose:
            options.append(b"--ptxas-options=-v")
            if nvrtc_version() >= (12, 9):  # a cached program would report nothing
                options.append(b"--no-cache")
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        size = _nvrtc_call(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        raw = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, raw)
        # (the log is a C string: its NUL would reach messages and log files)
        log = raw.rstrip(b"\x00").decode(errors="replace").rstrip()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelUnavailable(
                f"NVRTC could not compile the copy kernel for sm_{arch}: {err.name}\n{log}"
            )
        size = _nvrtc_call(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc_call(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# A cached cubin is stored behind a header recording its size and SHA-256, so that a
# truncated or overwritten file is found before it reaches the driver.
_CUBIN_MAGIC = b"KVCOPY-CUBIN-1\n"
_HEADER_BYTES = len(_CUBIN_MAGIC) + 32 + 8
_warned_cache: set[str] = set()


def _pack_cubin(cubin: bytes) -> bytes:
    return _CUBIN_MAGIC + hashlib.sha256(cubin).digest() + len(cubin).to_bytes(8, "little") + cubin


def _unpack_cubin(data: bytes) -> bytes | None:
    """The cubin in a cache file, or None where the file is not whole and intact."""
    if len(data) < _HEADER_BYTES or not data.startswith(_CUBIN_MAGIC):
        return None
    digest = data[len(_CUBIN_MAGIC) : len(_CUBIN_MAGIC) + 32]
    size = int.from_bytes(data[len(_CUBIN_MAGIC) + 32 : _HEADER_BYTES], "little")
    cubin = data[_HEADER_BYTES:]
    if size == 0 or len(cubin) != size or hashlib.sha256(cubin).digest() != digest:
        return None
    return cubin


def cubin_path(arch: int) -> Path:
    """Where the cubin for sm_<arch> of this source, NVRTC and options is cached."""
    key = cache_key(kernel_sources(), arch, nvrtc_version())
    # '.checked': the file holds the header, so a kvcopy that stores bare cubins under
    # the older name and this one never read each other's files
    return cache_dir() / f"copy_kernel-sm{arch}-{key}.checked.cubin"


def _warn_cache_once(problem: str) -> None:
    if problem not in _warned_cache:
        _warned_cache.add(problem)
        warnings.warn(
            f"kvcopy: {problem}; the copy kernel is compiled in memory in each "
            "process (set KVCOPY_CACHE_DIR to a writable folder)",
            RuntimeWarning,
            stacklevel=4,
        )


def cached_cubin(arch: int, *, rebuild: bool = False) -> bytes:
    """The cubin for sm_<arch>, from the disk cache where the file there is intact
    (size and digest checked), else freshly compiled and cached. ``rebuild``: compile
    whatever the cache holds (a cached cubin the driver refused). A cache that cannot
    be written costs a compile per process, with one warning."""
    path = cubin_path(arch)
    if not rebuild:
        try:
            found = _unpack_cubin(path.read_bytes())
        except OSError:
            found = None
        if found is not None:
            return found
    cubin = compile_cubin(arch)
    try:
        persist.atomic_write(path, _pack_cubin(cubin))
    except OSError as exc:
        _warn_cache_once(f"the kernel cache {path.parent} cannot be written ({exc.strerror or exc})")
    return cubin


def _load_module(arch: int) -> int:
    """The copy kernel's module in the current context; a cached cubin the driver
    refuses is compiled again once before the failure counts."""
    try:
        return launch.module_load(cached_cubin(arch))
    except KernelUnavailable:
        raise
    except KVCopyError:
        return launch.module_load(cached_cubin(arch, rebuild=True))


@dataclass(frozen=True)
class ScatterFunctions:
    """One copier's entry points, one per way a batch's descriptors reach the kernel."""

    uploaded: int  # descriptors in device (or mapped pinned) memory
    compact: int  # kvcopy_compact_desc entries (copies of one size)
    inline: int  # descriptors by value, KVCOPY_INLINE_MAX per launch
    small: int  # by value within the 4 KiB parameter limit
    tiny: int  # up to INLINE_MAX_TINY by value (1 KiB)


@dataclass(frozen=True)
class CopyKernel:
    """The kernel loaded in one context."""

    module: int
    function_uploaded: int  # descriptors in device memory, one launch per batch
    function_blocks: int  # swap_blocks: tensor table + id mapping in device memory
    function_both: int  # two batches in one launch, each with its own CTAs
    function: int  # descriptors by value, KVCOPY_INLINE_MAX per launch
    function_small: int  # descriptors by value within the 4 KiB parameter limit
    function_tiny: int  # up to INLINE_MAX_TINY descriptors by value (1 KiB)
    function_compact: int  # kvcopy_compact_desc entries (copies of one size), one launch per batch
    function_blocks_both: int  # two swap_blocks in one launch, each with its own CTAs
    per_launch: int
    bulk: ScatterFunctions  # the same through the bulk copy unit (CTAs of launch.BULK_THREADS)
    function_rows: int = 0  # the layout kernel: addresses from layouts and indices
    rows_report: int = 0  # device address of its out-of-range report

    @functools.cached_property
    def registers(self) -> ScatterFunctions:
        """The register copier's entry points (built once: scatter() is on every launch)."""
        return ScatterFunctions(
            self.function_uploaded,
            self.function_compact,
            self.function,
            self.function_small,
            self.function_tiny,
        )

    @functools.cached_property
    def by_value(self) -> frozenset[int]:
        """Every entry point that takes its descriptors by value."""
        return frozenset(
            (
                self.function,
                self.function_small,
                self.function_tiny,
                self.bulk.inline,
                self.bulk.small,
                self.bulk.tiny,
            )
        )

    def scatter(self, variant: str) -> ScatterFunctions:
        """The entry points of the copier a Decision's ``variant`` names ('bulk', or
        the register copier for anything else)."""
        return self.bulk if variant == "bulk" else self.registers


_lock = threading.Lock()
# by driver.current_context_key: a context made again under an old handle (after a
# reset) must load its own module, the old one's being gone with it
_loaded: dict[int, CopyKernel] = {}
_failed: dict[int, str] = {}


def loaded_by_value(ctx: int) -> frozenset[int]:
    """The entry points taking descriptors by value of the kernel loaded in the
    context of key ``ctx`` (driver.current_context_key; none where it is not loaded
    there)."""
    kernel = _loaded.get(ctx)
    return frozenset() if kernel is None else kernel.by_value


def loaded_kernel() -> CopyKernel | None:
    """The kernel loaded in the calling thread's current context, if it was loaded."""
    return _loaded.get(driver.current_context_key())


def kernel_for_current_context(cc_major: int, cc_minor: int, driver_version: int) -> CopyKernel:
    """Load (once per context) the kernel in the calling thread's current context.

    Raises:
        KernelUnavailable: NVRTC missing, compilation failed, or the module failed to load.
    """
    ctx = driver.current_context_key()
    kernel = _loaded.get(ctx)  # entries are only ever added: no lock needed to find one
    if kernel is not None:
        return kernel
    with _lock:
        if ctx in _loaded:
            return _loaded[ctx]
        if ctx in _failed:
            raise KernelUnavailable(_failed[ctx])
        try:
            module = _load_module(cc_major * 10 + cc_minor)
        except KernelUnavailable as exc:
            _failed[ctx] = str(exc)
            raise
        except KVCopyError as exc:
            _failed[ctx] = f"the copy kernel failed to load: {exc}"
            raise KernelUnavailable(_failed[ctx]) from exc
        # Parameters above 4 KiB need CUDA >= 12.1 and sm_70 or newer.
        large = driver_version >= 12010 and cc_major >= 7

        def function(name: str) -> int:
            return launch.module_function(module, name.encode())

        kernel = CopyKernel(
            module=module,
            function_uploaded=function("kvcopy_scatter"),
            function_blocks=function("kvcopy_blocks"),
            function_blocks_both=function("kvcopy_blocks_both"),
            function_both=function("kvcopy_scatter_both"),
            function=function("kvcopy_scatter_inline"),
            function_small=function("kvcopy_scatter_inline_small"),
            function_tiny=function("kvcopy_scatter_inline_tiny"),
            function_compact=function("kvcopy_scatter_compact"),
            per_launch=launch.INLINE_MAX if large else launch.INLINE_MAX_SMALL,
            bulk=ScatterFunctions(
                function("kvcopy_bulk_scatter"),
                function("kvcopy_bulk_compact"),
                function("kvcopy_bulk_inline"),
                function("kvcopy_bulk_inline_small"),
                function("kvcopy_bulk_inline_tiny"),
            ),
            function_rows=function("kvcopy_rows"),
            rows_report=rows.report_address(module),
        )
        _loaded[ctx] = kernel
        return kernel
