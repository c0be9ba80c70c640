"""Speculative decoding with a trained pair, streaming the text and printing its stats.

    python decode.py --target smollm2-135m --draft runs/quick/draft --prompt "Explain KV caches." --compare
"""

import sys

from specdistill.decode_cli import main

if __name__ == "__main__":
    sys.exit(main())
