"""
training/rl_rollout.py -- how rl.py's answers are produced and judged without a serving
engine: batch_prompts (which prompts, and each one's sampling seed, make batch j; and
prompt_room, the longest, which an engine is sized for), sample (G answers per prompt with
a plain KV cache, each token's log-prob kept, Gumbel-max noise drawn per PROMPT so a
prompt's answers do not depend on its rank or batch), pack (prompt + answer rows on the
loss's grid), token_logprobs (what the trainer recomputes), evaluate (held-out greedy and
sampled exact match) and distill_metrics (how close a distilled student came to its
teacher, and its exposure bias).

`sample` is the reference rollout (rl.py --rollout generate): the policy samples with its
own weights, one process, in lock-step with training. rl.py's engine path
(--rollout engine) keeps its contract -- same answers layout, the sampler's log-probs --
and tests/test_rl.py holds the two equal where they must be (greedy: the same tokens).
Costs: each prompt's prefill is computed G times (a plain cache shares no prefix between
rows), and done rows keep decoding until the whole bucket is done.
"""
import numpy as np
import torch
import torch.nn.functional as F

from core import data
from core import scores
from model import KVCache


def batch_prompts(args, enc, train_probs, step, first, count):
    """Prompts first .. first+count-1 of step's global batch, each G times, and a sampling
    seed per prompt. -> (problems, prompt token lists, seeds)."""
    # The global batch: P·W prompt indices from (seed, step), the same list on every rank,
    # with replacement; rank r takes P of them. Each prompt G times: rows j·G .. j·G+G-1.
    gidx = np.random.default_rng([args.seed, step]).integers(0, len(train_probs),
                                                             first + count)
    local = range(first, first + count)
    probs = [train_probs[gidx[j]] for j in local for _ in range(args.group)]
    prompts = [enc.encode_ordinary(p.prompt) for p in probs]
    # a sampling seed per GLOBAL prompt index j (SeedSequence mixes (seed, step, j) into
    # well-spread 32-bit seeds): prompt j gets the same answers at any world size
    seeds = [int(np.random.SeedSequence([args.seed, step, j]).generate_state(1)[0])
             for j in local]
    return probs, prompts, seeds


def prompt_room(enc, train_probs):
    """The longest prompt of the task, in tokens: what the engine's pool is sized for."""
    return max(len(enc.encode_ordinary(p.prompt)) for p in train_probs)



def sample(model, prompts, n, temperature, max_new, seeds, stop_id):
    """n answers per prompt. Randomness per PROMPT (a generator seeded by seeds[i], Gumbel-max
    sampling: argmax(log p + Gumbel noise) is a draw from p), so the answers do not depend on
    which rank or batch a prompt lands in: 2 ranks sample what one process samples.
    -> answers (list of token lists, stop token included if produced), their log-probs
    (log-softmax of logits/temperature, the "old" policy)."""
    device = model.output.weight.device
    V = model.config.vocab_size
    # filled in at each answer's place i·n + k, whatever order the length buckets run in
    answers = [None] * (len(prompts) * n)
    logps = [None] * (len(prompts) * n)
    with torch.no_grad():
        for plen in sorted({len(p) for p in prompts}):     # a KV cache holds one length
            ids = [i for i, p in enumerate(prompts) if len(p) == plen]
            # each prompt n times: n rows, its prefill computed n times (a plain cache shares
            # no prefix between rows); one CPU generator per PROMPT: noise blind to batch, rank
            idx = torch.tensor([prompts[i] for i in ids for _ in range(n)], device=device)
            gens = [torch.Generator().manual_seed(int(seeds[i])) for i in ids]
            cache = KVCache(model.config, len(idx), plen + max_new, device)  # room for all
            logits = model(idx, cache=cache)[0][:, -1]  # prefill
            toks = []
            lps = []
            done = torch.zeros(len(idx), dtype=torch.bool, device=device)
            for _ in range(max_new):
                # T = 0 (greedy): log-probs at T = 1, argmax below. Kept: log π_old, at the sampling
                # temperature, which token_logprobs must use again for ρ to start at 1.
                logp = F.log_softmax(logits.float() / (temperature or 1.0), -1)
                if temperature == 0:
                    gumbel = 0                  # greedy: the argmax of log p itself
                else:                           # -log(-log U), U uniform: Gumbel noise
                    # (n, V) uniforms per prompt per token, drawn on the CPU so that the
                    # numbers, and so the answers, are the same on any device
                    uniform = torch.cat([torch.rand(n, V, generator=g) for g in gens])
                    gumbel = -torch.log(-torch.log(uniform.to(device)))
                nxt = (logp + gumbel).argmax(-1)  # Gumbel-max: a draw from p
                toks.append(nxt)
                lps.append(logp.gather(1, nxt[:, None])[:, 0])
                done |= nxt == stop_id  # done rows run on, cut below
                if done.all():
                    break
                logits = model(nxt[:, None], cache=cache)[0][:, -1]  # one token per row
            toks = torch.stack(toks, 1).tolist()
            lps = torch.stack(lps, 1).tolist()
            rows = [(i, k) for i in ids for k in range(n)]   # answer k of prompt i
            for row, (i, k) in enumerate(rows):
                # the stop token is kept: the policy must learn to emit it (its log-prob trains)
                if stop_id in toks[row]:
                    end = toks[row].index(stop_id) + 1
                else:
                    end = len(toks[row])
                answers[i * n + k] = toks[row][:end]
                logps[i * n + k] = lps[row][:end]
    return answers, logps


