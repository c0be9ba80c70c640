"""The embedded-default demo: ``make demo`` (or ``python demo.py --config configs/demo.yaml``).

Today it loads the SmolLM2 target, recovers ShareGPT, builds the default draft and prints the
target's reply to an MT-bench question; later stages extend it to distill, evaluate, decode, export.
"""

import sys

from specdistill.demo import main

if __name__ == "__main__":
    sys.exit(main())
