"""
evaluate.py -- how good is the model, how sure is it, when is it wrong, and has it seen
the test: every number computed by hand and checked on cases with known answers.

Run:  python evaluate.py ppl             # val loss, perplexity, bits/byte, bootstrap CIs
      python evaluate.py task            # generative exact match vs log-likelihood ranking
      python -m scripts.calibration     # ECE, reliability diagram, temperature scaling
      python -m scripts.uncertainty     # wrong-answer detectors: AUROC, accuracy-coverage
      python -m scripts.contamination   # plant test items in a fine-tune, then detect them

What it teaches, and what each technique costs:
  - Perplexity exp(loss) depends on the tokenizer (a bigger vocabulary packs more bytes
    into a token, so its loss per token is higher for the same text). Bits per byte =
    total NLL / (ln 2 · bytes of text) does not: it compares any two models on the same
    text. Costs one forward over the text; confidence intervals by bootstrap over windows
    (Efron 1979) cost only resampling.
  - Two ways harnesses score a model: generate greedily and compare the string (exact
    match), or rank given candidate answers by their log-likelihood (lm-evaluation-
    harness's multiple-choice tasks; acc_norm divides by the answer's bytes). Ranking needs
    one teacher-forced pass per candidate (the prompt's KV cache computed once and copied to
    every candidate row saves re-encoding it) and never samples, but it only asks the
    model to prefer the right answer among a few: its accuracy sits above generation's and
    above chance (1/choices) even for a model that cannot write the answer.
  - Calibration (scripts/calibration.py; Guo et al. 2017): expected calibration error over
    equal-width confidence bins, ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|, bins (lo, hi]
    as in Guo et al.'s code or torchmetrics' [lo, hi) with 1.0 apart (ece's closed); temperature
    scaling divides every logit by one T > 0 fitted on a dev split to minimise the NLL of
    the reference answers. It costs nothing at inference, never changes the greedy answer
    (argmax is invariant to T), and fixes only a global over/under-confidence.
  - Uncertainty (scripts/uncertainty.py): which signals, free (one pass) or costing K samples,
    detect a wrong answer, each scored by AUROC (Mann-Whitney U with ties, here) and by
    the accuracy-coverage curve of abstaining on the least confident.
  - Contamination (scripts/contamination.py): plant test problems in a fine-tune, measure the
    accuracy inflation, and detect them by n-gram overlap, loss and Min-K% Prob (here; its
    token count by the floor of Shi et al.'s code, or at least one token by ceil).
The arithmetic-task accuracy of a Python-trained LM is near zero, so the task modes train a
task model first (SFT on core/data.py's format_example texts, cached under out/evaluate/), on
the tokenizer of a tiny LM trained here -- not the demo's out/ckpt.pt unless --checkpoint
names it: the task figures depend on how the tokenizer spells numbers (task_base).
Imports only the shared modules. The metrics lora.py, rl.py and train.py report
(exact_match, answer_loss, greedy_answers, validation_loss) live in core/scores.py, which
this file imports too, so it imports none of those scripts.
"""
import hashlib
import math
import os
import random
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F

from core import data
from core.scores import continuation_logprobs, greedy_answers, prompt_ids
from core.checkpoint import load_model
from model import GPT, GPTConfig, PRESETS, get_config
from core.plots import svg_bar_chart, terminal_bars
from core.cli import ArgumentParser, HelpFormatter, add_knobs, knob
from core.errors import UserError
from core.files import atomic_save, load_checkpoint
from core.runtime import print0, run_cli, seed_everything, TimingConditions

# train.py's default output: what ppl measures when --checkpoint is not given (the task
# modes do not read it: task_base)
DEFAULT_CKPT = os.path.join("out", "ckpt.pt")
# the tiny base LM and the task models trained here are cached in it, keyed by what
# shaped them (delete it and the next run retrains)
OUT_DIR = os.path.join("out", "evaluate")


# ----------------------------------------------------------------------------------------
# The metrics, by hand

# Which side of a bin is closed. "right": (lo, hi], a confidence on an edge goes to the bin
# below it and 0 to the first bin -- the rule of Guo et al. 2017's code (gpleiss/
# temperature_scaling's _ECELoss: conf > lo and conf <= hi; it counts a confidence of 0 in
# no bin, which a softmax maximum never is) and of torchmetrics' old loop. "left": [lo, hi)
# and a bin of its own for exactly 1.0 -- torchmetrics' calibration_error today
# (torch.bucketize(conf, linspace(0, 1, n + 1), right=True) - 1 over n + 1 bins). They
# differ only on confidences exactly at an edge; in float32 a sure answer's probability
# often is exactly 1.0 (docs/evaluate.md measures how far the two ECEs part).
ECE_BINS = ("right", "left")


def ece(conf, correct, n_bins=15, closed="right"):
    """Expected calibration error over n_bins equal-width bins. closed="right": bins (lo, hi],
    the first also holding 0; "left": torchmetrics' [lo, hi), plus a last bin [1, 1] for
    exactly 1.0 (see ECE_BINS). -> (ece, bins), bins = [(lo, hi, count, accuracy, mean conf)]."""
    if n_bins < 1:
        raise UserError(f"the bin count must be at least 1, got {n_bins}")
    if closed not in ECE_BINS:
        raise UserError(f"ECE bins closed on the 'right' or the 'left', got {closed!r}")
    conf = np.asarray(conf)
    # The edges in the confidences' own precision, as both references build them (torch.
    # linspace, float32 for a float32 softmax): a float32 0.7 is below 0.7 in float64 but
    # on the edge in float32, so float64 edges would put it in another bin than theirs.
    # Anything else (lists, float64) is binned in float64; the sums below are float64.
    dtype = torch.float32 if conf.dtype == np.float32 else torch.float64
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=dtype).numpy()
    conf = conf.astype(edges.dtype)
    correct = np.asarray(correct, dtype=np.float64)
    if closed == "right":
        # Only the n_bins - 1 interior edges are searched: side="left" puts a confidence
        # equal to an edge in the bin below it, c = 0 (below every edge) in bin 0 and c = 1
        # in the last; a value outside [0, 1] would land in an end bin rather than vanish.
        which = np.searchsorted(edges[1:-1], conf, side="left")   # edges[i-1] < c <= edges[i]
        spans = list(zip(edges[:-1], edges[1:]))
    else:
        # side="right" is torch.bucketize's right=True: edges[i-1] <= c < edges[i] gives i,
        # minus 1 the bin; c = 1.0 is past the last edge, bin n_bins, the one of its own.
        # Clipped, so a value outside [0, 1] lands in an end bin as above (torchmetrics'
        # scatter_add would fail on it instead).
        which = np.clip(np.searchsorted(edges, conf, side="right") - 1, 0, n_bins)
        spans = list(zip(edges[:-1], edges[1:])) + [(1.0, 1.0)]
    total, bins = 0.0, []
    for b, (lo, hi) in enumerate(spans):
        inside = which == b
        count = int(inside.sum())
        # an empty bin reports NaN (no data), not 0: an accuracy of 0 would read as a bin
        # that is confidently wrong
        acc = float(correct[inside].mean()) if count else float("nan")
        mean_conf = float(conf[inside].astype(np.float64).mean()) if count else float("nan")
        if count:
            # |B_b|/n · |acc(B_b) - conf(B_b)|: weighted by the bin's share of the items,
            # so a sparse bin barely moves the ECE. More bins with fewer items each bias
            # ECE upward (|noise| is > 0 on average); 15 is Guo et al. 2017's choice.
            total += count / len(conf) * abs(acc - mean_conf)
        bins.append((float(lo), float(hi), count, acc, mean_conf))
    return total, bins


