"""Distil a draft from the target's logits.

    accelerate launch distill.py --config configs/smollm2-135m-quick.yaml [key=value ...] [--resume]
    python distill.py --config configs/tiny.yaml
"""

import sys

from specdistill.trainer import main

if __name__ == "__main__":
    sys.exit(main(objective="distill"))
