"""
evaluate.py -- how good is the model, how sure is it, when is it wrong, and has it seen
the test: every number computed by hand and checked on cases with known answers.

Run:  python evaluate.py ppl             # val loss, perplexity, bits/byte, bootstrap CIs
      python evaluate.py task            # generative exact match vs log-likelihood ranking
      python evaluate.py calibration     # ECE, reliability diagram, temperature scaling
      python evaluate.py uncertainty     # wrong-answer detectors: AUROC, accuracy-coverage
      python evaluate.py contamination   # plant test items in a fine-tune, then detect them

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
  - Calibration (calibration.py; Guo et al. 2017): expected calibration error over
    equal-width confidence bins, ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|; temperature
    scaling divides every logit by one T > 0 fitted on a dev split to minimise the NLL of
    the reference answers. It costs nothing at inference, never changes the greedy answer
    (argmax is invariant to T), and fixes only a global over/under-confidence.
  - Uncertainty (uncertainty.py): which signals, free (one pass) or costing K samples,
    detect a wrong answer, each scored by AUROC (Mann-Whitney U with ties, here) and by
    the accuracy-coverage curve of abstaining on the least confident.
  - Contamination (contamination.py): plant test problems in a fine-tune, measure the
    accuracy inflation, and detect them by n-gram overlap, loss and Min-K% Prob (here).
The arithmetic-task accuracy of a Python-trained LM is near zero, so the task modes train a
task model first (SFT on data.py's format_example texts, cached under out/evaluate/).
Imports only the shared modules: lora.py, rl.py and train.py import this file's metrics
(exact_match, answer_loss, greedy_answers, validation_loss), so it imports none of them.
"""
import argparse
import hashlib
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F

import data
from model import GPT, GPTConfig, KVCache, PRESETS, get_config, load_model
from plots import svg_bar_chart, terminal_bars
from plumbing import (ArgumentParser, HelpFormatter, UserError, atomic_save, print0, run_cli,
                      seed_everything)

DEFAULT_CKPT = os.path.join("out", "ckpt.pt")
OUT_DIR = os.path.join("out", "evaluate")


# ----------------------------------------------------------------------------------------
# The metrics, by hand

