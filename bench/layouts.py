"""Layout transfers (copy_rows, swap_blocks of many small pairs, a store and a load at
once) against the contiguous copy, the pointer path and vLLM's way.

    python bench/layouts.py [--out FILE.json]

Also a stage of bench/run.py. See bench/README.md.
"""

import sys

from kvcopy_bench.layouts import main

if __name__ == "__main__":
    sys.exit(main())
