"""Which frees survive a CUDA graph captured beside them in torch's default (global)
capture mode: cuMemFreeHost / cuMemFree with the thread's mode as it is or relaxed,
on the capturing thread or another, and a kvcopy pinned array or a torch CUDAGraph
freed by the collector.

Settled: kvcopy's memory.host_free and mem_free relax the thread's capture mode for
the call (in the global mode the driver refuses the free with
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture; relaxed, both
succeed and the capture replays). The torch graph case is why the GPU tests collect
garbage before each test rather than inside its capture. Each case runs in a child
process of its own.

    python3 experiments/capture_frees.py
"""

from __future__ import annotations

import subprocess
import sys

CASES = [
    "pinned_array_collected",
    "torch_graph_collected",
    "host_free",
    "host_free_relaxed",
    "host_free_relaxed_other_thread",
    "host_free_other_thread",
    "device_free_relaxed",
    "device_free_relaxed_other_thread",
    "event_destroy",
]

CHILD = r"""
import gc, threading, torch, kvcopy
from cuda.bindings import driver as cu
case = CASE
relaxed = "relaxed" in case
said = []

def host():
    _, p = cu.cuMemHostAlloc(1 << 20, 0)
    return lambda: said.append(cu.cuMemFreeHost(p)[0].name)

def device():
    _, p = cu.cuMemAlloc(1 << 20)
    return lambda: said.append(cu.cuMemFree(p)[0].name)

def event():
    _, e = cu.cuEventCreate(0)
    return lambda: said.append(cu.cuEventDestroy(e)[0].name)

def collected():
    class Cycle: pass
    c = Cycle(); c.me = c; c.array = kvcopy.pinned_empty(1 << 20)
    del c
    return lambda: said.append(f"collected {gc.collect()}")

def graph():
    class Cycle: pass
    c = Cycle(); c.me = c; c.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(c.graph, stream=torch.cuda.Stream()):
        torch.zeros(1, device="cuda").add_(1)
    del c
    return lambda: said.append(f"collected {gc.collect()}")

torch.zeros(1, device="cuda"); gc.collect(); gc.disable()
makers = {"pinned": collected, "torch": graph, "host": host, "device": device, "event": event}
free = makers[case.split("_")[0]]()

def run():
    if relaxed:
        _, old = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    free()
    if relaxed:
        cu.cuThreadExchangeStreamCaptureMode(old)

a = torch.zeros(1 << 20, device="cuda")
stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph, stream=stream):
        a.add_(1)
        if "other_thread" in case:
            t = threading.Thread(target=run); t.start(); t.join()
        else:
            run()
        a.add_(1)
    graph.replay(); torch.cuda.synchronize()
    verdict = "capture valid" if a[0].item() == 2 else "capture replayed wrong"
except Exception as exc:
    verdict = "capture invalidated: " + str(exc).splitlines()[0][:60]
print(f"{case:36s} {' '.join(said):40s} {verdict}")
"""


def main() -> None:
    print(f"{'case':36s} {'free returned':40s} capture")
    for case in CASES:
        child = subprocess.run(
            [sys.executable, "-c", CHILD.replace("CASE", repr(case))], capture_output=True, text=True
        )
        lines = [line for line in child.stdout.splitlines() if line.strip()]
        print(lines[-1] if lines else f"{case:36s} child failed: {child.stderr[-200:]}")


if __name__ == "__main__":
    main()