def brier(conf, correct):
    """Mean squared error of a probability against the 0/1 outcome (Brier 1950)."""
    # Unlike ECE it needs no bins, and it rewards sharpness as well as calibration: a
    # model that always says 0.5 on a 50%-right task is calibrated but scores 0.25.
    conf = np.asarray(conf, dtype=np.float64)
    return float(((conf - np.asarray(correct, dtype=np.float64)) ** 2).mean())


def nll(logits, labels, temperature=1.0):
    """Mean −log softmax(logits / T)[label] over rows: the NLL temperature scaling fits."""
    # float64: the test compares the NLL at the fitted T with the NLL at the true T to
    # within 1e-12, far below float32's rounding of a loss near 1
    return F.cross_entropy(logits.double() / temperature, labels).item()


def auroc(scores, labels):
    """P(score of a positive > score of a negative) + ½ P(tie), from the ranks
    (Mann-Whitney U / n₊n₋, tied scores sharing their mean rank). NaN without both."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Any sort makes equal scores contiguous, which is all the tie loop needs; mergesort
    # (stable) just makes the order within a run reproducible.
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):                 # a run of ties gets the mean of its ranks
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1      # 1-based ranks i+1 .. j+1, averaged
        i = j + 1
    # U = R₊ - n₊(n₊+1)/2: the positives' rank sum minus its minimum (every positive
    # below every negative) counts the (positive, negative) pairs the positive wins, a
    # tie counting ½ through the mean rank. O(n log n), where the test's reference loops
    # over all n₊·n₋ pairs.
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def bootstrap_ci(stat, n, n_boot=1000, seed=0, level=0.95):
    """Percentile bootstrap: stat(indices) on n_boot resamples of range(n) with
    replacement. -> (low, high). Items are the unit (windows, problems), not tokens."""
    rng = np.random.default_rng(seed)
    # each resample: n indices with replacement, stat recomputed on those items. The
    # cost is n_boot calls of stat on numbers already computed: no model forward.
    values = [stat(rng.integers(0, n, n)) for _ in range(n_boot)]
    values = [v for v in values if v == v]      # AUROC of a resample with one class: NaN
    if not values:
        return float("nan"), float("nan")
    # level 0.95 -> the 2.5th and 97.5th percentiles: the plain percentile interval, no
    # bias correction (BCa), adequate for means over hundreds of items. Each end rests on
    # the 2.5% most extreme resamples: lower --bootstrap and the ends get noisy.
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def fit_temperature(logits, labels, iters=50):
    """argmin_T NLL(logits / T) by Newton's method on β = 1/T: NLL(β) = mean(logsumexp(βz)
    − β z_y) is convex in β, with gradient mean(E_p[z] − z_y) and curvature mean(Var_p[z])
    (p = softmax(βz)), so Newton converges from β = 1 in a few steps; a step that would
    raise the NLL or make β ≤ 0 is halved. -> T, clamped to [0.01, 100]."""
    # Why β = 1/T and not T: logsumexp(βz) is convex in β (logsumexp of a linear map of
    # β), so every local minimum of the NLL is the global one and the curvature is >= 0;
    # as a function of T it need not be convex, and Newton on T has no such guarantee.
    z = logits.double()
    z_y = z.gather(1, labels[:, None])[:, 0]      # each row's logit of its label
    # one (N, V) logsumexp per call; the backtracking below calls it twice per halving,
    # fine for the thousands of answer tokens it is fitted on
    loss = lambda b: (torch.logsumexp(b * z, -1) - b * z_y).mean().item()
    beta = 1.0
    for _ in range(iters):
        p = torch.softmax(beta * z, -1)
        # E_p[z] per row, then Var_p[z] = E_p[z²] - E_p[z]²: the derivatives of
        # logsumexp(βz) in β are exactly these two moments under p = softmax(βz)
        mean_z = (p * z).sum(-1)
        grad = (mean_z - z_y).mean().item()
        curv = ((p * z * z).sum(-1) - mean_z ** 2).mean().item()
        # rows whose logits are all equal have Var 0 (a flat NLL): the floor avoids 0/0
        step = grad / max(curv, 1e-12)
        for _ in range(60):                 # backtrack: stay positive, never go uphill
            if beta - step > 0 and loss(beta - step) <= loss(beta) + 1e-15:
                break
            step /= 2
        # converged (a step negligible next to β), or β > 100, i.e. T < 0.01: softmax is
        # then an argmax and the clamp below decides
        if abs(step) < 1e-10 * beta or beta > 100:
            beta -= step
            break
        beta -= step
    return min(max(1 / beta, 0.01), 100.0)


def accuracy_coverage(conf, correct, levels=20):
    """Answer only the most confident fraction c of the questions (abstain on the rest):
    -> [(c, accuracy of those answered)] for c = 1/levels .. 1. Ties keep item order."""
    # most confident first; mergesort is stable, which is the "ties keep item order"
    order = np.argsort(-np.asarray(conf, dtype=np.float64), kind="mergesort")
    correct = np.asarray(correct, dtype=np.float64)[order]
    out = []
    for i in range(1, levels + 1):
        # the k most confident answered: ceil, and at least 1, so a point never averages
        # zero items when n < levels; i = levels answers all n (plain accuracy). A useful
        # confidence makes the curve fall from left to right.
        k = max(1, math.ceil(i / levels * len(correct)))
        out.append((k / len(correct), float(correct[:k].mean())))
    return out


def entropy(counts):
    """Shannon entropy in nats of the distribution counts / sum(counts); zero counts are
    dropped (0·log 0 = 0, where numpy would give NaN). scripts/uncertainty.py's semantic
    entropy feeds it the number of samples per answer cluster."""
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


# How many of n tokens Min-K% Prob averages. "floor": int(n · k/100), Shi et al.'s released
# code (swj0419/detect-pretrain-code, src/run.py: k_length = int(len(all_prob) * ratio)) --
# the float product as they write it, so k = 29 of 100 tokens is 28 there and here. It can
# select no token (k% · n < 1), where their np.mean of nothing gives NaN; here that is
# refused (UserError), an AUROC over NaN scores being no score. "ceil": max(1, ceil(n ·
# k/100)), this repo's earlier rule: never zero, and a 3-token answer at k = 20% averages one
# token. They differ whenever k% · n is not whole; on the arithmetic items (5-9 scored
# tokens) at k = 20 the floor averages the single lowest token, the ceil the two lowest of 6+.
MIN_K_RULES = ("floor", "ceil")


def min_k_count(n, k_percent, rule="floor"):
    """The number of lowest log-probs Min-K% Prob averages over n tokens (MIN_K_RULES)."""
    if rule not in MIN_K_RULES:
        raise UserError(f"the Min-K% rule is 'floor' or 'ceil', got {rule!r}")
    if rule == "floor":
        return int(n * (k_percent / 100))          # k_percent / 100: their `ratio`, 0.2 for 20
    return max(1, math.ceil(n * k_percent / 100))


def min_k_prob(logprobs, k_percent=20.0, rule="floor"):
    """Min-K% Prob (Shi et al. 2023): the mean of the k% lowest token log-probs, k% of n
    counted by `rule` (min_k_count; floor: Shi et al.'s code). Zero tokens: UserError."""
    # Shi et al.'s argument: a text seen in training has few very unlikely tokens, so the
    # mean of its lowest k% log-probs is higher (less negative) than an unseen text's; a
    # mean over all tokens would be dominated by the easy ones. Higher = more likely seen
    # (their code stores the negative, -mean, and ranks by its negative again: the same order).
    n = len(logprobs)
    if n == 0:
        raise UserError("Min-K% Prob of a text with no scored token is undefined")
    k = min_k_count(n, k_percent, rule)
    if k == 0:
        raise UserError(f"Min-{k_percent:g}% of a {n}-token text is int({n} x "
                        f"{k_percent / 100:g}) = 0 tokens (the floor rule of Shi et al.'s "
                        f"code); raise --min-k to {math.ceil(100 / n)} or more, or take "
                        "--min-k-rule ceil (at least one token)")
    # float64: their log-probs are Python floats (float64), so the mean is taken at that
    # precision; ascending sort, the first k are the k lowest
    return float(torch.sort(logprobs.double()).values[:k].mean())


# ----------------------------------------------------------------------------------------
# Log-likelihood of continuations (continuation_logprobs: one prefill per context, its KV
# cache reused across candidates) and the shared answer scores live in core/scores.py,
# imported above: train.py, lora.py and rl.py report the same numbers without this file.

def token_byte_lengths(enc):
    """UTF-8 bytes each token id stands for; special tokens (<|endoftext|>) count 0."""
    # _special_tokens: tiktoken's private {str: id} dict (core/data.py's encoding_to_state
    # reads the same attribute). <|endoftext|> stands for no text, so it counts 0 bytes.
    # Byte-level BPE is lossless: the bytes of a text's tokens concatenate to its UTF-8,
    # so summing this table over the targets gives the text's exact byte count (tested).
    special = set(enc._special_tokens.values())
    return np.array([0 if t in special else len(enc.decode_single_token_bytes(t))
                     for t in range(enc.n_vocab)], dtype=np.int64)


@torch.no_grad()
def window_nll(model, ids, seq_len, batch_size=8):
    """Non-overlapping windows of seq_len predictions over ids (each token after the first
    predicted once, from the window's start). -> (NLL sum, targets) per window."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < 2:
        raise UserError(f"need at least 2 tokens to score, got {len(ids)}")
    # Stride = seq_len, no overlap: one forward per seq_len tokens, but a token near a
    # window's start sees little context, so the loss reads higher than a sliding window
    # with a short stride would give (at seq_len/stride times the forwards).
    starts = list(range(0, len(ids) - 1, seq_len))
    device = model.output.weight.device
    sums = []                                  # NLL sum per window
    targets = []                               # the tokens each window predicts
    for s in range(0, len(starts), batch_size):
        # seq_len + 1 ids per window: seq_len inputs and, shifted by one, seq_len targets
        part = [ids[b:b + seq_len + 1] for b in starts[s:s + batch_size]]
        x, y = text_batch([w.tolist() for w in part], device)      # the last one is shorter
        # .float(): the cross-entropy in float32 whatever the model's dtype (bf16 keeps 8
        # bits of mantissa). reduction="none" + ignore_index=-1: padding adds exactly 0
        # to its window's sum. Memory: batch · seq_len · V logits at once.
        loss = F.cross_entropy(model(x)[0].flatten(0, 1).float(), y.flatten(),
                               ignore_index=-1, reduction="none").view(y.shape)
        # totals across windows are kept in float64 on the CPU
        sums += loss.sum(1).double().cpu().tolist()
        targets += [w[1:] for w in part]
    return np.array(sums), targets


def bits_per_byte(nll_nats, n_bytes):
    """nats -> bits (÷ ln 2), per UTF-8 byte of text: independent of the tokenizer, so
    models with different vocabularies compare on the same text."""
    return nll_nats / (math.log(2) * n_bytes)


def text_bits_per_byte(model, enc, text, seq_len=None):
    """Bits per byte of a text: <|endoftext|> first, so every token of the text is
    predicted and the bytes are exactly len(text.encode())."""
    # EOT is context only, never a target: it is the separator that begins every document
    # in training (core/data.py joins documents with it), so the first real token is
    # predicted as at a document start, and the targets are exactly the text's tokens
    ids = [enc.encode_single_token(data.EOT)] + enc.encode_ordinary(text)
    sums, _ = window_nll(model, ids, seq_len or model.config.block_size)
    return bits_per_byte(sums.sum(), len(text.encode("utf-8")))


# ----------------------------------------------------------------------------------------
# ppl: loss, perplexity and bits per byte, with bootstrap intervals over windows

def ppl_text(args, enc, desc):
    """(token ids to score, their name, the train tokens for the unigram baseline or None):
    --text FILE, or the corpus's val split when the model shares the corpus's tokenizer."""
    if args.text:
        if not os.path.isfile(args.text):
            raise UserError(f"--text {args.text!r} not found")
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        ids = [enc.encode_single_token(data.EOT)] + enc.encode_ordinary(text)   # all predicted
        # no unigram baseline: nothing says which train split this text belongs with
        return ids, args.text, None
    if args.checkpoint == "none":
        raise UserError("--checkpoint none has a 256-byte tokenizer, not the corpus's: "
                        "pass --text FILE")
    corpus = data.load_corpus(args.data, enc.n_vocab)
    # val.bin holds token ids of the corpus's BPE: under another tokenizer the same ids
    # are other strings, and the model would be scored on noise. Same merges or stop.
    if corpus.enc._mergeable_ranks != enc._mergeable_ranks:
        raise UserError(f"{desc} was trained with another tokenizer than the corpus "
                        f"{corpus.name}'s: pass the same --data, or --text FILE")
    # max_tokens + 1 ids give max_tokens predictions
    return corpus.val[:args.max_tokens + 1], f"{corpus.name} val", corpus.train


def run_ppl(args, device):
    model, enc, desc = load_base(args, device)
    seq_len = args.seq_len or model.config.block_size
    ids, source, train = ppl_text(args, enc, desc)
    t0 = time.perf_counter()
    sums, targets = window_nll(model, ids, seq_len, args.batch_size)
    lengths = token_byte_lengths(enc)
    n_tok = np.array([len(t) for t in targets])
    n_bytes = np.array([lengths[t].sum() for t in targets])
    # total NLL / total targets, every token weighted once: not the mean of the window
    # means, which would over-weight the short last window
    loss = sums.sum() / n_tok.sum()
    bpb = bits_per_byte(sums.sum(), n_bytes.sum())
    # Bootstrap over windows, not tokens: neighbouring tokens' losses are correlated (the
    # same context, the same file), and resampling them as independent draws would make
    # the interval too narrow. Each statistic is a ratio, numerator and denominator
    # resampled together.
    ci = lambda f: bootstrap_ci(f, len(sums), args.bootstrap, args.seed)
    loss_ci = ci(lambda i: sums[i].sum() / n_tok[i].sum())
    bpb_ci = ci(lambda i: bits_per_byte(sums[i].sum(), n_bytes[i].sum()))
    print0(f"model {desc} | {source}: {n_tok.sum():,} tokens, {n_bytes.sum():,} bytes "
           f"({n_bytes.sum() / n_tok.sum():.2f} bytes/token), {len(sums)} windows of "
           f"{seq_len} | {time.perf_counter() - t0:.1f} s")
    print0(f"{'':14}{'value':>9}   95% bootstrap CI ({args.bootstrap} resamples of windows)")
    print0(f"{'loss (nats)':14}{loss:9.4f}   [{loss_ci[0]:.4f}, {loss_ci[1]:.4f}]")
    # exp is monotone, so the percentiles of the perplexity are exp of the loss's
    ppl_lo = math.exp(loss_ci[0])
    ppl_hi = math.exp(loss_ci[1])
    print0(f"{'perplexity':14}{math.exp(loss):9.2f}   [{ppl_lo:.2f}, {ppl_hi:.2f}]")
    print0(f"{'bits/byte':14}{bpb:9.4f}   [{bpb_ci[0]:.4f}, {bpb_ci[1]:.4f}]")
    result = dict(loss=loss, ppl=math.exp(loss), bpb=bpb, loss_ci=loss_ci, bpb_ci=bpb_ci)
    if train is not None:       # the context-free baseline, in the same units
        # add-one (Laplace) smoothing: a token never seen in train gets count 1, not
        # log 0 = -inf. The gap from this to the model is what context buys; uniform,
        # ln V, is a model that learned nothing at all.
        counts = np.bincount(np.asarray(train), minlength=enc.n_vocab) + 1.0
        logp = np.log(counts / counts.sum())
        uni = -sum(logp[t].sum() for t in targets)       # over the very targets scored
        print0(f"unigram baseline (train counts): loss {uni / n_tok.sum():.4f}, "
               f"{bits_per_byte(uni, n_bytes.sum()):.4f} bits/byte; uniform: "
               f"{math.log(enc.n_vocab):.4f} nats/token")
    # EOT targets (document ends in the val split) add their NLL but 0 bytes, so bits per
    # byte charges the boundaries to the text; max(.., 1): a window of only EOT targets
    per_window = sums / (math.log(2) * np.maximum(n_bytes, 1))
    hist, edges = np.histogram(per_window, bins=12)
    labels = [f"{e:.2f}" for e in edges[:-1]]
    path = svg_bar_chart("ppl_windows", labels, {"windows": hist.tolist()},
                         title=f"bits/byte per window ({source})", xlabel="bits/byte (bin start)",
                         ylabel="windows", directory=args.plots)
    print0(terminal_bars(labels, {"windows": hist.tolist()}, width=30))
    print0(f"plot: {path}")
    return result


# ----------------------------------------------------------------------------------------
# task: generative exact match vs log-likelihood ranking of candidate answers

def candidates(problem, n, seed):
    """The answer and n-1 near misses (±1, ±2, ±9..11, +100), drawn per problem."""
    a = int(problem.answer)
    # the misses a model that almost knows the sum would make: the last digit off (±1,
    # ±2), a carry slip (±9, ±10, ±11), a wrong hundreds digit (+100)
    near = [a + d for d in (1, -1, 2, -2, 10, -10, 9, -9, 11, -11, 100)]
    # no negatives (no answer is one: make_problems orders '-' operands); dict.fromkeys
    # removes repeats and keeps the list's order. At most 11 misses: --choices above 12
    # gets fewer candidates than the printed chance 1/choices assumes.
    pool = list(dict.fromkeys(c for c in near if c >= 0 and c != a))
    # seeded by the prompt: a problem gets the same candidates in every run and for both
    # models, so they sit the same test. random.Random seeds a str via SHA-512, not the
    # per-process salted hash().
    rng = random.Random(f"{seed}:{problem.prompt}")
    # sorted, so the answer is not always first: np.argmax breaks ties by the first index,
    # and a model that scores every candidate alike would otherwise always be "right"
    return sorted([a] + rng.sample(pool, min(n - 1, len(pool))))


def ranking_accuracy(model, enc, problems, n_choices, seed):
    """-> per problem (right by summed log-likelihood, right by log-likelihood per byte:
    lm-evaluation-harness's acc and acc_norm)."""
    cands = [candidates(p, n_choices, seed) for p in problems]
    # Each candidate is scored with its terminator "\n". Without it "8" would be a prefix
    # of "82" with one negative log-prob term fewer, and the summed likelihood would
    # favour short answers; with it every candidate must also say "and stop here".
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(f"{c}{data.TERMINATOR}"))
             for p, cs in zip(problems, cands) for c in cs]
    # one flat list: continuation_logprobs groups it by prompt length and runs each prompt
    # once (core/scores.py); the results come back in pairs' own problem-major order
    lps = iter(continuation_logprobs(model, pairs))
    acc, acc_norm = [], []
    for p, cs in zip(problems, cands):
        scores = [next(lps).sum().item() for _ in cs]
        # acc_norm: per byte of the candidate (digits and "\n" are ASCII, so bytes =
        # characters), lm-evaluation-harness's guard against long answers losing by length
        per_byte = [s / len(f"{c}{data.TERMINATOR}".encode()) for s, c in zip(scores, cs)]
        # str(int) is canonical (no leading zero), and so is every answer make_problems writes
        acc.append(str(cs[int(np.argmax(scores))]) == p.answer)
        acc_norm.append(str(cs[int(np.argmax(per_byte))]) == p.answer)
    return np.array(acc, dtype=float), np.array(acc_norm, dtype=float)


