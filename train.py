"""Train a draft with plain next-token cross-entropy on the same data (the SFT baseline to distillation).

    accelerate launch train.py --config configs/smollm2-135m-quick.yaml [key=value ...] [--resume]
"""

import sys

from specdistill.trainer import main

if __name__ == "__main__":
    sys.exit(main(objective="ce"))
