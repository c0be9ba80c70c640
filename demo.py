"""The embedded-default demo: ``make demo`` (or ``python demo.py --config configs/demo.yaml``).

Target-generated data with the teacher stored → JSD distillation of the 10.4 % draft → acceptance at init vs
trained on MT-bench → a speculative decode of one MT-bench prompt → export (``specdistill/demo.py``).
"""

import sys

from specdistill.demo import main

if __name__ == "__main__":
    sys.exit(main())
