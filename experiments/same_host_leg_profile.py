"""Where the same-host leg's time goes: bench/nixl_two_processes.py's packed way to the
other process's host memory, with each end's send_packed / receive_packed run under
cProfile, each end's functions by cumulative time (waits included: a wait's time is
the other end's work or the transport's).

    python3 experiments/same_host_leg_profile.py [--block-kib 2] [--chunk-rows 118]
        [--repeats 3] [--top 25]

Prints the bench's rows, then each end's profile of all its packed calls (warm-up
included).
"""

from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import kvcopy.nixl  # noqa: E402
from kvcopy.nixl import packed  # noqa: E402

import nixl_two_processes  # noqa: E402  (bench/nixl_two_processes.py)

# (spawned children import this module again: both ends profile their packed calls)
PROFILES = os.environ.setdefault("KVCOPY_LEG_PROFILES", tempfile.mkdtemp(prefix="leg-profile-"))


def _profiled(function, name: str):
    profile = cProfile.Profile()

    @functools.wraps(function)
    def run(*args, **kwargs):
        profile.enable()
        try:
            return function(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(os.path.join(PROFILES, name))  # (children end without atexit)

    return run


for _name in ("send_packed", "receive_packed"):
    _wrapped = _profiled(getattr(packed, _name), _name)
    setattr(packed, _name, _wrapped)
    setattr(kvcopy.nixl, _name, _wrapped)


def main() -> int:
    args = sys.argv[1:]
    top = 25
    if "--top" in args:
        at = args.index("--top")
        top = int(args[at + 1])
        del args[at : at + 2]
    defaults = {"--block-kib": "2", "--chunk-rows": "118", "--repeats": "3"}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    code = nixl_two_processes.main(["--to", "host", "--packed-only", *args])
    for name in ("send_packed", "receive_packed"):
        path = os.path.join(PROFILES, name)
        if not os.path.exists(path):
            print(f"{name}: no profile")
            continue
        text = io.StringIO()
        pstats.Stats(path, stream=text).sort_stats("cumulative").print_stats(top)
        print(f"==== {name}\n{text.getvalue()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
