"""
scripts/calibration.py -- is the model as sure as it is right?

    python -m scripts.calibration [--bins 10] [--sft-steps 800]

The experiment: the ECE (evaluate.ece; bins (lo, hi] as in Guo et al.'s code, or
torchmetrics' [lo, hi) with --ece-bins left, the other's ECE printed beside it), the Brier
score and the NLL of the reference
answers, for two confidences of the greedy answer (its sequence probability and its first
token's), at T = 1 and at the temperature fitted on a dev split (evaluate.fit_temperature,
whose trade-offs evaluate.py's header states); accuracy is the same at every T. The
reliability diagram (accuracy per bin, T = 1 vs the fitted T) is drawn as SVG.

(The calibration *data* of quantization is another matter: compression/calibrated.py.)
An entry point in scripts/ (nothing imports it): an experiment built on evaluate.py -- its metrics
(ece,
brier, nll, fit_temperature), its flags and its task model -- that asks how sure, not
how good.
"""
import time

import numpy as np

import evaluate as ev
from core.plots import svg_bar_chart, terminal_bars
from core.cli import command_line, knob
from core.runtime import print0, run_cli


# what each --ece-bins value means, as the output and --help say it (evaluate.ECE_BINS has
# the references: Guo et al.'s code for right, torchmetrics' calibration_error for left)
BIN_RULES = {"right": "(lo, hi], 0 in the first (Guo et al.'s code)",
             "left": "[lo, hi), 1.0 in a bin of its own (torchmetrics)"}


def answer_nll(rec, temperature=1.0):
    """NLL of the reference answers, nats per problem (sum over its tokens)."""
    return ev.nll(rec["logits"], rec["labels"], temperature) * len(rec["labels"]) / len(rec["refs"])


def run(args, device):
    """`python -m scripts.calibration`: ECE, Brier and NLL at T = 1 and at the fitted T."""
    _, enc, _ = ev.task_base(args, device)
    model, _ = ev.task_model(args, enc, device)
    dev, test = ev.eval_problems(args)
    t0 = time.perf_counter()
    rec_dev = ev.answer_records(model, enc, dev, args.max_new)
    rec_test = ev.answer_records(model, enc, test, args.max_new)
    T = ev.fit_temperature(rec_dev["logits"], rec_dev["labels"])
    print0(f"task model {args.task_preset}: dev {len(dev)} / test {len(test)} held-out problems | "
           f"fitted T = {T:.3f} on dev (NLL {answer_nll(rec_dev):.4f} -> "
           f"{answer_nll(rec_dev, T):.4f} nats/answer) | {time.perf_counter() - t0:.1f} s")
    # the binning convention said in the output: the two differ only on confidences exactly
    # at an edge, and a float32 probability is often exactly 1.0 (evaluate.ECE_BINS)
    other = [c for c in ev.ECE_BINS if c != args.ece_bins][0]
    print0(f"test split, {args.bins} equal-width bins {BIN_RULES[args.ece_bins]} "
           f"(--ece-bins {args.ece_bins}); 'ECE {other}': {BIN_RULES[other]}")
    print0(f"{'confidence':<22}{'T':>7}{'accuracy':>10}{'mean conf':>11}{'ECE':>8}"
           f"{'Brier':>8}{'NLL':>9}{f'ECE {other}':>11}")
    result = {}
    reliability = {}
    labels = None
    for temp in (1.0, T):
        seq, first, _ = ev.confidences(rec_test, temp)
        for kind, conf in (("sequence prob", seq), ("first-token prob", first)):
            # float32: what the model computed them in (evaluate.confidences takes .item() of
            # float32 tensors, so the cast is exact), binned on float32 edges as the
            # references bin a float32 softmax
            c32 = conf.astype(np.float32)
            e, bins = ev.ece(c32, rec_test["correct"], args.bins, args.ece_bins)
            e_other = ev.ece(c32, rec_test["correct"], args.bins, other)[0]
            b = ev.brier(conf, rec_test["correct"])
            n = answer_nll(rec_test, temp)
            print0(f"{kind:<22}{temp:7.3f}{rec_test['correct'].mean():10.1%}{conf.mean():11.3f}"
                   f"{e:8.4f}{b:8.4f}{n:9.4f}{e_other:11.4f}")
            result[f"{kind} T={temp:.3f}"] = dict(ece=e, brier=b, nll=n, conf=float(conf.mean()),
                                                  ece_other=e_other)
            if kind == "sequence prob":
                reliability[f"T={temp:.2f}"] = [0.0 if c == 0 else a for _, _, c, a, _ in bins]
                labels = [f"{lo:.2f}" for lo, _, _, _, _ in bins]
                counts = [c for _, _, c, _, _ in bins]
                print0(f"{'':<22}items per bin: {counts}")
            # where the two conventions can part: confidences exactly on an edge above 0 (the
            # bins' own float32 edges; 0 is in the first bin either way), 1.0 the common one
            edges = np.array([lo for lo, *_ in bins[1:]] + [1.0], dtype=np.float32)
            print0(f"{'':<22}on an edge: {int(np.isin(c32, edges).sum())} of {len(c32)} "
                   f"({int((c32 == 1.0).sum())} exactly 1.0)")
            result[f"{kind} T={temp:.3f}"]["on_edge"] = int(np.isin(c32, edges).sum())
    print0("NLL = of the reference answer (what T minimises); accuracy is the same at every T: "
           "greedy answers do not depend on it.")
    path = svg_bar_chart("reliability", labels, reliability, diagonal=True, ymax=1.0,
                         title=f"reliability (sequence prob, test): accuracy per bin, "
                               f"T=1 vs T={T:.2f}",
                         xlabel="confidence bin (start)", ylabel="accuracy", directory=args.plots)
    print0(terminal_bars(labels, reliability, width=30, vmax=1.0))
    print0(f"plot: {path}")
    result["T"] = T
    return result


# ----------------------------------------------------------------------------------------
# The command line: evaluate.py's model and task flags, and this experiment's own

KNOBS = [
    knob("--bins", 10, "equal-width confidence bins"),
    knob("--ece-bins", "right", f"which side of a bin is closed: right = {BIN_RULES['right']}; "
         f"left = {BIN_RULES['left']}", choices=ev.ECE_BINS),
]


def parse_args(argv=None):
    # evaluate.py's two shared groups, then this experiment's own knobs under "options"
    p = command_line("Calibration of the task model: ECE, Brier, NLL and the reliability diagram, "
                     "at T = 1 and after temperature scaling.",
                     dict([ev.COMMON_GROUP, ev.TASK_GROUP, (None, KNOBS)]))
    return ev.check_args(p.parse_args(argv))


def main(argv=None):
    return ev.run_timed(run, parse_args(argv), "calibration")


if __name__ == "__main__":
    run_cli(main)
