"""
scripts/contamination.py -- has the model seen the test? A controlled experiment, by
hand (`python -m scripts.contamination`): fine-tune a copy of the task model with a known subset of
the held-out problems planted in its data
(`--planted` of them, `--repeats` times each), then measure

  (a) the inflation: accuracy on planted vs clean items -- what contamination does to a
      benchmark score;
  (b) an n-gram overlap detector between the training data and the test items (GPT-3's
      13-gram rule, Brown et al. 2020 app. C; shorter for short items): exact, but it needs
      the training data;
  (c) membership scores that need only the model: the loss and Min-K% Prob (Shi et al.
      2023: the mean log-probability of the k% least likely tokens), each scored by AUROC
      at telling planted from clean items.

A control fine-tune repeats train problems instead, so what (c) detects is memorisation of
the planted items, not fine-tuning itself. An entry point in scripts/ (nothing imports it): a
data experiment built on evaluate.py's metrics, flags and models.
"""
import copy
import math
import random
import time

import numpy as np

from core import data
import evaluate as ev
from core import scores
from core.plots import svg_bar_chart, terminal_bars
from core.plumbing import ArgumentParser, HelpFormatter, UserError, print0, run_cli


def ngram_overlap(train_seqs, items, n):
    """Per item, the fraction of its n-grams found anywhere in the training sequences; an
    item shorter than n is one n-gram, itself (GPT-3 app. C: shorter n for short items)."""
    if n < 1:
        raise UserError(f"--ngram must be at least 1, got {n}")
    sizes = {min(n, len(it)) for it in items}
    index = {m: {tuple(s[i:i + m]) for s in train_seqs for i in range(len(s) - m + 1)}
             for m in sizes}
    out = []
    for it in items:
        m = min(n, len(it))
        grams = [tuple(it[i:i + m]) for i in range(len(it) - m + 1)]
        out.append(sum(g in index[m] for g in grams) / len(grams))
    return np.array(out)