def ece(conf, correct, n_bins=15):
    """Expected calibration error over n_bins equal-width bins ((lo, hi], the first also
    holds 0). -> (ece, bins) with bins = [(lo, hi, count, accuracy, mean confidence)]."""
    if n_bins < 1:
        raise UserError(f"the bin count must be at least 1, got {n_bins}")
    conf = np.asarray(conf, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    which = np.searchsorted(edges[1:-1], conf, side="left")   # edges[i-1] < c <= edges[i]
    total, bins = 0.0, []
    for b in range(n_bins):
        inside = which == b
        count = int(inside.sum())
        acc = float(correct[inside].mean()) if count else float("nan")
        mean_conf = float(conf[inside].mean()) if count else float("nan")
        if count:
            total += count / len(conf) * abs(acc - mean_conf)
        bins.append((float(edges[b]), float(edges[b + 1]), count, acc, mean_conf))
    return total, bins


def brier(conf, correct):
    """Mean squared error of a probability against the 0/1 outcome (Brier 1950)."""
    conf = np.asarray(conf, dtype=np.float64)
    return float(((conf - np.asarray(correct, dtype=np.float64)) ** 2).mean())


def nll(logits, labels, temperature=1.0):
    """Mean −log softmax(logits / T)[label] over rows: the NLL temperature scaling fits."""
    return F.cross_entropy(logits.double() / temperature, labels).item()


def auroc(scores, labels):
    """P(score of a positive > score of a negative) + ½ P(tie), from the ranks
    (Mann-Whitney U / n₊n₋, tied scores sharing their mean rank). NaN without both."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):                 # a run of ties gets the mean of its ranks
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def bootstrap_ci(stat, n, n_boot=1000, seed=0, level=0.95):
    """Percentile bootstrap: stat(indices) on n_boot resamples of range(n) with
    replacement. -> (low, high). Items are the unit (windows, problems), not tokens."""
    rng = np.random.default_rng(seed)
    values = [stat(rng.integers(0, n, n)) for _ in range(n_boot)]
    values = [v for v in values if v == v]      # AUROC of a resample with one class: NaN
    if not values:
        return float("nan"), float("nan")
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def fit_temperature(logits, labels, iters=50):
    """argmin_T NLL(logits / T) by Newton's method on β = 1/T: NLL(β) = mean(logsumexp(βz)
    − β z_y) is convex in β, with gradient mean(E_p[z] − z_y) and curvature mean(Var_p[z])
    (p = softmax(βz)), so Newton converges from β = 1 in a few steps; a step that would
    raise the NLL or make β ≤ 0 is halved. -> T, clamped to [0.01, 100]."""
    z = logits.double()
    z_y = z.gather(1, labels[:, None])[:, 0]
    loss = lambda b: (torch.logsumexp(b * z, -1) - b * z_y).mean().item()
    beta = 1.0
    for _ in range(iters):
        p = torch.softmax(beta * z, -1)
        mean_z = (p * z).sum(-1)
        grad = (mean_z - z_y).mean().item()
        curv = ((p * z * z).sum(-1) - mean_z ** 2).mean().item()
        step = grad / max(curv, 1e-12)
        for _ in range(60):                 # backtrack: stay positive, never go uphill
            if beta - step > 0 and loss(beta - step) <= loss(beta) + 1e-15:
                break
            step /= 2
        if abs(step) < 1e-10 * beta or beta > 100:
            beta -= step
            break
        beta -= step
    return min(max(1 / beta, 0.01), 100.0)


def accuracy_coverage(conf, correct, levels=20):
    """Answer only the most confident fraction c of the questions (abstain on the rest):
    -> [(c, accuracy of those answered)] for c = 1/levels .. 1. Ties keep item order."""
    order = np.argsort(-np.asarray(conf, dtype=np.float64), kind="mergesort")
    correct = np.asarray(correct, dtype=np.float64)[order]
    out = []
    for i in range(1, levels + 1):
        k = max(1, math.ceil(i / levels * len(correct)))
        out.append((k / len(correct), float(correct[:k].mean())))
    return out


def entropy(counts):
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def min_k_prob(logprobs, k_percent=20.0):
    """Min-K% Prob (Shi et al. 2023): mean of the ceil(k% · n) lowest token log-probs."""
    k = max(1, math.ceil(len(logprobs) * k_percent / 100))
    return float(torch.sort(logprobs).values[:k].mean())


# ----------------------------------------------------------------------------------------
# Log-likelihood of continuations: the harness primitive

def by_length(prompts):
    """{prompt length: indices}: a contiguous KV cache holds one length per batch."""
    groups = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return groups


def _group_logits(model, contexts, rows, reuse_cache):
    """contexts: distinct token lists of ONE length P; rows: [(context index, tokens)].
    -> the (len(tokens), V) logits that predict each row's tokens. With reuse_cache the
    contexts are run once (prefill) and their K/V copied to every row that continues them;
    without, every row is context + continuation in one plain forward."""
    device = model.output.weight.device
    P, L = len(contexts[0]), max(len(c) for _, c in rows)
    cont = torch.zeros(len(rows), L, dtype=torch.long)
    for i, (_, c) in enumerate(rows):
        cont[i, :len(c)] = torch.tensor(c)           # right padding: causal, never read
    cont = cont.to(device)
    which = torch.tensor([j for j, _ in rows], device=device)
    ctx = torch.tensor(contexts, device=device)
    if not reuse_cache:
        logits = model(torch.cat([ctx[which], cont], 1)[:, :-1])[0][:, P - 1:]
    else:
        prefill = KVCache(model.config, len(contexts), P, device, model.output.weight.dtype)
        last = model(ctx, cache=prefill)[0][:, -1:][which]        # predicts token 0
        if L == 1:
            logits = last
        else:
            cache = KVCache(model.config, len(rows), P + L - 1, device,
                            model.output.weight.dtype)
            for layer in range(model.config.n_layer):   # each row starts from its prompt's K/V
                cache.update(layer, prefill.k[layer, which], prefill.v[layer, which])
            cache.advance(P)
            # forward() continues at position P and masks: all of the prompt, causal after
            logits = torch.cat([last, model(cont[:, :-1], cache=cache)[0]], 1)
    return [logits[i, :len(c)] for i, (_, c) in enumerate(rows)]


@torch.no_grad()
def continuation_logprobs(model, pairs, reuse_cache=True, keep_logits=False, chunk=256):
    """pairs: [(context tokens, continuation tokens)]. -> per pair the 1-D tensor of
    log p(continuation token t | context, earlier continuation tokens); with keep_logits
    also the logits. Pairs are grouped by context length, chunk rows per forward."""
    if any(len(c) == 0 or len(x) == 0 for c, x in pairs):
        raise UserError("every context and every continuation needs at least one token")
    out_lp, out_logits = [None] * len(pairs), [None] * len(pairs)
    was_training = model.training
    model.eval()                                 # no dropout (lora.py's adapters have it)
    for ids in by_length([c for c, _ in pairs]).values():
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            index = {}
            for i in part:
                index.setdefault(tuple(pairs[i][0]), len(index))
            rows = [(index[tuple(pairs[i][0])], pairs[i][1]) for i in part]
            logits = _group_logits(model, [list(c) for c in index], rows, reuse_cache)
            for i, lg in zip(part, logits):
                target = torch.tensor(pairs[i][1], device=lg.device)
                out_lp[i] = F.log_softmax(lg.float(), -1).gather(1, target[:, None])[:, 0].cpu()
                out_logits[i] = lg.float().cpu() if keep_logits else None
    model.train(was_training)
    return (out_lp, out_logits) if keep_logits else out_lp


# ----------------------------------------------------------------------------------------
# The evaluation API the other scripts share: one definition of each number

def prompt_ids(enc, problems):
    return [enc.encode_ordinary(p.prompt) for p in problems]


@torch.no_grad()
def greedy_answers(model, enc, problems, max_new=None):
    """Greedy answers with the KV cache, equal-length prompts batched together; each cut
    after its first "\\n" (kept). max_new None = the longest reference answer + its
    terminator + 1 token (lora.py's rule; rl.py passes 8)."""
    if not problems:
        return []
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    if max_new is None:
        max_new = max(len(enc.encode_ordinary(p.answer + data.TERMINATOR)) for p in problems) + 1
    was_training, device = model.training, model.output.weight.device
    model.eval()
    prompts, out = prompt_ids(enc, problems), [None] * len(problems)
    for ids in by_length(prompts).values():
        rows = model.generate(torch.tensor([prompts[i] for i in ids], device=device), max_new,
                              temperature=0, eos_id=nl).tolist()
        for i, row in zip(ids, rows):
            out[i] = row[:row.index(nl) + 1] if nl in row else row
    model.train(was_training)
    return out


def exact_match(model, enc, problems, max_new=None):
    """Fraction of problems whose greedy answer (data.score: text before "\\n") is right."""
    if not problems:
        return float("nan")
    answers = greedy_answers(model, enc, problems, max_new)
    right = sum(data.score(enc.decode(a), p.answer) for a, p in zip(answers, problems))
    return right / len(problems)


def answer_loss(model, enc, problems):
    """Mean over problems of the mean NLL (nats) of the answer tokens + "\\n" after the
    prompt: lora.py's answer loss."""
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(p.answer + data.TERMINATOR))
             for p in problems]
    return float(np.mean([-lp.mean().item() for lp in continuation_logprobs(model, pairs)]))


