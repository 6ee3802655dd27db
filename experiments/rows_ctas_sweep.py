"""The layout kernel's CTAs for host copies: copy_rows with GPU-resident indices at 2 to
132 CTAs (config.host_ctas), each direction, on the layouts benchmark's transfers
(2 KiB token rows, 512 B and 128 B fragment runs), as a fraction of the contiguous
copy of the same bytes by GPU time in the same run. Prints one line per transfer."""

from __future__ import annotations

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.layouts import fragment_runs, token_rows
from kvcopy_bench.timing import measure

CTAS = (2, 4, 8, 16, 32, 64, 132)


def sweep(name: str, src, dst, s, d, rows: int, nbytes: int, h2d: bool, stream) -> None:
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a, b = (host, gpu) if h2d else (gpu, host)

    def contiguous() -> None:
        with torch.cuda.stream(stream):
            b.copy_(a, non_blocking=True)

    base = measure(contiguous, stream, repeats=9).gpu_ms
    cells = []
    for ctas in CTAS:
        kvcopy.config.host_ctas = ctas
        t = measure(lambda: kvcopy.copy_rows(src, dst, s, d, rows=rows, stream=stream), stream, repeats=9)
        cells.append(f"{ctas}:{base / t.gpu_ms:.2f}")
    kvcopy.config.host_ctas = None
    print(f"{name} {'h2d' if h2d else 'd2h'}  " + " ".join(cells), flush=True)


def main() -> None:
    stream = torch.cuda.Stream()
    paged, chunk, slots, _keep = token_rows(torch, 2048, 2)
    nbytes = paged.num_planes * len(slots) * paged.row_bytes
    sweep("tokens 2 KiB", chunk, paged, None, slots, len(slots), nbytes, True, stream)
    sweep("tokens 2 KiB", paged, chunk, slots, None, len(slots), nbytes, False, stream)
    for fragment in (512, 128):
        near, far, count, _keep2 = fragment_runs(torch, fragment)
        sweep(f"runs {fragment} B", far, near, None, None, count, count * fragment, True, stream)
        sweep(f"runs {fragment} B", near, far, None, None, count, count * fragment, False, stream)


if __name__ == "__main__":
    main()
