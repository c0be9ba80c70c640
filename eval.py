"""Measure token acceptance of one or more drafts against a target.

    python eval.py --target smollm2-135m --draft runs/quick/draft --draft init:fresh --prompts mtbench \
        --temperatures 0,1 --gamma 1..8
"""

import sys

from specdistill.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
