"""The main benchmark: kvcopy against the link's ceiling and the alternatives.

    python bench/run.py [--quick] [--device N] [--calibrate] [--out DIR]

(``bash scripts/bench.sh`` installs kvcopy first, then runs it with --quick.) Without
a CUDA GPU it says so and exits 2. See bench/README.md.
"""

import sys

from kvcopy_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
