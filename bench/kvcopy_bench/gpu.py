"""The GPU a benchmark measures, or a plain message and exit status 2 where there is none."""

from __future__ import annotations

import sys


def gpu_or_exit(device: int = 0) -> str:
    """The name of GPU ``device``, made torch's current device; exits 2 where there is none."""
    try:
        import torch
    except ImportError:
        print("kvcopy bench: torch is needed to run the benchmark (pip install torch)", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("kvcopy bench: no CUDA GPU found on this machine; the benchmark needs one.", file=sys.stderr)
        sys.exit(2)
    if device >= torch.cuda.device_count():
        print(
            f"kvcopy bench: --device {device}, but this machine has {torch.cuda.device_count()} GPU(s)",
            file=sys.stderr,
        )
        sys.exit(2)
    torch.cuda.set_device(device)  # every "cuda" allocation of the run goes there
    return torch.cuda.get_device_name(device)