@torch.no_grad()
def validation_loss(model, tokens, batch_size, seq_len, iters, seed, device="cpu",
                    autocast=None):
    """Mean next-token cross-entropy over `iters` fixed batches data.get_batch(tokens, ...,
    seed, i): train.py's validation loss (the cross-entropy alone: no MoE balance or
    extra-head terms). autocast: a context manager around the forwards (bf16 autocast)."""
    was_training = model.training
    model.eval()
    losses = []
    with autocast or nullcontext():
        for i in range(iters):
            x, y = data.get_batch(tokens, batch_size, seq_len, seed, i, device=device)
            logits = model(x)[0]
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def token_byte_lengths(enc):
    """UTF-8 bytes each token id stands for; special tokens (<|endoftext|>) count 0."""
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
    starts = list(range(0, len(ids) - 1, seq_len))
    device = model.output.weight.device
    sums = []                                  # NLL sum per window
    targets = []                               # the tokens each window predicts
    for s in range(0, len(starts), batch_size):
        part = [ids[b:b + seq_len + 1] for b in starts[s:s + batch_size]]
        x, y = text_batch([w.tolist() for w in part], device)      # the last one is shorter
        loss = F.cross_entropy(model(x)[0].flatten(0, 1).float(), y.flatten(),
                               ignore_index=-1, reduction="none").view(y.shape)
        sums += loss.sum(1).double().cpu().tolist()
        targets += [w[1:] for w in part]
    return np.array(sums), targets