def run_task(args, device):
    base, enc, desc = task_base(args, device)
    tuned, _ = task_model(args, enc, device)
    dev, test = eval_problems(args)
    problems = dev + test        # nothing is fitted here: both halves are held-out scoring
    print0(f"{len(problems)} held-out {args.digits}-digit '{args.ops}' problems; "
           f"{args.choices} candidates each (chance {1 / args.choices:.0%})")
    print0(f"{'model':<22}{'generative EM':>22}{'LL rank (acc)':>22}"
           f"{'LL/byte (acc_norm)':>22}{'s':>6}")
    rows, result = {}, {}
    for name, model in (("base LM", base), (f"task SFT ({args.task_preset})", tuned)):
        t0 = time.perf_counter()
        # exact match: greedy decoding to the first "\n" (core/scores.py); data.score
        # compares the text before it with the answer
        gen = np.array([data.score(enc.decode(a), p.answer) for a, p in
                        zip(greedy_answers(model, enc, problems, args.max_new), problems)])
        acc, acc_norm = ranking_accuracy(model, enc, problems, args.choices, args.seed)
        cells = []
        for v in (gen, acc, acc_norm):
            # the lambda reads the loop variable v when called: safe only because
            # bootstrap_ci calls it right here; lambdas kept for later would all see the
            # last v (Python's late binding)
            lo, hi = bootstrap_ci(lambda i: v[i].mean(), len(v), args.bootstrap, args.seed)
            cells.append(f"{v.mean():6.1%} [{lo:.0%},{hi:.0%}]")
        seconds = time.perf_counter() - t0
        print0(f"{name:<22}" + "".join(f"{c:>22}" for c in cells) + f"{seconds:6.1f}")
        rows[name] = [gen.mean(), acc.mean(), acc_norm.mean()]
        # the disagreements, per problem: ranked right but generated wrong is the header's
        # point -- a model can prefer the answer without being able to write it
        ranked_not_generated = float(((acc == 1) & (gen == 0)).mean())
        generated_not_ranked = ((acc == 0) & (gen == 1)).mean()
        result[name] = dict(generative=gen.mean(), ll=acc.mean(), ll_norm=acc_norm.mean(),
                            ll_right_gen_wrong=ranked_not_generated)
        print0(f"{'':<22}ranked right but generated wrong: {ranked_not_generated:.1%} "
               f"of problems; generated right but ranked wrong: {generated_not_ranked:.1%}")
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(f"{c}{data.TERMINATOR}"))
             for p in problems for c in candidates(p, args.choices, args.seed)]
    # The harness primitive timed both ways on the same pairs: reusing the prompt's KV cache
    # must change only the time, the log-probs agreeing up to float rounding (max |Δ|)
    seconds, lps = {}, {}
    with TimingConditions() as timing:           # one run each: the load says if it is off
        for reuse in (True, False):              # the harness primitive, both ways
            t0 = time.perf_counter()
            lps[reuse] = continuation_logprobs(tuned, pairs, reuse_cache=reuse)
            seconds[reuse] = time.perf_counter() - t0
    diff = max((a - b).abs().max().item() for a, b in zip(lps[True], lps[False]))
    print0(f"scoring {len(pairs)} continuations: prompt KV cache reused {seconds[True]:.2f} s, "
           f"prompt re-run per candidate {seconds[False]:.2f} s; max |Δ log-prob| {diff:.1e}")
    timing.report(out=print0)
    print0("Ranking only asks the model to put the answer above a few near misses (chance "
           f"{1 / args.choices:.0%}); generation must produce it from the whole vocabulary "
           "and stop.")
    labels = ["generative", "LL rank", "LL/byte"]
    path = svg_bar_chart("task_accuracy", labels, rows, title="held-out accuracy, two scorings",
                         ylabel="accuracy", ymax=1.0, directory=args.plots)
    print0(terminal_bars(labels, rows, width=30, vmax=1.0))
    print0(f"plot: {path}")
    return result


