"""``F.linear`` vs ``kernels.small_batch_linear`` (fp32, CPU) for each linear shape of a target and draft.

    python scripts/bench_linear.py --target smollm2-135m --draft runs/full/draft --rows 1,2,3,4,5,6,8,16,32

For each distinct weight shape and row count: median µs of both, timed alternately in one run, and the
ratio. This is the evidence behind ``kernels.faster_than_linear``; the decode-level
effect is measured by ``eval.py`` (c, v(γ)) and ``scripts/bench_decode.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill.config import record_run
from specdistill.kernels import small_batch_linear
from specdistill.models import load_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,16,32")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default=None, help="folder for bench_linear.json")
    args = parser.parse_args()
    shapes = {}
    for spec in [args.target, args.draft]:
        if spec:
            for name, module in load_model(spec, "float32").named_modules():
                if isinstance(module, torch.nn.Linear):
                    shapes.setdefault(tuple(module.weight.shape), f"{Path(spec).name}:{name.split('.')[-1]}")
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'weight':>14s} {'example':28s} " + " ".join(f"{r:>7d}" for r in rows_list) + "   (F.linear µs / ours µs)")
    with torch.inference_mode():
        for shape, example in sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1]):
            weight = torch.randn(*shape)
            cells = []
            for rows in rows_list:
                x = torch.randn(rows, shape[1])
                times = {"linear": [], "ours": []}
                for _ in range(args.repeats):  # alternately, so drift hits both alike
                    for name, fn in (("linear", F.linear), ("ours", small_batch_linear)):
                        start = time.perf_counter()
                        fn(x, weight)
                        times[name].append(time.perf_counter() - start)
                lin, ours = (statistics.median(times[k][2:]) * 1e6 for k in ("linear", "ours"))
                results.append({"shape": list(shape), "rows": rows, "linear_us": lin, "ours_us": ours,
                                "speedup": lin / ours})
                cells.append(f"{lin / ours:6.2f}×")
            print(f"{shape!s:>14s} {example:28s} " + " ".join(cells))
    if args.out:
        out = record_run(Path(args.out), vars(args))
        (out / "bench_linear.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