def bits_per_byte(nll_nats, n_bytes):
    return nll_nats / (math.log(2) * n_bytes)


def text_bits_per_byte(model, enc, text, seq_len=None):
    """Bits per byte of a text: <|endoftext|> first, so every token of the text is
    predicted and the bytes are exactly len(text.encode())."""
    ids = [enc.encode_single_token(data.EOT)] + enc.encode_ordinary(text)
    sums, _ = window_nll(model, ids, seq_len or model.config.block_size)
    return bits_per_byte(sums.sum(), len(text.encode("utf-8")))


# ----------------------------------------------------------------------------------------
# The models: a base LM (the checkpoint, or a tiny one trained here in seconds) and a task
# model fine-tuned on the arithmetic texts (cached: plain dicts, weights_only loads).

def _save(path, model, enc, meta):
    atomic_save({"config": asdict(model.config), "model": model.state_dict(), "meta": meta,
                 "tokenizer": data.encoding_to_state(enc)}, path)


def _load_cached(path, meta, device):
    if not os.path.exists(path):
        return None
    ck = torch.load(path, map_location=device, weights_only=True)
    if ck.get("meta") != meta:
        return None
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
        f = (step + 1) / warm if step < warm else \
            0.55 + 0.45 * math.cos(math.pi * (step - warm) / max(1, steps - warm))
        for g in opt.param_groups:
            g["lr"] = lr * f
        x, y = batch_fn(step)
        loss = F.cross_entropy(model(x)[0].flatten(0, 1).float(), y.flatten(), ignore_index=-1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            print0(f"{label} step {step + 1}/{steps} | loss {loss.item():.4f} | "
                   f"{time.perf_counter() - t0:.1f} s")
    model.eval()
    return model


def text_batch(seqs, device):
    """Rows of token lists, right-padded; targets -1 on the padding (the loss skips it)."""
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s) - 1] = torch.tensor(s[:-1])
        y[i, :len(s) - 1] = torch.tensor(s[1:])
    return x.to(device), y.to(device)


