"""The copy kernel compiles with NVRTC and is cached (CPU: NVRTC needs no GPU)."""

from __future__ import annotations

import pytest

from kvcopy import testing
from kvcopy.testing import engine

kernels = engine.kernels
from kvcopy.testing import cuda

launch = cuda.launch
from kvcopy.config import MAX_THREADS_PER_CTA

BULK_ENTRIES = {
    "kvcopy_bulk_scatter",
    "kvcopy_bulk_compact",
    "kvcopy_bulk_inline",
    "kvcopy_bulk_inline_small",
    "kvcopy_bulk_inline_tiny",
}


def _nvrtc_or_skip():
    try:
        return kernels.nvrtc_version()
    except kernels.KernelUnavailable as exc:
        pytest.skip(str(exc))


def test_sources_are_found():
    sources = kernels.kernel_sources()
    assert "kvcopy_scatter_compact" in sources["copy_kernel.cuh"]
    assert "KVCOPY_INLINE_MAX" in sources["descriptor.h"]


def _entry_points_loaded() -> set[str]:
    """The kernels kvcopy looks up by name when it loads the module (kernels.py)."""
    import re
    from pathlib import Path

    source = Path(kernels.__file__).read_text()
    return set(re.findall(r'function\("(kvcopy_\w+)"\)', source))


@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_to_a_cubin_with_all_entry_points(arch):
    _nvrtc_or_skip()
    cubin = kernels.compile_cubin(arch)
    assert cubin[:4] == b"\x7fELF"
    names = _entry_points_loaded()  # every kernel kvcopy looks up when it loads
    assert len(names) >= 14 and BULK_ENTRIES <= names
    for name in names:  # (a kernel renamed must be renamed where it is looked up)
        assert name.encode() + b"\x00" in cubin, name


def test_a_failed_compile_says_why_in_plain_text():
    """NVRTC's log is a C string: its NUL must not reach the message (nor the logs it
    is written to)."""
    _nvrtc_or_skip()
    with pytest.raises(kernels.KernelUnavailable) as caught:
        kernels.compile_cubin(1)
    message = str(caught.value)
    assert message.startswith(
        "NVRTC could not compile the copy kernel for sm_1: NVRTC_ERROR_INVALID_OPTION\n"
    )
    assert "--gpu-architecture" in message
    assert "\x00" not in message and message == message.rstrip()


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_kernel_fits_a_cta_of_the_most_threads(arch):
    """A kernel needing more than 65536 / 512 registers per thread fails every launch of
    512 threads (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); __launch_bounds__ must prevent it.
    The bulk copier's kernels are launched with launch.BULK_THREADS threads, always."""
    _nvrtc_or_skip()
    used = kernels.registers_per_thread(arch)
    assert set(used) >= {
        "kvcopy_scatter",
        "kvcopy_scatter_inline",
        "kvcopy_scatter_inline_small",
        "kvcopy_scatter_inline_tiny",
        "kvcopy_scatter_both",
        "kvcopy_blocks",
        *BULK_ENTRIES,
    }
    most = {name: launch.BULK_THREADS if name in BULK_ENTRIES else MAX_THREADS_PER_CTA for name in used}
    too_many = {name: n for name, n in used.items() if n * most[name] > 65536}
    assert not too_many, f"registers per thread above {65536 // MAX_THREADS_PER_CTA}: {too_many}"


def test_disk_cache_is_reused(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    first = kernels.cached_cubin(90)
    files = list(tmp_path.glob("copy_kernel-sm90-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes().endswith(first)
    compiled = []
    with testing.fake_compiler(lambda arch: compiled.append(arch) or b"x", kernels.nvrtc_version()):
        assert kernels.cached_cubin(90) == first  # read from disk: nothing compiled
    assert compiled == []


def test_cache_key_depends_on_arch_source_and_version():
    src = {"a": "x"}
    keys = {
        kernels.cache_key(src, 90, (13, 0)),
        kernels.cache_key(src, 80, (13, 0)),
        kernels.cache_key(src, 90, (13, 1)),
        kernels.cache_key({"a": "y"}, 90, (13, 0)),
    }
    assert len(keys) == 4
