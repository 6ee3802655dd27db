"""Without a GPU: import works and the first driver call says so plainly (CPU)."""

from __future__ import annotations

import pytest

import kvcopy


def test_import_and_api_surface():
    for name in ("copy_batch", "resolve_stream", "calibrate", "CudaError", "KVCopyError"):
        assert hasattr(kvcopy, name)
    assert issubclass(kvcopy.CudaError, kvcopy.KVCopyError)
    assert issubclass(kvcopy.NoDriverError, kvcopy.KVCopyError)


def test_first_copy_raises_no_driver_error():
    try:
        from kvcopy.testing import cuda

        kv_driver = cuda.driver

        kv_driver.init()
    except kvcopy.NoDriverError:
        pass
    else:
        pytest.skip("a CUDA driver is present")
    with pytest.raises(kvcopy.NoDriverError, match="no CUDA driver was found"):
        kvcopy.copy_batch([0x1000], [0x2000], [8])


def test_validation_happens_before_the_driver_is_needed():
    with pytest.raises(ValueError, match="differ in length"):
        kvcopy.copy_batch([1, 2], [3], [4, 4])
    with pytest.raises(ValueError, match="method must be one of"):
        kvcopy.copy_batch([1], [3], [4], method="dma")
    with pytest.raises(ValueError, match="src_access_order"):
        kvcopy.copy_batch([1], [3], [4], src_access_order="whenever")
    with pytest.raises(TypeError, match="stream"):
        kvcopy.copy_batch([1], [64], [4], stream="s1")


def test_cuda_error_is_picklable_and_carries_fields():
    import pickle

    err = kvcopy.CudaError(1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", 7)
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.name, back.index) == (1, "CUDA_ERROR_INVALID_VALUE", 7)
    assert "CUDA_ERROR_INVALID_VALUE" in str(back) and "copy 7" in str(back)


def test_sglang_address_tables_without_a_driver_say_so():
    """The all-layer forms ask the driver how far each table's addresses reach: without
    one, kvcopy's NoDriverError, not the loader's error."""
    torch = pytest.importorskip("torch")
    from kvcopy.compat import sglang
    from kvcopy.testing import cuda

    try:
        cuda.driver.init()
    except kvcopy.NoDriverError:
        pass
    else:
        pytest.skip("a CUDA driver is present")
    layers = [torch.zeros(16, 64, dtype=torch.uint8) for _ in range(4)]
    table = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    with pytest.raises(kvcopy.NoDriverError, match="no CUDA driver was found"):
        sglang.transfer_kv_all_layer(
            table[:2], table[2:], table[:2], table[2:], torch.arange(4), torch.arange(4), 64, 2
        )


def test_the_no_driver_error_is_short_and_keeps_its_cause():
    """What a user reads first is kvcopy's one line, not the loader's traceback; the
    loader's error stays on ``__context__``."""
    import subprocess
    import sys

    from kvcopy.testing import cuda

    try:
        cuda.driver.init()
    except kvcopy.NoDriverError as err:
        assert err.__context__ is not None and err.__cause__ is None
    else:
        pytest.skip("a CUDA driver is present")
    run = subprocess.run(
        [sys.executable, "-c", "import kvcopy; kvcopy.copy_batch([4096], [8192], [8])"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1
    assert lines[-1].startswith("kvcopy.errors.NoDriverError: no CUDA driver was found")
    # (kvcopy's frames only: none of the loader's, no chained traceback)
    assert "pathfinder" not in run.stderr and "During handling" not in run.stderr, run.stderr
    assert "The above exception" not in run.stderr and len(lines) < 25, run.stderr