def load_base(args, device):
    """-> (model, tokenizer, description). --checkpoint none: a random tiny model with a
    256-byte tokenizer (tests). No --checkpoint and no out/ckpt.pt: a tiny LM trained here."""
    if args.checkpoint == "none":
        enc = data.make_encoding({bytes([i]): i for i in range(256)})
        model = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=args.seed).to(device)
        return model.eval(), enc, "random tiny (256-byte tokenizer)"
    if args.checkpoint is not None or os.path.exists(DEFAULT_CKPT):
        path = args.checkpoint or DEFAULT_CKPT
        model, ck = load_model(path, device)   # missing: UserError
        return model.eval(), data.encoding_from_state(ck["tokenizer"]), path
    path = os.path.join(args.out, "base-tiny.pt")
    meta = dict(data=args.data, steps=400, seed=args.seed)
    hit = _load_cached(path, meta, device)
    if hit:
        return hit[0], hit[1], f"{path} (tiny LM trained here: no {DEFAULT_CKPT})"
    corpus = data.load_corpus(args.data, PRESETS["tiny"]["vocab_size"])
    print0(f"no {DEFAULT_CKPT}: training a tiny LM for 400 steps on {corpus.name} -> {path}")
    model = GPT(get_config("tiny", vocab_size=corpus.enc.n_vocab), seed=args.seed).to(device)
    batch = lambda s: data.get_batch(corpus.train, 16, 64, args.seed, s, device=device)
    adam_steps(model, batch, 400, 3e-3, "tiny LM", 100)
    _save(path, model, corpus.enc, meta)
    return model, corpus.enc, f"{path} (tiny LM trained here: no {DEFAULT_CKPT})"


def task_model(args, enc, device):
    """A fresh --task-preset model taught the task by SFT on format_example texts (loss on
    every token after the first), cached by everything that shapes it. Fresh rather than
    the base: rl.py measured a Python-trained `small` learning this task no faster per step
    than a fresh `draft`, at 3× the cost."""
    meta = dict(tokenizer=hashlib.sha256(repr(sorted(enc._mergeable_ranks.items())).encode())
                .hexdigest()[:16], preset=args.task_preset, steps=args.sft_steps,
                batch=args.sft_batch, lr=args.sft_lr, digits=args.digits, ops=args.ops,
                n_train=args.n_train, seed=args.seed)
    key = hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()[:10]
    path = os.path.join(args.out, f"task-{args.task_preset}-{key}.pt")
    hit = _load_cached(path, meta, device)
    if hit:
        return hit[0], train_problems(args)
    problems = train_problems(args)
    seqs = [enc.encode_ordinary(data.format_example(p)) for p in problems]
    rng = np.random.default_rng([args.seed, 11])

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
    return data.make_problems(args.n_train, args.seed, args.digits, args.ops, "train")


