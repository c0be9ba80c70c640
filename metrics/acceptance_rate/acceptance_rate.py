"""`evaluate` metric: token acceptance rate of a speculative-decoding draft.

    import evaluate
    metric = evaluate.load("metrics/acceptance_rate")
    metric.compute(predictions=[[draft argmax ids...]], references=[[target greedy ids...]], gamma=5)
    metric.compute(predictions=..., references=..., target_logits=[...], draft_logits=[...], temperature=1.0)

Greedy inputs are per-sequence token ids along the target's greedy continuation; probabilistic inputs add
per-sequence logit arrays (positions × vocab). The numbers come from `specdistill.acceptance`, so they
equal what `eval.py` reports.
"""

import datasets
import evaluate
import torch

from specdistill.acceptance import (
    expected_tau,
    greedy_block_acceptance,
    per_position_acceptance,
    tau_from_accepted,
    token_acceptance,
)

_DESCRIPTION = __doc__
_KWARGS = """
Args:
    predictions: list of lists of int, the draft's argmax token per position.
    references: list of lists of int, the target's token per position (its greedy continuation).
    gamma: draft block length γ (default 5).
    target_logits / draft_logits: optional lists of (positions, vocab) arrays for T > 0.
    temperature: used with the logits (default 1.0).
Returns:
    alpha_greedy, per_position (γ values), tau_greedy, and with logits alpha (Σ min(p, q)) and tau_iid.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class AcceptanceRate(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="Leviathan et al. 2023; Chen et al. 2023", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int64")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}),
        )

    def _compute(self, predictions, references, gamma=5, target_logits=None, draft_logits=None, temperature=1.0):
        counts, agree_all = [], []
        for pred, ref in zip(predictions, references):
            if len(pred) != len(ref):
                raise ValueError(f"prediction and reference lengths differ ({len(pred)} vs {len(ref)})")
            agree = [1.0 if p == r else 0.0 for p, r in zip(pred, ref)]
            agree_all += agree
            counts += greedy_block_acceptance(agree, gamma)
        result = {"alpha_greedy": sum(agree_all) / max(len(agree_all), 1),
                  "per_position": per_position_acceptance(counts, gamma), "tau_greedy": tau_from_accepted(counts)}
        if target_logits is not None and draft_logits is not None:
            values = torch.cat([token_acceptance(torch.as_tensor(p), torch.as_tensor(q), temperature)
                                for p, q in zip(target_logits, draft_logits)])
            result["alpha"] = values.mean().item()
            result["tau_iid"] = expected_tau(result["alpha"], gamma)
        return result
