import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import results


def _report(alpha_by_category: dict[str, float]) -> dict:
    draft = {"alpha": {"0": 0.2, "1": 0.1}, "tau": {"0/5": 1.25}, "sizes": {"ratio_total": 0.187},
             "cost_ratio": 0.2, "best_gamma": {"0": 1}, "best_speedup": {"0": 0.9},
             "alpha_by_category": {"0": alpha_by_category}}
    return {"drafts": {"ce": draft}}


def test_category_rows_of_same_named_drafts_in_two_reports_stay_apart(tmp_path):
    short, long = tmp_path / "recipes" / "eval", tmp_path / "recipes-20min" / "eval"
    lines = results.acceptance_section([(short, _report({"coding": 0.111})), (long, _report({"coding": 0.222}))])
    rows = [line for line in lines if line.startswith("| `") and line.count("|") == 3]
    assert rows == [f"| `{short}` ce | 0.111 |", f"| `{long}` ce | 0.222 |"]