def eval_problems(args):
    """Distinct held-out (test-split) problems in a seeded order: first half dev, second
    half test."""
    drawn = data.make_problems(args.eval_problems, args.seed + 1, args.digits, args.ops, "test")
    probs = list(dict.fromkeys(drawn))
    random.Random(args.seed).shuffle(probs)
    return probs[:len(probs) // 2], probs[len(probs) // 2:]


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
        return ids, args.text, None
    if args.checkpoint == "none":
        raise UserError("--checkpoint none has a 256-byte tokenizer, not the corpus's: "
                        "pass --text FILE")
    corpus = data.load_corpus(args.data, enc.n_vocab)
    if corpus.enc._mergeable_ranks != enc._mergeable_ranks:
        raise UserError(f"{desc} was trained with another tokenizer than the corpus "
                        f"{corpus.name}'s: pass the same --data, or --text FILE")
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
    loss = sums.sum() / n_tok.sum()
    bpb = bits_per_byte(sums.sum(), n_bytes.sum())
    ci = lambda f: bootstrap_ci(f, len(sums), args.bootstrap, args.seed)
    loss_ci = ci(lambda i: sums[i].sum() / n_tok[i].sum())
    bpb_ci = ci(lambda i: bits_per_byte(sums[i].sum(), n_bytes[i].sum()))
    print0(f"model {desc} | {source}: {n_tok.sum():,} tokens, {n_bytes.sum():,} bytes "
           f"({n_bytes.sum() / n_tok.sum():.2f} bytes/token), {len(sums)} windows of "
           f"{seq_len} | {time.perf_counter() - t0:.1f} s")
    print0(f"{'':14}{'value':>9}   95% bootstrap CI ({args.bootstrap} resamples of windows)")
    print0(f"{'loss (nats)':14}{loss:9.4f}   [{loss_ci[0]:.4f}, {loss_ci[1]:.4f}]")
    ppl_lo = math.exp(loss_ci[0])
    ppl_hi = math.exp(loss_ci[1])
    print0(f"{'perplexity':14}{math.exp(loss):9.2f}   [{ppl_lo:.2f}, {ppl_hi:.2f}]")
    print0(f"{'bits/byte':14}{bpb:9.4f}   [{bpb_ci[0]:.4f}, {bpb_ci[1]:.4f}]")
    result = dict(loss=loss, ppl=math.exp(loss), bpb=bpb, loss_ci=loss_ci, bpb_ci=bpb_ci)
    if train is not None:       # the context-free baseline, in the same units
        counts = np.bincount(np.asarray(train), minlength=enc.n_vocab) + 1.0
        logp = np.log(counts / counts.sum())
        uni = -sum(logp[t].sum() for t in targets)
        print0(f"unigram baseline (train counts): loss {uni / n_tok.sum():.4f}, "
               f"{bits_per_byte(uni, n_bytes.sum()):.4f} bits/byte; uniform: "
               f"{math.log(enc.n_vocab):.4f} nats/token")
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
    near = [a + d for d in (1, -1, 2, -2, 10, -10, 9, -9, 11, -11, 100)]
    pool = list(dict.fromkeys(c for c in near if c >= 0 and c != a))
    rng = random.Random(f"{seed}:{problem.prompt}")
    return sorted([a] + rng.sample(pool, min(n - 1, len(pool))))


def ranking_accuracy(model, enc, problems, n_choices, seed):
    """-> per problem (right by summed log-likelihood, right by log-likelihood per byte:
    lm-evaluation-harness's acc and acc_norm)."""
    cands = [candidates(p, n_choices, seed) for p in problems]
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(f"{c}{data.TERMINATOR}"))
             for p, cs in zip(problems, cands) for c in cs]
    lps = iter(continuation_logprobs(model, pairs))
    acc, acc_norm = [], []
    for p, cs in zip(problems, cands):
        scores = [next(lps).sum().item() for _ in cs]
        per_byte = [s / len(f"{c}{data.TERMINATOR}".encode()) for s, c in zip(scores, cs)]
        acc.append(str(cs[int(np.argmax(scores))]) == p.answer)
        acc_norm.append(str(cs[int(np.argmax(per_byte))]) == p.answer)
    return np.array(acc, dtype=float), np.array(acc_norm, dtype=float)


def run_task(args, device):
    base, enc, desc = load_base(args, device)
    tuned, _ = task_model(args, enc, device)
    dev, test = eval_problems(args)
    problems = dev + test
    print0(f"{len(problems)} held-out {args.digits}-digit '{args.ops}' problems; "
           f"{args.choices} candidates each (chance {1 / args.choices:.0%})")
    print0(f"{'model':<22}{'generative EM':>22}{'LL rank (acc)':>22}"
           f"{'LL/byte (acc_norm)':>22}{'s':>6}")
    rows, result = {}, {}
    for name, model in (("base LM", base), (f"task SFT ({args.task_preset})", tuned)):
        t0 = time.perf_counter()
        gen = np.array([data.score(enc.decode(a), p.answer) for a, p in
                        zip(greedy_answers(model, enc, problems, args.max_new), problems)])
        acc, acc_norm = ranking_accuracy(model, enc, problems, args.choices, args.seed)
        cells = []
        for v in (gen, acc, acc_norm):
            lo, hi = bootstrap_ci(lambda i: v[i].mean(), len(v), args.bootstrap, args.seed)
            cells.append(f"{v.mean():6.1%} [{lo:.0%},{hi:.0%}]")
        seconds = time.perf_counter() - t0
        print0(f"{name:<22}" + "".join(f"{c:>22}" for c in cells) + f"{seconds:6.1f}")
        rows[name] = [gen.mean(), acc.mean(), acc_norm.mean()]
        ranked_not_generated = float(((acc == 1) & (gen == 0)).mean())
        generated_not_ranked = ((acc == 0) & (gen == 1)).mean()
        result[name] = dict(generative=gen.mean(), ll=acc.mean(), ll_norm=acc_norm.mean(),
                            ll_right_gen_wrong=ranked_not_generated)
        print0(f"{'':<22}ranked right but generated wrong: {ranked_not_generated:.1%} "
               f"of problems; generated right but ranked wrong: {generated_not_ranked:.1%}")
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(f"{c}{data.TERMINATOR}"))
             for p in problems for c in candidates(p, args.choices, args.seed)]
    seconds, lps = {}, {}
    for reuse in (True, False):                  # the harness primitive, both ways
        t0 = time.perf_counter()
        lps[reuse] = continuation_logprobs(tuned, pairs, reuse_cache=reuse)
        seconds[reuse] = time.perf_counter() - t0
    diff = max((a - b).abs().max().item() for a, b in zip(lps[True], lps[False]))
    print0(f"scoring {len(pairs)} continuations: prompt KV cache reused {seconds[True]:.2f} s, "
           f"prompt re-run per candidate {seconds[False]:.2f} s; max |Δ log-prob| {diff:.1e}")
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
# Confidence: what the model's own probabilities say of its greedy answers (calibration.py
# and uncertainty.py read these records)

