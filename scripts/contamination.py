"""
scripts/contamination.py -- has the model seen the test? A controlled experiment, by
hand (`python -m scripts.contamination`): fine-tune a copy of the task model with a known subset of
the held-out problems planted in its data
(`--planted` of them, `--repeats` times each), then measure

  (a) the inflation: accuracy on planted vs clean items -- what contamination does to a
      benchmark score;
  (b) an n-gram overlap detector between the training data and the test items (Brown et
      al. 2020 app. C: an item is dirty if any of its n-grams is in the training data, n
      chosen from the items' lengths -- on 6-10-token items GPT-3's usual 13 would be a
      whole-item match, named as such here): exact, but it needs the training data;
  (c) membership scores that need only the model: the loss and Min-K% Prob (Shi et al.
      2023: the mean log-probability of the k% least likely tokens, int(k% · n) of them as
      in their code), each scored by AUROC at telling planted from clean items.

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
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import print0, run_cli


# GPT-3 (Brown et al. 2020, app. C) took n per benchmark from its items: the 5th-percentile
# item length (in words there, tokens here), at most 13. On the arithmetic items (6-10
# tokens with the 512 BPE) that is n = 8; 13 would be longer than every item, so every item
# would be judged by the whole-item rule below. Measured (docs/evaluate.md): n <= 6 flags
# clean items too (a 6-gram such as "1=127\n" ends many sums), n = 7 and 8 flag exactly the
# planted ones.
NGRAM_CAP = 13


def ngram_size(lengths, cap=NGRAM_CAP):
    """--ngram 0: n = the 5th-percentile item length (floored), at most cap, at least 1."""
    return max(1, min(cap, int(np.percentile(lengths, 5))))


def ngram_overlap(train_seqs, items, n):
    """Per item, the fraction of its *distinct* n-grams found anywhere in the training
    sequences. An item shorter than n is judged by the whole-item rule: it is one n-gram,
    itself, found or not as a contiguous run of some training sequence."""
    if n < 1:
        raise UserError(f"--ngram must be at least 1, got {n}")
    # one index per n-gram length in use: n, and the length of every item shorter than n
    sizes = {min(n, len(it)) for it in items}
    index = {m: {tuple(s[i:i + m]) for s in train_seqs for i in range(len(s) - m + 1)}
             for m in sizes}
    out = []
    for it in items:
        m = min(n, len(it))
        # a set: an n-gram the item repeats counts once, the usual overlap (the share of
        # the item's n-gram *types* seen in training). Counting each occurrence instead
        # would weigh a repeated n-gram by its repeats; on the arithmetic items no n-gram
        # of n >= 3 repeats, so the two agree there (docs/evaluate.md).
        grams = {tuple(it[i:i + m]) for i in range(len(it) - m + 1)}
        out.append(sum(g in index[m] for g in grams) / len(grams))
    return np.array(out)


def example_ids(enc, problems):
    """Each problem's whole text (prompt, answer, terminator: data.format_example) as token
    ids: what the fine-tunes train on and what the detectors score."""
    return [enc.encode_ordinary(data.format_example(p)) for p in problems]


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
    pool = example_ids(enc, data.make_problems(args.ft_clean + args.planted, args.seed + 2,
                                               args.digits, args.ops, "train"))
    planted_rows = [s for s, p in zip(example_ids(enc, items), planted) if p]
    dirty = pool[:args.ft_clean] + planted_rows * args.repeats
    clean = pool[:args.ft_clean] + pool[args.ft_clean:] * args.repeats
    return planted, dirty, clean


def membership(model, enc, items, planted, args):
    """Accuracy on planted vs clean items, and the loss / Min-K% scores of every item's
    text (its first token is the context), Min-K% also by the other token-count rule."""
    answers = scores.greedy_answers(model, enc, items, args.max_new)
    right = np.array([data.score(enc.decode(a), p.answer) for a, p in zip(answers, items)])
    seqs = example_ids(enc, items)
    # s[:1] as context: the first token has nothing to be predicted from (Shi et al.'s
    # Llama prepends a BOS and so scores every token of the text; this tokenizer has none)
    lps = scores.continuation_logprobs(model, [(s[:1], s[1:]) for s in seqs])
    loss = np.array([-lp.mean().item() for lp in lps])
    mink = np.array([ev.min_k_prob(lp, args.min_k, args.min_k_rule) for lp in lps])
    row = dict(planted=right[planted].mean(), clean=right[~planted].mean(),
               auroc_loss=ev.auroc(-loss, planted), auroc_mink=ev.auroc(mink, planted))
    # the other rule's AUROC beside it: what the choice of rule moves (NaN where the floor
    # would select no token of some item)
    other = other_rule(args.min_k_rule)
    row["auroc_mink_other"] = float("nan")
    if all(ev.min_k_count(len(lp), args.min_k, other) > 0 for lp in lps):
        alt = np.array([ev.min_k_prob(lp, args.min_k, other) for lp in lps])
        row["auroc_mink_other"] = ev.auroc(alt, planted)
    row["inflation"] = row["planted"] - row["clean"]
    row["mink_ci"] = ev.bootstrap_ci(lambda i: ev.auroc(mink[i], planted[i]), len(mink),
                                  args.bootstrap, args.seed)
    return row, mink


def other_rule(rule):
    """The Min-K% token-count rule that is not `rule` (evaluate.MIN_K_RULES has two)."""
    return ev.MIN_K_RULES[1 - ev.MIN_K_RULES.index(rule)]


def check_min_k(args, enc, items):
    """Refuse, before any training, a --min-k whose rule selects no token of some item."""
    # the scored tokens of an item are its tokens less the first (membership's context)
    shortest = min(map(len, example_ids(enc, items))) - 1
    if ev.min_k_count(shortest, args.min_k, args.min_k_rule) == 0:
        raise UserError(f"--min-k {args.min_k:g} selects int({shortest} x {args.min_k / 100:g})"
                        f" = 0 of the {shortest} scored tokens of the shortest item (the floor "
                        f"rule of Shi et al.'s code); take --min-k "
                        f"{math.ceil(100 / max(shortest, 1))} or more, or --min-k-rule ceil")


def run(args, device):
    """`python -m scripts.contamination`: the controlled experiment, its table and plot."""
    dev, test = ev.eval_problems(args)
    items = dev + test
    if args.planted > len(items):
        raise UserError(f"--planted {args.planted} is more than the {len(items)} held-out problems "
                        f"(raise --eval-problems or plant fewer)")
    _, enc, _ = ev.task_base(args, device)
    check_min_k(args, enc, items)          # before the SFT and the fine-tunes, not after
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
    # the Min-K% column by --min-k-rule, the next by the other rule (floor = Shi et al.'s
    # int(n·k%) tokens, ceil = at least one): AUROCs, higher = planted items more likely
    other = other_rule(args.min_k_rule)
    print0(f"{'model':<18}{'planted acc':>12}{'clean acc':>11}{'inflation':>11}"
           f"{'AUROC loss':>12}{f'Min-{args.min_k:g}% {args.min_k_rule}':>16}{other:>7}")
    result = {}
    for name, m in models.items():
        row, mink = membership(m, enc, items, planted, args)
        print0(f"{name:<18}{row['planted']:12.1%}{row['clean']:11.1%}{row['inflation']:+11.1%}"
               f"{row['auroc_loss']:12.3f}{row['auroc_mink']:16.3f}"
               f"{row['auroc_mink_other']:7.3f}  (Min-K CI "
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
    item_seqs, train_seqs = example_ids(enc, items), example_ids(enc, sft_probs)
    lengths = [len(s) for s in item_seqs]
    n = args.ngram or ngram_size(lengths)
    how = "--ngram" if args.ngram else "the 5th-percentile item length, GPT-3 app. C's rule"
    whole = sum(length < n for length in lengths)
    # Named as what it is: an item shorter than n is matched whole or not at all, so at
    # n = 13 on 6-10-token items every "13-gram" check is a whole-item match
    print0(f"n-gram overlap with the training data, n = {n} ({how}); items are "
           f"{min(lengths)}-{max(lengths)} tokens; {whole} of {len(items)} shorter than n, "
           f"judged by the whole-item rule (found whole inside a training sequence); "
           f"overlap = share of an item's distinct n-grams found:")
    result = {"ngram n": n, "ngram whole-item": whole}
    corpora = (("contaminated data", train_seqs + dirty), ("clean data", train_seqs + clean))
    for name, corpus in corpora:
        score = ngram_overlap(corpus, item_seqs, n)
        # flagged: any n-gram found (GPT-3's "dirty" item), whatever the overlap fraction
        flagged = score > 0
        tp = int((flagged & planted).sum())
        precision = tp / flagged.sum() if flagged.any() else float("nan")
        recall = tp / planted.sum()
        print0(f"  {name:<18} flagged {int(flagged.sum()):4d} | precision {precision:.3f} | "
               f"recall {recall:.3f} | AUROC {ev.auroc(score, planted):.3f}")
        result[f"ngram {name}"] = dict(flagged=int(flagged.sum()), precision=precision,
                                       recall=recall)
    return result


# ----------------------------------------------------------------------------------------
# The command line: evaluate.py's model and task flags, and this experiment's own

KNOBS = [
    knob("--planted", 100, "held-out items planted"),
    knob("--repeats", 16, "copies of each planted item"),
    knob("--ft-clean", 3000, "clean training rows in the fine-tune"),
    knob("--ft-batch", 32, "fine-tune rows per step"),
    knob("--ft-lr", 1e-3, "fine-tune peak learning rate"),
    knob("--ngram", 0, "n of the n-gram overlap detector; 0 = the 5th-percentile item length "
         "in tokens, at most 13 (GPT-3's rule: 8 on the 2-digit sums)"),
    knob("--min-k", 20.0, "k of Min-K%% Prob (percent)"),
    knob("--min-k-rule", "floor", "tokens Min-K%% averages: floor = int(n·k%%), Shi et al.'s "
         "code (none selected: refused); ceil = max(1, ceil(n·k%%))", choices=ev.MIN_K_RULES),
]


def parse_args(argv=None):
    # evaluate.py's two shared groups, then this experiment's own knobs under "options"
    p = command_line("Contamination: plant held-out items in a fine-tune, measure the inflation, "
                     "detect it by n-gram overlap and by Min-K% Prob.",
                     dict([ev.COMMON_GROUP, ev.TASK_GROUP, (None, KNOBS)]))
    return ev.check_args(p.parse_args(argv))


def main(argv=None):
    return ev.run_timed(run, parse_args(argv), "contamination")


if __name__ == "__main__":
    run_cli(main)
