"""
core/scores.py -- the numbers every script reports about a model, defined once: the
validation loss train.py logs, the exact match and answer loss lora.py and rl.py report,
and the log-probabilities of continuations that evaluate.py's log-likelihood scoring,
calibration and contamination experiments are built on.

Why one file: two scripts that each wrote their own "exact match" would disagree about
what a right answer is (where the answer ends, whether the terminator counts). Here an
answer ends at its first "\\n" (data.TERMINATOR), greedy decoding uses the KV cache, and
equal-length prompts are batched together.

Cost: continuation_logprobs runs one prefill per distinct context and reuses its KV cache
for every candidate continuation (reuse_cache=True): for k candidates of length m after a
prompt of length p, p + k·m positions instead of k·(p + m).
"""
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from core import data
from core.errors import UserError
from model import KVCache


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