def finetune_copy(model, seqs, args, label, device):
    """A copy of model trained one epoch over seqs (shuffled), args.ft_batch rows a step:
    every sequence, planted or not, is seen exactly as often as it is listed."""
    order = np.random.default_rng([args.seed, 13]).permutation(len(seqs))
    rows = [seqs[i] for i in order]
    steps, b = math.ceil(len(rows) / args.ft_batch), args.ft_batch
    batch = lambda s: ev.text_batch(rows[s * b:(s + 1) * b], device)
    return ev.adam_steps(copy.deepcopy(model), batch, steps, args.ft_lr, label, max(1, steps // 2))


def planted_data(args, enc, items):
    """-> (planted mask over items, contaminated fine-tune rows, control rows). Same recipe
    twice: ft_clean train problems + `planted` problems repeated `repeats` times; in the
    contaminated data the repeated ones are held-out items, in the control train problems."""
    planted = np.zeros(len(items), dtype=bool)
    planted[random.Random(args.seed + 5).sample(range(len(items)), args.planted)] = True
    encode = lambda probs: [enc.encode_ordinary(data.format_example(p)) for p in probs]
    pool = encode(data.make_problems(args.ft_clean + args.planted, args.seed + 2, args.digits,
                                     args.ops, "train"))
    dirty = pool[:args.ft_clean] + [s for s, p in zip(encode(items), planted) if p] * args.repeats
    clean = pool[:args.ft_clean] + pool[args.ft_clean:] * args.repeats
    return planted, dirty, clean


def membership(model, enc, items, planted, args):
    """Accuracy on planted vs clean items, and the loss / Min-K% scores of every item's
    text (its first token is the context)."""
    answers = scores.greedy_answers(model, enc, items, args.max_new)
    right = np.array([data.score(enc.decode(a), p.answer) for a, p in zip(answers, items)])
    seqs = [enc.encode_ordinary(data.format_example(p)) for p in items]
    lps = scores.continuation_logprobs(model, [(s[:1], s[1:]) for s in seqs])
    loss = np.array([-lp.mean().item() for lp in lps])
    mink = np.array([ev.min_k_prob(lp, args.min_k) for lp in lps])
    row = dict(planted=right[planted].mean(), clean=right[~planted].mean(),
               auroc_loss=ev.auroc(-loss, planted), auroc_mink=ev.auroc(mink, planted))
    row["inflation"] = row["planted"] - row["clean"]
    row["mink_ci"] = ev.bootstrap_ci(lambda i: ev.auroc(mink[i], planted[i]), len(mink),
                                  args.bootstrap, args.seed)
    return row, mink


def run(args, device):
    """`python -m scripts.contamination`: the controlled experiment, its table and plot."""
    dev, test = ev.eval_problems(args)
    items = dev + test
    if args.planted > len(items):
        raise UserError(f"--planted {args.planted} is more than the {len(items)} held-out problems "
                        f"(raise --eval-problems or plant fewer)")
    _, enc, _ = ev.load_base(args, device)
    model, sft_probs = ev.task_model(args, enc, device)
    planted, dirty, clean = planted_data(args, enc, items)
    print0(f"{len(items)} held-out items, {args.planted} planted {args.repeats}x among "
           f"{args.ft_clean} clean rows ({1 - args.ft_clean / len(dirty):.1%} of the fine-tune); "
           f"the control repeats {args.planted} train problems instead")
    t0 = time.perf_counter()
    models = {"before fine-tune": model,
              "contaminated": finetune_copy(model, dirty, args, "contaminated", device),
              "control (clean)": finetune_copy(model, clean, args, "control", device)}
    print0(f"two fine-tunes in {time.perf_counter() - t0:.1f} s")
    print0(f"{'model':<18}{'planted acc':>12}{'clean acc':>11}{'inflation':>11}"
           f"{'AUROC loss':>12}{f'Min-{args.min_k:g}%':>10}")
    result = {}
    for name, m in models.items():
        row, mink = membership(m, enc, items, planted, args)
        print0(f"{name:<18}{row['planted']:12.1%}{row['clean']:11.1%}{row['inflation']:+11.1%}"
               f"{row['auroc_loss']:12.3f}{row['auroc_mink']:10.3f}  (Min-K CI "
               f"[{row['mink_ci'][0]:.2f}, {row['mink_ci'][1]:.2f}])")
        result[name] = row
        if name == "contaminated":
            edges = np.linspace(mink.min(), mink.max() + 1e-9, 13)
            hist = {label: (np.histogram(mink[sel], edges)[0] / max(sel.sum(), 1)).tolist()
                    for label, sel in (("planted", planted), ("clean", ~planted))}
    result.update(report_ngrams(args, enc, sft_probs, items, planted, dirty, clean))
    labels = [f"{e:.2f}" for e in edges[:-1]]
    path = svg_bar_chart("contamination_mink", labels, hist, xlabel=f"Min-{args.min_k:g}% log-prob",
                         title="Min-K% Prob of held-out items, contaminated model",
                         ylabel="fraction of items", directory=args.plots)
    print0(terminal_bars(labels, hist, width=30))
    print0(f"plot: {path}")
    return result


def report_ngrams(args, enc, sft_probs, items, planted, dirty, clean):
    """The n-gram detector against everything each model was trained on (SFT + fine-tune)."""
    item_seqs = [enc.encode_ordinary(data.format_example(p)) for p in items]
    train_seqs = [enc.encode_ordinary(data.format_example(p)) for p in sft_probs]
    print0(f"n-gram overlap with the training data (n={args.ngram}; items are "
           f"{min(map(len, item_seqs))}-{max(map(len, item_seqs))} tokens, a shorter item is "
           f"one n-gram: itself):")
    result = {}
    corpora = (("contaminated data", train_seqs + dirty), ("clean data", train_seqs + clean))
    for name, corpus in corpora:
        score = ngram_overlap(corpus, item_seqs, args.ngram)
        flagged = score > 0
        tp = int((flagged & planted).sum())
        precision = tp / flagged.sum() if flagged.any() else float("nan")
        recall = tp / planted.sum()
        print0(f"  {name:<18} flagged {int(flagged.sum()):4d} | precision {precision:.3f} | "
               f"recall {recall:.3f} | AUROC {ev.auroc(score, planted):.3f}")
        result[f"ngram {name}"] = dict(flagged=int(flagged.sum()), precision=precision,
                                       recall=recall)
    return result


def parse_args(argv=None):
    common, task = ev.parent_parsers()
    p = ArgumentParser(description=(
        "Contamination: plant held-out items in a fine-tune, measure the inflation, "
        "detect it by n-gram overlap and by Min-K%% Prob."
    ), parents=[common, task], formatter_class=HelpFormatter)
    p.add_argument("--planted", type=int, default=100, help="held-out items planted")
    p.add_argument("--repeats", type=int, default=16, help="copies of each planted item")
    p.add_argument("--ft-clean", type=int, default=3000,
                   help="clean training rows in the fine-tune")
    p.add_argument("--ft-batch", type=int, default=32, help="fine-tune rows per step")
    p.add_argument("--ft-lr", type=float, default=1e-3, help="fine-tune peak learning rate")
    p.add_argument("--ngram", type=int, default=13, help="n of the n-gram overlap detector")
    p.add_argument("--min-k", type=float, default=20.0, help="k of Min-K%% Prob (percent)")
    return ev.check_args(p.parse_args(argv))


def main(argv=None):
    return ev.run_timed(run, parse_args(argv), "contamination")


if __name__ == "__main__":
    run_cli(main)
