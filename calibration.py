"""
calibration.py -- is the model as sure as it is right? `python evaluate.py calibration`.

The experiment: the ECE (evaluate.ece), the Brier score and the NLL of the reference
answers, for two confidences of the greedy answer (its sequence probability and its first
token's), at T = 1 and at the temperature fitted on a dev split (evaluate.fit_temperature,
whose trade-offs evaluate.py's header states); accuracy is the same at every T. The
reliability diagram (accuracy per bin, T = 1 vs the fitted T) is drawn as SVG.

(The calibration *data* of quantization is another matter: calibrated.py.)
Split out of evaluate.py by concept (how sure, not how good); it uses evaluate.py's
metrics (ece, brier, nll, fit_temperature) and its task model.
"""
import time

import evaluate as ev
from plots import svg_bar_chart, terminal_bars
from plumbing import print0


def answer_nll(rec, temperature=1.0):
    """NLL of the reference answers, nats per problem (sum over its tokens)."""
    return ev.nll(rec["logits"], rec["labels"], temperature) * len(rec["labels"]) / len(rec["refs"])


def run(args, device):
    """`python evaluate.py calibration`: ECE, Brier and NLL at T = 1 and at the fitted T."""
    _, enc, _ = ev.load_base(args, device)
    model, _ = ev.task_model(args, enc, device)
    dev, test = ev.eval_problems(args)
    t0 = time.perf_counter()
    rec_dev = ev.answer_records(model, enc, dev, args.max_new)
    rec_test = ev.answer_records(model, enc, test, args.max_new)
    T = ev.fit_temperature(rec_dev["logits"], rec_dev["labels"])
    print0(f"task model {args.task_preset}: dev {len(dev)} / test {len(test)} held-out problems | "
           f"fitted T = {T:.3f} on dev (NLL {answer_nll(rec_dev):.4f} -> "
           f"{answer_nll(rec_dev, T):.4f} nats/answer) | {time.perf_counter() - t0:.1f} s")
    print0(f"test split, {args.bins} equal-width bins:")
    print0(f"{'confidence':<22}{'T':>7}{'accuracy':>10}{'mean conf':>11}{'ECE':>8}"
           f"{'Brier':>8}{'NLL':>9}")
    result = {}
    reliability = {}
    labels = None
    for temp in (1.0, T):
        seq, first, _ = ev.confidences(rec_test, temp)
        for kind, conf in (("sequence prob", seq), ("first-token prob", first)):
            e, bins = ev.ece(conf, rec_test["correct"], args.bins)
            b = ev.brier(conf, rec_test["correct"])
            n = answer_nll(rec_test, temp)
            print0(f"{kind:<22}{temp:7.3f}{rec_test['correct'].mean():10.1%}{conf.mean():11.3f}"
                   f"{e:8.4f}{b:8.4f}{n:9.4f}")
            result[f"{kind} T={temp:.3f}"] = dict(ece=e, brier=b, nll=n, conf=float(conf.mean()))
            if kind == "sequence prob":
                reliability[f"T={temp:.2f}"] = [0.0 if c == 0 else a for _, _, c, a, _ in bins]
                labels = [f"{lo:.2f}" for lo, _, _, _, _ in bins]
                counts = [c for _, _, c, _, _ in bins]
                print0(f"{'':<22}items per bin: {counts}")
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


if __name__ == "__main__":
    print(__doc__.strip())
    print("\ncalibration.py runs as `python evaluate.py calibration` (see its --help).")