# The same contract through the serving engine (--rollout engine), as RL stacks sample now:
# a sampler with its OWN copy of the weights (synced after each optimizer step: train()),
# paged KV, continuous batching, and the group's shared prompt computed once.


def pack(prompts, answers, device, *per_token):
    """Rows prompt + answer, right-padded. -> seq (N, L), mask (N, L-1) True where position
    t predicts an answer token, and each per-token list laid out on the same (N, L-1) grid."""
    seq, mask = data.pack_answers(prompts, answers)
    # Each per-token list (e.g. sample's old log-probs) on the mask's grid: position
    # len(p) - 1 + j predicts answer token j; elsewhere 0, and masked out by every loss.
    grids = [torch.zeros(mask.shape) for _ in per_token]
    for i, (p, a) in enumerate(zip(prompts, answers)):
        for g, vals in zip(grids, per_token):
            g[i, len(p) - 1:len(p) - 1 + len(a)] = torch.tensor(vals[i], dtype=torch.float)
    return (seq.to(device), mask.to(device), *(g.to(device) for g in grids))


def token_logprobs(model, seq, temperature=1.0, logits=None):
    """log π(seq[t+1] | seq[:t+1]) for every position, logits/temperature as when sampling."""
    if logits is None:  # else: the caller's forward, reused
        logits = model(seq[:, :-1])[0]
    logp = F.log_softmax(logits.float() / (temperature or 1.0), -1)
    # seq[:, 1:]: the token each position predicts, the shift the mask is on
    return logp.gather(-1, seq[:, 1:, None])[..., 0]


@torch.no_grad()
def evaluate(model, enc, problems, k=8, max_new=8, seed=0):
    """-> greedy exact match, sampled (T=1, k per prompt) exact match, sampled length."""
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    prompts = [enc.encode_ordinary(p.prompt) for p in problems]
    seeds = [seed + i for i in range(len(problems))]
    greedy = scores.greedy_answers(model, enc, problems, max_new)
    sampled, _ = sample(model, prompts, k, 1.0, max_new, seeds, nl)

    def accuracy(outs, per_prompt):
        right = sum(data.score(enc.decode(o), problems[i // per_prompt].answer)  # k per prompt
                    for i, o in enumerate(outs))
        return right / len(outs)
    return dict(greedy=accuracy(greedy, 1), sampled=accuracy(sampled, k),
                length=sum(map(len, sampled)) / len(sampled), greedy_out=greedy)


@torch.no_grad()
def distill_metrics(student, teacher, enc, problems, max_new=8, seed=0):
    """Closeness to the teacher: reverse KL(π_s‖π_t) per token on the student's samples,
    forward KL(π_t‖π_s) on the teacher's (exact sums over the vocabulary); greedy agreement.
    Exposure bias: where the student's own first answer token is a right start ("1" or "11"
    for 116), exact match continuing from ITS OWN start vs from the data's (the BPE's split,
    "11", all off-policy training conditions on). They differ where the student splits the
    number its own way: states only on-policy training visits."""
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    prompts = [enc.encode_ordinary(p.prompt) for p in problems]
    seeds = [seed + i for i in range(len(problems))]
    out = {}
    dev = student.output.weight.device
    for name, sampler in (("rev_kl", student), ("fwd_kl", teacher)):
        answers, _ = sample(sampler, prompts, 4, 1.0, max_new, seeds, nl)  # 4 per prompt
        seq, mask = pack([p for p in prompts for _ in range(4)], answers, dev)
        ls = F.log_softmax(student(seq[:, :-1])[0].float(), -1)
        lt = F.log_softmax(teacher(seq[:, :-1])[0].float(), -1)
        if name == "rev_kl":                # KL(p‖q) with p the sampler's distribution
            p, q = ls, lt
        else:
            p, q = lt, ls
        # exact per position (a sum over the vocabulary), averaged over the answer positions
        kl_sum = ((p.exp() * (p - q)).sum(-1) * mask).sum().item()
        out[name] = kl_sum / mask.sum().item()
    own, _ = sample(student, prompts, 1, 0, max_new, seeds, nl)  # greedy

    def right(i, toks):
        return data.score(enc.decode(toks), problems[i].answer)
    ok = [i for i, o in enumerate(own) if o[:1] != [nl] and
          problems[i].answer.startswith(enc.decode(o[:1]))]   # a right first token
    start = [enc.encode_ordinary(problems[i].answer)[:1] for i in ok]  # the data's split
    from_data_start = [prompts[i] + s for i, s in zip(ok, start)]
    cont, _ = sample(student, from_data_start, 1, 0, max_new, seeds, nl)
    n_ok = max(len(ok), 1)
    out["own"] = sum(right(i, own[i]) for i in ok) / n_ok
    out["data"] = sum(right(i, s + c) for i, s, c in zip(ok, start, cont)) / n_ok
    out["split"] = sum(own[i][:1] != s for i, s in zip(ok, start)) / n_ok
    teach, _ = sample(teacher, prompts, 1, 0, max_new, seeds, nl)
    out["free"] = sum(right(i, o) for i, o in enumerate(own)) / len(problems)
    agree = sum(enc.decode(a) == enc.decode(b) for a, b in zip(own, teach))
    out["agree"] = agree / len(problems)
    return out