# ----------------------------------------------------------------------------------------
# Confidence: what the model's own probabilities say of its greedy answers (scripts/calibration.py
# and scripts/uncertainty.py read these records)

def answer_records(model, enc, problems, max_new):
    """Greedy answers, whether each is right, and the logits at every answer position
    (of the greedy answer and of the reference answer), so any temperature can be applied
    afterwards without another forward."""
    greedy = greedy_answers(model, enc, problems, max_new)
    prompts = prompt_ids(enc, problems)
    refs = [enc.encode_ordinary(p.answer + data.TERMINATOR) for p in problems]
    # keep_logits: the (answer length, V) float32 logits of every answer, on the CPU --
    # answer tokens × V × 4 bytes, paid once so that any T is a division, not a forward.
    # Greedy answers: how sure the model is of what it said (confidences). References:
    # the NLL of the right answer, Guo et al.'s objective for fitting T, flattened below
    # into one (tokens, V) matrix with its labels.
    _, lg_greedy = continuation_logprobs(model, list(zip(prompts, greedy)), keep_logits=True)
    _, lg_ref = continuation_logprobs(model, list(zip(prompts, refs)), keep_logits=True)
    correct = np.array([data.score(enc.decode(g), p.answer) for g, p in zip(greedy, problems)])
    return dict(greedy=greedy, refs=refs, lg_greedy=lg_greedy, lg_ref=lg_ref, correct=correct,
                logits=torch.cat(lg_ref), labels=torch.tensor([t for r in refs for t in r]))


