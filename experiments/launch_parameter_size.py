"""cuLaunchKernel's CPU time against the size of a kernel's by-value parameter and its
grid: does the layout kernel's 2.2 KiB job (128 planes inline) cost a launch more than
a small parameter would? Kernels of empty bodies, compiled with NVRTC; each launch
timed call to return through cuda.bindings, the stream drained every 8 launches.

    python3 experiments/launch_parameter_size.py
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

SIZES = (64, 256, 512, 1024, 2048, 2248, 4096)


def module() -> object:
    source = "".join(
        f"struct S{n} {{ unsigned long long v[{n // 8}]; }};\n"
        f'extern "C" __global__ void k{n}(const __grid_constant__ S{n} s) {{ if (s.v[0] == 12345) asm("trap;"); }}\n'
        for n in SIZES
    )
    _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"sizes.cu", 0, [], [])
    major, minor = torch.cuda.get_device_capability()
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
    (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"NVRTC: {status}")
    _, size = nvrtc.nvrtcGetCUBINSize(program)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(program, cubin)
    _, loaded = cu.cuModuleLoadData(cubin)
    return loaded


def main() -> None:
    torch.empty(1, device="cuda")  # (a context)
    loaded = module()
    stream = torch.cuda.Stream()
    print(torch.cuda.get_device_name(), "; median µs of 2,800 launches")
    for n in SIZES:
        _, function = cu.cuModuleGetFunction(loaded, f"k{n}".encode())
        parameter = (ctypes.c_ubyte * n)()
        params = (ctypes.c_void_p * 1)(ctypes.addressof(parameter))
        for grid in (1, 528):
            times = []
            for i in range(3000):
                start = time.perf_counter()
                cu.cuLaunchKernel(
                    function, grid, 1, 1, 128, 1, 1, 0, stream.cuda_stream, ctypes.addressof(params), 0
                )
                times.append(time.perf_counter() - start)
                if i % 8 == 7:
                    stream.synchronize()
            stream.synchronize()
            print(f"parameter {n:5d} B, grid {grid:4d}: {statistics.median(times[200:]) * 1e6:5.2f}")


if __name__ == "__main__":
    main()