def answer_records(model, enc, problems, max_new):
    """Greedy answers, whether each is right, and the logits at every answer position
    (of the greedy answer and of the reference answer), so any temperature can be applied
    afterwards without another forward."""
    greedy = greedy_answers(model, enc, problems, max_new)
    prompts = prompt_ids(enc, problems)
    refs = [enc.encode_ordinary(p.answer + data.TERMINATOR) for p in problems]
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
    for g, lg in zip(rec["greedy"], rec["lg_greedy"]):
        lp = F.log_softmax(lg / temperature, -1)
        seq.append(lp.gather(1, torch.tensor(g)[:, None]).sum().exp().item())
        first.append(lp[0, g[0]].exp().item())
        ent.append(-(lp.exp() * lp).sum(-1).mean().item())
    return np.array(seq), np.array(first), np.array(ent)


# ----------------------------------------------------------------------------------------
# calibration, uncertainty and contamination: calibration.py, uncertainty.py and
# contamination.py (split out by concept) run those experiments with this file's metrics
# and models; imported at the mode's call, because they import this file.

def run_calibration(args, device):
    import calibration
    return calibration.run(args, device)


def run_uncertainty(args, device):
    import uncertainty
    return uncertainty.run(args, device)


def run_contamination(args, device):
    import contamination
    return contamination.run(args, device)


# ----------------------------------------------------------------------------------------
# The command line

