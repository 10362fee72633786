"""
scripts/uncertainty.py -- when is the model wrong? (`python -m scripts.uncertainty`)
Detectors of wrong answers, each scored by how well it separates wrong from right (AUROC: P(a wrong
answer scores higher than a right one)
+ ½ P(tie), the Mann–Whitney U) and by the accuracy–coverage curve of abstaining below a
threshold:

  - max probability of the greedy answer, and the mean token entropy: free, one pass;
  - self-consistency over K samples (Wang et al. 2023): the share that agree with the
    greedy answer; costs K sampled answers per question;
  - semantic entropy (Farquhar et al. 2024): the entropy over clusters of sampled answers
    that MEAN the same -- here, the same numeric value; costs the same K samples.

An entry point in scripts/ (nothing imports it), built on evaluate.py's metrics, flags and task
model
(detecting errors, not scoring answers).
"""
import re
import time
from collections import Counter

import numpy as np
import torch

from core import data
import evaluate as ev
from core import scores
from core.plots import svg_line_plot, terminal_plot
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import print0, run_cli


@torch.no_grad()
def sample_answers(model, enc, problems, k, temperature, max_new, seed):
    """k sampled answers per problem (cut after "\\n"), equal-length prompts batched."""
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    device = model.output.weight.device
    prompts = scores.prompt_ids(enc, problems)
    out = [None] * len(problems)
    for n, ids in scores.by_length(prompts).items():
        idx = torch.tensor([prompts[i] for i in ids for _ in range(k)], device=device)
        rows = model.generate(idx, max_new, temperature=temperature, seed=seed + n,
                              eos_id=nl).tolist()
        for j, i in enumerate(ids):
            out[i] = [r[:r.index(nl) + 1] if nl in r else r for r in rows[j * k:(j + 1) * k]]
    return out


def meaning(text):
    """What an answer means, for clustering: its number, or the stripped text."""
    s = data.extract_answer(text)
    return int(s) if re.fullmatch(r"-?\d+", s) else s


def consistency_scores(enc, greedy, samples):
    """-> agreement of the samples with the greedy answer's meaning, entropy over distinct
    token sequences (naive), entropy over meanings (discrete semantic entropy)."""
    agree = []
    naive = []
    semantic = []
    for g, ss in zip(greedy, samples):
        means = [meaning(enc.decode(s)) for s in ss]
        agree.append(np.mean([m == meaning(enc.decode(g)) for m in means]))
        naive.append(ev.entropy(list(Counter(tuple(s) for s in ss).values())))
        semantic.append(ev.entropy(list(Counter(means).values())))
    return np.array(agree), np.array(naive), np.array(semantic)


def run(args, device):
    """`python -m scripts.uncertainty`: every detector's AUROC and accuracy–coverage."""
    if args.samples < 2:
        raise UserError(f"--samples must be at least 2 (self-consistency compares samples), "
                        f"got {args.samples}")
    _, enc, _ = ev.task_base(args, device)
    model, _ = ev.task_model(args, enc, device)
    _, test = ev.eval_problems(args)
    t0 = time.perf_counter()
    rec = ev.answer_records(model, enc, test, args.max_new)
    seq, first, ent = ev.confidences(rec)
    t1 = time.perf_counter()
    samples = sample_answers(model, enc, test, args.samples, args.temperature, args.max_new,
                             args.seed)
    agree, naive, semantic = consistency_scores(enc, rec["greedy"], samples)
    t2 = time.perf_counter()
    wrong = 1 - rec["correct"]
    k = f"{args.samples} samples"
    detectors = {"max prob (1-p)": (1 - seq, "one pass"),
                 "first-token prob": (1 - first, "one pass"),
                 "mean token entropy": (ent, "one pass"),
                 f"self-consistency K={args.samples}": (1 - agree, k),
                 "naive entropy": (naive, k), "semantic entropy": (semantic, k)}
    print0(f"{len(test)} test problems, greedy accuracy {rec['correct'].mean():.1%} | one pass "
           f"{t1 - t0:.1f} s, {args.samples} samples each (T={args.temperature}) {t2 - t1:.1f} s")
    print0(f"{'detector (of a wrong answer)':<30}{'AUROC':>7}   95% CI{'acc@50%':>11}"
           f"{'acc@80%':>9}{'cost':>14}")
    curves, result = {}, {}
    for name, (score, cost) in detectors.items():
        a = ev.auroc(score, wrong)
        lo, hi = ev.bootstrap_ci(lambda i: ev.auroc(score[i], wrong[i]), len(score),
                                 args.bootstrap, args.seed)
        curves[name] = ev.accuracy_coverage(-score, rec["correct"])
        at = dict((round(c, 2), acc) for c, acc in ev.accuracy_coverage(-score, rec["correct"], 10))
        print0(f"{name:<30}{a:7.3f}  [{lo:.2f}, {hi:.2f}]{at.get(0.5, float('nan')):10.1%}"
               f"{at.get(0.8, float('nan')):9.1%}{cost:>14}")
        result[name] = dict(auroc=a, ci=(lo, hi))
    print0("semantic entropy clusters the samples by the number they spell; naive entropy by "
           "their exact tokens (a number written with other tokens counts as another answer)")
    path = svg_line_plot("accuracy_coverage", curves, title="accuracy vs coverage (abstain on the "
                         "least confident)", xlabel="coverage", ylabel="accuracy",
                         xlim=(0, 1), directory=args.plots)
    print0(terminal_plot(curves, xlim=(0, 1)))
    print0(f"plot: {path}")
    return result


# ----------------------------------------------------------------------------------------
# The command line: evaluate.py's model and task flags, and this experiment's own

KNOBS = [
    knob("--samples", 10, "K answers sampled per problem"),
    knob("--temperature", 1.0, "sampling temperature"),
]


def parse_args(argv=None):
    # evaluate.py's two shared groups, then this experiment's own knobs under "options"
    p = command_line("Wrong-answer detectors (max probability, entropy, self-consistency, "
                     "semantic entropy): AUROC and accuracy-coverage.",
                     dict([ev.COMMON_GROUP, ev.TASK_GROUP, (None, KNOBS)]))
    return ev.check_args(p.parse_args(argv))


def main(argv=None):
    return ev.run_timed(run, parse_args(argv), "uncertainty")


if __name__ == "__main__":
    run_cli(main)
