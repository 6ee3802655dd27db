"""vLLM's tests of ``ops.swap_blocks_batch``, run on kvcopy.compat.vllm (GPU).

Ported from vllm-project/vllm, ``tests/v1/kv_offload/cpu/test_swap_blocks_batch.py``
at commit 3028adf2c250cc0a5e460b148f1180bd3b653b80: all five tests (the legacy
default stream and a dedicated stream, with and without the batch API, and 20,000
copies of 128 bytes without it), the same buffers and sizes, bytes compared
exactly. Left out: nothing; the op copies device memory through the driver, so
these run on a GPU only.
"""

from __future__ import annotations

import pytest

from kvcopy.compat import vllm

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _addresses(buffers: list) -> "torch.Tensor":
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


def _run_batch(sizes: list[int], use_batch_api: bool = True) -> None:
    src = [torch.randint(256, (s,), dtype=torch.uint8, device="cuda") for s in sizes]
    dst = [torch.zeros_like(s) for s in src]
    vllm.swap_blocks_batch(
        _addresses(src), _addresses(dst), torch.tensor(sizes, dtype=torch.int64), use_batch_api=use_batch_api
    )
    torch.cuda.synchronize()
    for s, d in zip(src, dst):
        assert torch.equal(d, s)


def test_swap_blocks_batch_default_stream():
    _run_batch([8, 4096, 8192])


def test_swap_blocks_batch_dedicated_stream():
    with torch.cuda.stream(torch.cuda.Stream()):
        _run_batch([8, 4096, 8192])


def test_swap_blocks_batch_no_batch_api_default_stream():
    _run_batch([8, 4096, 8192], use_batch_api=False)


def test_swap_blocks_batch_no_batch_api_dedicated_stream():
    with torch.cuda.stream(torch.cuda.Stream()):
        _run_batch([8, 4096, 8192], use_batch_api=False)


def test_swap_blocks_batch_no_batch_api_large_descriptor_count():
    with torch.cuda.stream(torch.cuda.Stream()):
        _run_batch([128] * 20_000, use_batch_api=False)