def confidences(rec, temperature=1.0):
    """-> per problem: sequence probability of the greedy answer (the product of its token
    probabilities), probability of its first token, mean entropy of its token distributions."""
    seq = []
    first = []
    ent = []
    # T rescales the logits of the *same* greedy tokens: argmax is invariant to T > 0, so
    # the greedy answer would not change, only how sure it looks
    for g, lg in zip(rec["greedy"], rec["lg_greedy"]):
        lp = F.log_softmax(lg / temperature, -1)
        # sequence: exp Σ log p over the answer's tokens, "\n" included, so a longer
        # answer has more factors below 1; entropy: the mean over positions of
        # H(p_t) = -Σ p log p in nats, however likely the chosen token itself was
        seq.append(lp.gather(1, torch.tensor(g)[:, None]).sum().exp().item())
        first.append(lp[0, g[0]].exp().item())
        ent.append(-(lp.exp() * lp).sum(-1).mean().item())
    return np.array(seq), np.array(first), np.array(ent)


# ----------------------------------------------------------------------------------------
# The models: a base LM (the checkpoint, or a tiny one trained here in seconds) and a task
# model fine-tuned on the arithmetic texts (cached: plain dicts, weights_only loads).

def _save(path, model, enc, meta):
    """The model with its config, tokenizer and the meta that made it, as plain dicts,
    tensors and strings: torch.load(weights_only=True) reads that back without running
    pickled code. atomic_save: a crash mid-write leaves the old file, not half a new one."""
    atomic_save({"config": asdict(model.config), "model": model.state_dict(), "meta": meta,
                 "tokenizer": data.encoding_to_state(enc)}, path)


