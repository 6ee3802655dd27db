"""Experiment: what vLLM's copy backend would gain if the memory behind its raw
pointers were classified once, not at every call.

A vLLM offload job names its copies by raw pointers into 64 GPU planes and 64 pinned
host planes (bench/steady_calls.py's vLLM row: 8 blocks of 2 KiB of each plane, a new
job a call). Nothing ties a raw pointer to the allocation seen at the call before, so
the describe pass asks the driver about every allocation the job touches, and about
their neighbours to join them, at every call. Were the planes held (their memory kept
alive and its kind fixed while held), their ranges could be answered from a table
made once. This times, in one process on a GPU:

- ``asked``: the describe pass as copy_batch runs it (the driver asked), with the
  number of ranges each side asked for;
- ``known``: the same pass with the planes' ranges known in advance
  (kvcopy.testing.describe_copies_in, the seam a held-memory table would use);
- ``run table``: reading the job's runs (vLLM's CopyRunDescriptor tuples) in C;
- ``submit``: the whole CopyBackend.submit, for scale.

Medians of 400 calls over 16 jobs in turn, µs.

    python3 experiments/held_ranges_probe.py
"""

from __future__ import annotations

import numpy as np
import torch

from cpu_timing import median_us
from kvcopy import device_pointer
from kvcopy.compat import vllm
from kvcopy.testing import cuda, describe_copies_answered, describe_copies_in

BLOCK, BLOCKS, PLANES = 2048, 1024, 64


def main() -> None:
    rng = np.random.default_rng(0)
    gpu = [torch.empty(BLOCKS * BLOCK, dtype=torch.uint8, device="cuda") for _ in range(PLANES)]
    host = [torch.empty(BLOCKS * BLOCK, dtype=torch.uint8, pin_memory=True) for _ in range(PLANES)]

    def job() -> list:
        src, dst = rng.choice(BLOCKS, 8, replace=False), rng.choice(BLOCKS, 8, replace=False)
        return [
            vllm.CopyRunDescriptor(
                g.data_ptr() + int(s) * BLOCK, h.data_ptr() + int(d) * BLOCK, BLOCK, 1, BLOCK, BLOCK
            )
            for g, h in zip(gpu, host)
            for s, d in zip(src, dst)
        ]

    jobs = [job() for _ in range(16)]
    tables = [vllm._live_runs(runs) for runs in jobs]
    scratch = torch.empty(len(jobs[0]) * cuda.describe.DESCRIPTOR_BYTES, dtype=torch.uint8, pin_memory=True)
    known = np.array(
        [[g.data_ptr(), g.data_ptr() + g.nbytes, cuda.classify.KIND_DEVICE, 0, 0] for g in gpu]
        + [
            [
                h.data_ptr(),
                h.data_ptr() + h.nbytes,
                cuda.classify.KIND_HOST_MAPPED,
                -1,
                device_pointer(h.data_ptr()) - h.data_ptr(),
            ]
            for h in host
        ],
        dtype=np.int64,
    )
    known = known[np.argsort(known[:, 0])]
    step = [0]

    def next_index() -> int:
        step[0] += 1
        return step[0] % len(jobs)

    def next_table() -> np.ndarray:
        return tables[next_index()]

    def asked() -> None:
        t = next_table()
        cuda.describe.describe_copies(t[0], t[1], t[2], scratch.data_ptr(), True)

    def in_known() -> None:
        t = next_table()
        describe_copies_in(known, t[0], t[1], t[2], scratch.data_ptr(), True)

    backend = vllm.CopyBackend()
    stream = torch.cuda.Stream()

    def submit() -> None:
        backend.submit(jobs[next_index()], stream=stream)
        backend.finish_transfer()

    t = tables[0]
    _, _, questions = describe_copies_answered(
        np.empty((0, 5), np.int64), t[0], t[1], t[2], scratch.data_ptr()
    )
    print(f"{torch.cuda.get_device_name()}; one job: {t.shape[1]} copies over {PLANES} + {PLANES} planes")
    print(f"ranges asked of the driver a call (src, dst): {questions}")
    for name, fn in (
        ("describe, the driver asked", asked),
        ("describe, the planes' ranges known", in_known),
        ("run table", lambda: vllm._live_runs(jobs[next_index()])),
        ("CopyBackend.submit", submit),
    ):
        print(f"{name:40s} {median_us(fn):8.1f}")
        stream.synchronize()


if __name__ == "__main__":
    main()