def parent_parsers():
    """Flags every mode takes, and those of the modes that use the task model."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and run")
    g.add_argument("--checkpoint", default=None,
                   help=f"model checkpoint; not given: {DEFAULT_CKPT}, or a tiny LM trained "
                        "here in seconds when that is absent; 'none' = random tiny")
    g.add_argument("--data", default=None, help="corpus text file (not given: the built-in corpus)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--seed", type=int, default=0, help="problems, splits, sampling, bootstrap")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads (small matmuls)")
    g.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs")
    g.add_argument("--out", default=OUT_DIR, help="where task models are cached")
    g.add_argument("--plots", default=os.path.join("out", "plots"), help="where SVG plots go")
    task = argparse.ArgumentParser(add_help=False)
    g = task.add_argument_group("task model (data.py's arithmetic, SFT cached)")
    g.add_argument("--digits", type=int, default=2, help="digits per operand")
    g.add_argument("--ops", default="+", help="operators, from '+-*'")
    g.add_argument("--task-preset", default="draft", help=f"one of {', '.join(PRESETS)}")
    g.add_argument("--sft-steps", type=int, default=800, help="SFT steps")
    g.add_argument("--sft-batch", type=int, default=64, help="SFT rows per step")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="SFT peak learning rate")
    g.add_argument("--n-train", type=int, default=20000, help="training problems (drawn)")
    g.add_argument("--eval-problems", type=int, default=600, help="held-out draws (deduplicated; "
                   "half dev, half test)")
    g.add_argument("--max-new", type=int, default=8, help="most answer tokens generated")
    return common, task


def parse_args(argv=None):
    fmt = HelpFormatter
    common, task = parent_parsers()
    p = ArgumentParser(description="Evaluate the shared GPT: perplexity, task scoring, "
                                   "calibration, uncertainty, contamination.",
                       formatter_class=fmt)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("ppl", parents=[common], formatter_class=fmt,
                       help="val loss, perplexity, bits/byte with bootstrap CIs")
    s.add_argument("--text", default=None, help="score this UTF-8 file (not given: the val split)")
    s.add_argument("--seq-len", type=int, default=0, help="window length (0 = block size)")
    s.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    s.add_argument("--max-tokens", type=int, default=65536, help="val tokens scored")
    s = sub.add_parser("task", parents=[common, task], formatter_class=fmt,
                       help="generative exact match vs log-likelihood ranking")
    s.add_argument("--choices", type=int, default=4, help="candidate answers per problem")
    s = sub.add_parser("calibration", parents=[common, task], formatter_class=fmt,
                       help="ECE, reliability diagram, temperature scaling")
    s.add_argument("--bins", type=int, default=10, help="equal-width confidence bins")
    s = sub.add_parser("uncertainty", parents=[common, task], formatter_class=fmt,
                       help="wrong-answer detectors: AUROC, accuracy-coverage")
    s.add_argument("--samples", type=int, default=10, help="K answers sampled per problem")
    s.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    s = sub.add_parser("contamination", parents=[common, task], formatter_class=fmt,
                       help="plant test items in a fine-tune; inflation and detectors")
    s.add_argument("--planted", type=int, default=100, help="held-out items planted")
    s.add_argument("--repeats", type=int, default=16, help="copies of each planted item")
    s.add_argument("--ft-clean", type=int, default=3000,
                   help="clean training rows in the fine-tune")
    s.add_argument("--ft-batch", type=int, default=32, help="fine-tune rows per step")
    s.add_argument("--ft-lr", type=float, default=1e-3, help="fine-tune peak learning rate")
    s.add_argument("--ngram", type=int, default=13, help="n of the n-gram overlap detector")
    s.add_argument("--min-k", type=float, default=20.0, help="k of Min-K%% Prob (percent)")
    args = p.parse_args(argv)
    for name in ("bootstrap", "threads", "sft_steps", "sft_batch", "n_train", "eval_problems",
                 "max_new", "batch_size", "max_tokens", "repeats", "ft_clean", "ft_batch", "ngram"):
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, "
                            f"got {getattr(args, name)}")
    if getattr(args, "bins", 1) < 1:
        raise UserError(f"--bins must be at least 1, got {args.bins}")
    if getattr(args, "temperature", 1.0) <= 0:
        raise UserError(f"--temperature must be > 0 (sampling), got {args.temperature}")
    if getattr(args, "choices", 2) < 2:
        raise UserError(f"--choices must be at least 2, got {args.choices}")
    if getattr(args, "planted", 1) < 1 or not 0 < getattr(args, "min_k", 1) <= 100:
        raise UserError("--planted must be at least 1 and --min-k in (0, 100]")
    return args


MODES = {"ppl": run_ppl, "task": run_task, "calibration": run_calibration,
         "uncertainty": run_uncertainty, "contamination": run_contamination}


def main(argv=None):
    args = parse_args(argv)
    no_cuda = args.device == "cuda" and not torch.cuda.is_available()
    if args.device not in ("cpu", "cuda") or no_cuda:
        raise UserError(f"--device {args.device!r}: use cpu, or cuda on a machine that has it")
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    t0 = time.perf_counter()
    result = MODES[args.mode](args, torch.device(args.device))
    print0(f"{args.mode} done in {time.perf_counter() - t0:.1f} s")
    return result


if __name__ == "__main__":
    run_cli(main)