def _load_cached(path, meta, device):
    """(model, tokenizer) if path holds a model made with exactly `meta`, else None (the
    caller then trains and saves it)."""
    if not os.path.exists(path):
        return None
    # weights_only=True: a cache file is data and is never allowed to run code; an
    # unreadable one (a disk that filled mid-write by another tool) is one line, not a trace
    ck = load_checkpoint(path, map_location=device, what="cached task model")
    # any difference in what shaped it (steps, seed, data, ...): stale, retrain rather
    # than silently reuse another experiment's model
    if ck.get("meta") != meta:
        return None
    # seed=None skips the random init: load_state_dict overwrites every weight anyway
    model = GPT(GPTConfig(**ck["config"]).validate(), seed=None).to(device)
    model.load_state_dict(ck["model"])
    return model, data.encoding_from_state(ck["tokenizer"])


def adam_steps(model, batch_fn, steps, lr, label, log_every=0):
    """AdamW on the next-token loss of batch_fn(step) -> (x, y); 5% warmup, then cosine to
    10% of lr. Prints a progress line every log_every steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm, t0 = max(1, steps // 20), time.perf_counter()
    model.train()
    for step in range(steps):
        # warmup: (step + 1) / warm, never 0 (a zero-lr first step is wasted); then
        # 0.55 + 0.45·cos(π·t) for t from 0 to 1: 1.0 after the warmup down to 0.55 - 0.45
        # = 0.1 at the end, the "cosine to 10% of lr" of the docstring
        f = (step + 1) / warm if step < warm else \
            0.55 + 0.45 * math.cos(math.pi * (step - warm) / max(1, steps - warm))
        # AdamW reads g["lr"] at each step(), so setting it here is the whole scheduler
        for g in opt.param_groups:
            g["lr"] = lr * f
        x, y = batch_fn(step)
        # the next-token cross-entropy on every target but the -1 padding, in float32
        loss = F.cross_entropy(model(x)[0].flatten(0, 1).float(), y.flatten(), ignore_index=-1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # global-norm clipping at 1.0 guards the first steps of a fresh model from a spike
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # loss.item() only on log steps: on a GPU it is a host-device synchronisation
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            print0(f"{label} step {step + 1}/{steps} | loss {loss.item():.4f} | "
                   f"{time.perf_counter() - t0:.1f} s")
    model.eval()
    return model


def text_batch(seqs, device):
    """Rows of token lists, right-padded; targets -1 on the padding (the loss skips it)."""
    # T = the longest row - 1: inputs are s[:-1], targets s[1:]. The input padding is
    # token 0 (any id would do): attention is causal, so no real position sees the later
    # padding, and its targets are -1 -- it costs compute, never loss.
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s) - 1] = torch.tensor(s[:-1])
        y[i, :len(s) - 1] = torch.tensor(s[1:])
    return x.to(device), y.to(device)


def load_base(args, device):
    """-> (model, tokenizer, description): the LM `ppl` measures. --checkpoint PATH: that
    model; not given: train.py's out/ckpt.pt (the demo model) when it exists, else a tiny
    LM trained here; --checkpoint none: a random tiny model (tests)."""
    if args.checkpoint is None and os.path.exists(DEFAULT_CKPT):
        return _checkpoint_base(DEFAULT_CKPT, device)
    return task_base(args, device)


def task_base(args, device):
    """-> (model, tokenizer, description): the base LM the task modes score, whose
    tokenizer the task model is trained on. Not given: the tiny LM trained here, even when
    out/ckpt.pt exists -- the task figures are a property of the tokenizer (a 512-token BPE
    spells a 2-digit number with one token per digit; the demo's 4096-token BPE merges
    digits irregularly), so a base read implicitly would change what is measured."""
    if args.checkpoint == "none":
        return _random_base(args, device)
    if args.checkpoint is not None:
        model, enc, path = _checkpoint_base(args.checkpoint, device)
        # asked for: then say what it changes (the task model learns this tokenizer)
        print0(f"base LM {path}: the task model is trained on its {enc.n_vocab}-token "
               "tokenizer (docs/evaluate.md's figures are for the tiny LM's 512-token BPE)")
        return model, enc, path
    if os.path.exists(DEFAULT_CKPT):
        print0(f"not reading {DEFAULT_CKPT}: the task modes measure the tiny LM trained here "
               f"(--checkpoint {DEFAULT_CKPT} scores the demo model and trains the task model "
               "on its tokenizer)")
    return _tiny_base(args, device)


def _random_base(args, device):
    """--checkpoint none: random weights and a byte-level tokenizer (256 bytes + EOT): no
    corpus and no training, so the tests run in milliseconds."""
    enc = data.make_encoding({bytes([i]): i for i in range(256)})
    model = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=args.seed).to(device)
    return model.eval(), enc, "random tiny (256-byte tokenizer)"


def _checkpoint_base(path, device):
    """A checkpoint file or a Hugging Face Llama folder (core/checkpoint.py); the tokenizer
    comes from the checkpoint, so no corpus is read. Missing: UserError."""
    model, ck = load_model(path, device)
    return model.eval(), data.encoding_from_state(ck["tokenizer"]), path


def _tiny_base(args, device):
    """A tiny LM trained here once and cached: --base-steps (400) × 16 rows × 64 tokens ≈
    410k tokens at lr 3e-3, on a BPE of the tiny preset's 512 entries."""
    path = os.path.join(args.out, "base-tiny.pt")
    meta = dict(data=args.data, steps=args.base_steps, seed=args.seed)
    hit = _load_cached(path, meta, device)
    if hit:
        return hit[0], hit[1], f"{path} (tiny LM trained here)"
    corpus = data.load_corpus(args.data, PRESETS["tiny"]["vocab_size"])
    print0(f"training a tiny LM for {args.base_steps} steps on {corpus.name} -> {path}")
    model = GPT(get_config("tiny", vocab_size=corpus.enc.n_vocab), seed=args.seed).to(device)
    batch = lambda s: data.get_batch(corpus.train, 16, 64, args.seed, s, device=device)
    adam_steps(model, batch, args.base_steps, 3e-3, "tiny LM", max(1, args.base_steps // 4))
    _save(path, model, corpus.enc, meta)
    return model, corpus.enc, f"{path} (tiny LM trained here)"


def task_model(args, enc, device):
    """A fresh --task-preset model taught the task by SFT on format_example texts (loss on
    every token after the first), cached by everything that shapes it. Fresh rather than
    the base: rl.py measured a Python-trained `small` learning this task no faster per step
    than a fresh `draft`, at 3× the cost."""
    # meta: everything that changes the trained weights. The tokenizer enters as a hash of
    # its merge table, not its name: two corpora give two different BPEs.
    meta = dict(tokenizer=hashlib.sha256(repr(sorted(enc._mergeable_ranks.items())).encode())
                .hexdigest()[:16], preset=args.task_preset, steps=args.sft_steps,
                batch=args.sft_batch, lr=args.sft_lr, digits=args.digits, ops=args.ops,
                n_train=args.n_train, seed=args.seed)
    # 10 hex digits of the meta's hash in the file name, so different settings are cached
    # side by side; the full meta stored inside is compared on load, so a clash of names
    # retrains instead of loading the wrong model
    key = hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()[:10]
    path = os.path.join(args.out, f"task-{args.task_preset}-{key}.pt")
    hit = _load_cached(path, meta, device)
    if hit:
        # the training problems are re-drawn, not stored: make_problems is seeded, so
        # they are the same ones (scripts/contamination.py needs them)
        return hit[0], train_problems(args)
    problems = train_problems(args)
    seqs = [enc.encode_ordinary(data.format_example(p)) for p in problems]
    rng = np.random.default_rng([args.seed, 11])

    # rows drawn with replacement every step: at the defaults 800 × 64 = 51,200 rows from
    # 20,000 problems, ~2.6 epochs. The loss is on every token (prompt included), not
    # only the answer as lora.py's mask does.
    def batch(step):
        rows = rng.integers(0, len(seqs), args.sft_batch)
        return text_batch([seqs[i] for i in rows], device)
    print0(f"SFT of a fresh {args.task_preset} on {len(seqs)} {args.digits}-digit '{args.ops}' "
           f"problems, {args.sft_steps} steps (cached -> {path})")
    model = GPT(get_config(args.task_preset, vocab_size=enc.n_vocab), seed=args.seed).to(device)
    adam_steps(model, batch, args.sft_steps, args.sft_lr, "SFT", max(1, args.sft_steps // 5))
    _save(path, model, enc, meta)
    return model, problems


def train_problems(args):
    """The task model's training problems: core/data.py's "train" split, seeded."""
    return data.make_problems(args.n_train, args.seed, args.digits, args.ops, "train")


def eval_problems(args):
    """Distinct held-out (test-split) problems in a seeded order: first half dev, second
    half test."""
    # "test": data.problem_split picks the split by a hash of the prompt, so no test problem
    # can be a training one whatever the seeds -- held out by construction. seed + 1: a
    # draw of its own, not a replay of the training draw's random stream.
    drawn = data.make_problems(args.eval_problems, args.seed + 1, args.digits, args.ops, "test")
    # drawn with replacement: a repeat would count twice in every accuracy and bootstrap;
    # dict.fromkeys drops repeats and keeps the first-seen order (Problem is hashable)
    probs = list(dict.fromkeys(drawn))
    # dev (the first half) is what scripts/calibration.py fits T on; test is reported
    random.Random(args.seed).shuffle(probs)
    return probs[:len(probs) // 2], probs[len(probs) // 2:]


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables). Calibration, uncertainty
# and contamination: scripts/calibration.py, uncertainty.py and contamination.py (split out
# by concept) run those experiments with this file's metrics, models and first two knob
# groups (COMMON_GROUP, TASK_GROUP); they import this file, never the other way.

COMMON_KNOBS = [
    knob("--checkpoint", None, f"model checkpoint; not given: ppl reads {DEFAULT_CKPT} (a tiny "
         "LM trained here in seconds when it is absent), the task modes always the tiny LM "
         "(its 512-token BPE); 'none' = random tiny"),
    knob("--data", None, "corpus text file (not given: the built-in corpus)"),
    knob("--base-steps", 400, "training steps of the tiny LM trained here (cached by them)"),
    knob("--device", "cpu", "cpu or cuda"),
    knob("--seed", 0, "problems, splits, sampling, bootstrap"),
    knob("--threads", 1, "torch CPU threads (small matmuls)"),
    knob("--bootstrap", 1000, "bootstrap resamples for the CIs"),
    knob("--out", OUT_DIR, "where task models are cached"),
    knob("--plots", os.path.join("out", "plots"), "where SVG plots go"),
]

TASK_KNOBS = [
    knob("--digits", 2, "digits per operand"),
    knob("--ops", "+", "operators, from '+-*'"),
    knob("--task-preset", "draft", f"one of {', '.join(PRESETS)}"),
    knob("--sft-steps", 800, "SFT steps"),
    knob("--sft-batch", 64, "SFT rows per step"),
    knob("--sft-lr", 1e-3, "SFT peak learning rate"),
    knob("--n-train", 20000, "training problems (drawn)"),
    knob("--eval-problems", 600, "held-out draws (deduplicated; half dev, half test)"),
    knob("--max-new", 8, "most answer tokens generated"),
]

# Each mode's own knobs, listed under its "options"
PPL_KNOBS = [
    knob("--text", None, "score this UTF-8 file (not given: the val split)"),
    knob("--seq-len", 0, "window length (0 = block size)"),
    knob("--batch-size", 8, "windows per forward"),
    knob("--max-tokens", 65536, "val tokens scored"),
]
RANKING_KNOBS = [knob("--choices", 4, "candidate answers per problem")]

# --help groups: (heading, knobs); None = the mode's own "options"
COMMON_GROUP = ("model and run", COMMON_KNOBS)
TASK_GROUP = ("task model (core/data.py's arithmetic, SFT cached)", TASK_KNOBS)
# the two modes of this file: (run, help, groups). Calibration, uncertainty and
# contamination are separate entry points under scripts/ (python -m scripts.<name>).
MODES = {"ppl": (run_ppl, "val loss, perplexity, bits/byte with bootstrap CIs",
                 [COMMON_GROUP, (None, PPL_KNOBS)]),
         "task": (run_task, "generative exact match vs log-likelihood ranking",
                  [COMMON_GROUP, TASK_GROUP, (None, RANKING_KNOBS)])}


def check_args(args):
    """Every count and range a user can get wrong, one line each (shared by the modes here
    and the experiments under scripts/, which build their parsers from its knob groups)."""
    # getattr(args, name, 1) and the like: a flag the mode does not define reads as valid,
    # so one function checks every parser (this file's and the scripts')
    for name in ("bootstrap", "threads", "base_steps", "sft_steps", "sft_batch", "n_train",
                 "eval_problems", "max_new", "batch_size", "max_tokens", "repeats", "ft_clean",
                 "ft_batch"):
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, "
                            f"got {getattr(args, name)}")
    # --ngram 0 is the size chosen from the items' lengths (scripts/contamination.py)
    if getattr(args, "ngram", 0) < 0:
        raise UserError(f"--ngram must be at least 0 (0: chosen from the items), got {args.ngram}")
    if getattr(args, "bins", 1) < 1:
        raise UserError(f"--bins must be at least 1, got {args.bins}")
    if getattr(args, "temperature", 1.0) <= 0:
        raise UserError(f"--temperature must be > 0 (sampling), got {args.temperature}")
    if getattr(args, "choices", 2) < 2:
        raise UserError(f"--choices must be at least 2, got {args.choices}")
    if getattr(args, "planted", 1) < 1 or not 0 < getattr(args, "min_k", 1) <= 100:
        raise UserError("--planted must be at least 1 and --min-k in (0, 100]")
    # checked here, not at the first .to(device): a missing GPU is one "error:" line, not
    # a CUDA traceback from deep inside the model loading
    no_cuda = args.device == "cuda" and not torch.cuda.is_available()
    if args.device not in ("cpu", "cuda") or no_cuda:
        raise UserError(f"--device {args.device!r}: use cpu, or cuda on a machine that has it")
    return args


def parse_args(argv=None):
    p = ArgumentParser(description="Evaluate the shared GPT: perplexity and task scoring. "
                                   "The experiments built on these scores run on their own: "
                                   "python -m scripts.calibration | scripts.uncertainty | "
                                   "scripts.contamination.",
                       formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, (_, help, groups) in MODES.items():
        s = sub.add_parser(mode, formatter_class=HelpFormatter, help=help)
        for title, knobs in groups:
            add_knobs(s, knobs, title)
    # validated inside parse_args: every caller gets arguments that check_args accepted
    return check_args(p.parse_args(argv))


def run_timed(run, args, label):
    """Threads and seeds set, run(args, device), its wall time printed. -> run's result."""
    torch.set_num_threads(args.threads)
    # Python, numpy and torch RNGs seeded (core/runtime.py) before anything draws, so a
    # rerun with the same --seed prints the same numbers; model init has its own generator
    seed_everything(args.seed)
    t0 = time.perf_counter()
    result = run(args, torch.device(args.device))
    print0(f"{label} done in {time.perf_counter() - t0:.1f} s")
    return result


def main(argv=None):
    args = parse_args(argv)
    return run_timed(MODES[args.mode][0], args, args.mode)


if __name__ == "__main__":
    # run_cli (core/runtime.py): a UserError becomes one "error:" line and exit code 2
    run_cli(main)
