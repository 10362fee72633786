"""
rl.py -- reinforcement learning on the shared GPT: REINFORCE -> PPO -> GRPO -> Dr. GRPO, and
on-policy distillation next to its off-policy forms; each measured for what it holds,
samples and costs (the ledger `compare` prints: rl_ledger.py).

Run:  python rl.py --algo grpo          # SFT'd `draft` policy (cached in out/rl/), 40 GRPO steps
      python rl.py compare              # all 7 algorithms, same budget, two tables (~4 min)
      torchrun --standalone --nproc_per_node=2 rl.py --algo grpo    # data parallel

Task: data.py's 2-digit a+b, reward 1 for the exact answer then "\n". A fresh `draft` learns
it by SFT (cached) and stops mid-way, 68% held-out greedy / 48% sampled: room for RL, and
addition is a skill, so RL's gains can show on the 259 held-out problems. (With 1-digit
problems RL took train accuracy 51 -> 79% but never moved the 15 held-out facts.) π_old: the
policy that sampled (its log-probs kept), π_ref: the frozen start, ρ = π_θ/π_old per token.
 - REINFORCE (Williams 1992): ∇E[R] = E[(R - b) ∇ Σ_t log π_θ(o_t)], b a running mean of R.
   Nothing extra held, one gradient step per batch: no ratio, clip or KL.
 - PPO (Schulman et al. 2017; RLHF form of Ouyang et al. 2022): a learnt critic V(s_t), here
   a copy of the policy trunk with a scalar head -- the path GRPO removes: +63% parameters,
   +16 B/param of state, a forward and backward more per epoch; per-token reward
   -β(log π_old - log π_ref) (KL(π‖π_ref), k1, in the reward) + R at the last token, GAE
   (Schulman et al. 2016), clipped -min(ρA, clip(ρ, 1-ε, 1+ε)A), clipped value loss.
 - GRPO (DeepSeekMath, Shao et al. 2024): no critic; G answers per prompt, A = (R - mean_G)/
   std_G on all its tokens, clip ε_low/ε_high (DAPO's clip-higher), + β·KL(π_θ‖π_ref) by
   the k3 estimator π_ref/π - log(π_ref/π) - 1 (unbiased, ≥ 0): holds π_ref, weights only.
   Normalisations, TRL's loss_type names and meanings: "grpo" token mean per answer then
   mean, "bnpo" sum / this rank's tokens, "dapo" sum / the global batch's tokens (= "bnpo"
   on one process), "dr_grpo" sum / (answers · max_new); divisors clamped to >= 1 (an
   all-masked batch gives 0, not NaN). --kl-ratio-correction: k3 × π_θ/π_old, TRL's
   use_bias_correction_kl (off by default, as TRL). Equal-reward groups: A = 0, "zero-var".
 - Dr. GRPO (Liu et al. 2025): A = R - mean_G (÷std up-weights nearly solved and hopeless
   prompts) and the constant normaliser (1/|o| gives each token of a LONG wrong answer a
   smaller penalty, so wrong answers can drift longer). GRPO's memory.
 - On-policy distillation (Agarwal et al. 2024; Lu & Thinking Machines 2025): the student
   samples, the teacher scores each sampled token: reward -(log π_s - log π_t), in
   expectation -KL(π_s‖π_t): REVERSE KL, mode-seeking -- mass the teacher would not put
   there is punished, on prefixes the student itself reaches. Off-policy, same student
   tokens: soft-label KD (Hinton et al. 2015), FORWARD KL(π_t^τ‖π_s^τ) on fixed ground truth,
   mass-covering (cover all the teacher finds plausible); sequence-level KD (Kim & Rush
   2016), cross-entropy on teacher samples. Both learn only from prefixes someone else
   wrote: exposure bias, measured as continuing from its own right start vs the data's.
Measured (compare, 2 shared CPU cores): a PPO step costs 1.15-1.5x a GRPO step, REINFORCE
0.55-0.8x (one epoch, not two); the reference/teacher adds 5.7 MB of weights to the policy's
22.7 MB state, the critic 14.3 MB. Generation is a small part here (3-token answers).
"""
import copy
import importlib
import math
import numbers
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import evaluate as ev
from model import GPT, KVCache, get_config, load_checkpoint, load_model, PRESETS
from plumbing import (ActivationMeter, ArgumentParser, HelpFormatter, Progress, StepTimer,
                      UserError, all_reduce_flat, atomic_save, comm, fmt_bytes, fmt_count,
                      model_state_bytes, print0, run_cli, setup_runtime, tensor_bytes,
                      require_at_least_one)

RL_ALGOS = ("reinforce", "ppo", "grpo", "drgrpo")
DISTILL_ALGOS = ("distill", "softkd", "seqkd")
ALGOS = RL_ALGOS + DISTILL_ALGOS
NORMS = ("grpo", "bnpo", "dr_grpo", "dapo")         # TRL's loss_type names, TRL's meanings


# ----------------------------------------------------------------------------------------
# Rewards: a program checks the answer. Any callable f(completion, answer) -> number works.

def make_reward_fn(spec="exact", format_weight=0.0):
    """'exact' = data.score (1 if the answer before the first "\\n" is right), plus
    format_weight · data.format_reward; or 'module:function' of your own."""
    try:
        mod, _, name = spec.partition(":")
        base = data.score if spec == "exact" else getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"--reward {spec!r}: cannot load it ({e}); use 'exact' or "
                        f"'module:function'") from None
    if not format_weight:
        return base

    def with_format(completion, answer):
        return base(completion, answer) + format_weight * data.format_reward(completion)
    return with_format


def compute_rewards(fn, completions, answers):
    out = []
    for c, a in zip(completions, answers):
        r = fn(c, a)
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise UserError(f"the reward function returned {r!r} ({type(r).__name__}) for "
                            f"completion {c!r}: it must return a finite number")
        out.append(float(r))
    return torch.tensor(out)


# ----------------------------------------------------------------------------------------
# The losses, pure functions of tensors (tested on hand-computed examples): per-token (N, T)
# aligned with `mask` (True on answer tokens), per-answer (N,).

def group_advantages(rewards, group_size, scale=True, eps=1e-4):
    """GRPO: A = (R - mean_G)/(std_G + eps), std Bessel-corrected (TRL); Dr. GRPO: R - mean_G."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


def zero_variance_groups(rewards, group_size):
    r = rewards.view(-1, group_size)
    return int((r == r[:, :1]).all(1).sum())


def k3_kl(logp, ref_logp):
    """KL(π‖π_ref) per token, estimated on samples of π (Schulman's k3): with x = log π_ref -
    log π, e^x - x - 1 ≥ 0 (e^x ≥ 1 + x), 0 where they agree, unbiased since E_π[e^x] = 1."""
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def clipped_surrogate(logp, old_logp, adv, eps_low=0.2, eps_high=0.2):
    """Per-token -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) and where the clip was active: a token
    whose ratio already moved past the trust region in A's direction gets no gradient."""
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return loss, clipped


def aggregate(per_token, mask, norm, max_len=None, global_tokens=None, world=1):
    """Reduce (N, T) per-token losses to this rank's loss; data parallelism then AVERAGES
    the ranks' gradients. As TRL's loss_type: "grpo" each answer's token mean, then the
    mean; "bnpo" sum / this rank's token count (under data parallelism a mean of per-rank
    means: ranks with fewer tokens weigh their tokens more); "dapo" sum / (global token
    count / world): after the average, sum / global count -- every token of the global
    batch weighs the same, so 2 ranks == 1 process; "dr_grpo" sum / (answers · max_len), a
    constant. Every divisor is clamped to >= 1 token (TRL), so an all-masked batch gives
    0, not NaN."""
    m = mask.float()
    if norm == "grpo":     # every answer weighs the same, whatever its length
        return ((per_token * m).sum(1) / m.sum(1).clamp_min(1)).mean()
    if norm == "bnpo":     # every token of this rank's batch weighs the same
        return (per_token * m).sum() / m.sum().clamp_min(1)
    if norm == "dapo":     # every token of the global batch weighs the same
        count = m.sum().item() if global_tokens is None else global_tokens
        return (per_token * m).sum() / (max(count, 1) / world)
    if norm == "dr_grpo":  # a constant: no length bias
        return (per_token * m).sum() / (per_token.shape[0] * max_len)
    raise UserError(f"unknown loss normalisation {norm!r}: choose from {', '.join(NORMS)}")


def grpo_loss(logp, old_logp, ref_logp, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0,
              norm="grpo", max_len=None, global_tokens=None, world=1, kl_ratio=False):
    """GRPO / Dr. GRPO: each answer's advantage on all its tokens, clipped ratio, + β·k3.
    kl_ratio (TRL's use_bias_correction_kl, off by default there too): multiply each
    token's k3 by ρ = π_θ/π_old (not detached, as TRL): the tokens were sampled from
    π_old, not π_θ, so E_π_old[ρ·k3] is the KL of π_θ -- the importance-sampling
    correction (DeepSeek-V3.2) that matters from the second epoch on, when π_θ ≠ π_old."""
    per_token, clipped = clipped_surrogate(logp, old_logp, adv[:, None], eps_low, eps_high)
    if beta:
        kl = k3_kl(logp, ref_logp)
        if kl_ratio:
            kl = kl * torch.exp(logp - old_logp)
        per_token = per_token + beta * kl
    return aggregate(per_token, mask, norm, max_len, global_tokens, world), clipped


def reinforce_loss(logp, rewards, baseline, mask):
    """-(R - b) Σ_t log π(o_t), mean over answers: the score-function estimator of -∇E[R]."""
    return -((rewards - baseline) * (logp * mask).sum(1)).mean()


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over each answer's tokens (right-padded rows):
    δ_t = r_t + γV_{t+1} - V_t, A_t = δ_t + γλA_{t+1}, V past the answer's end = 0.
    λ = 1: A_t = (return from t) - V_t (unbiased, high variance); λ = 0: one-step TD δ_t.
    -> (advantages, returns = A + V), zero off the mask."""
    m = mask.float()
    goes_on = F.pad(m[:, 1:], (0, 1))              # 1 where the answer has a next token
    next_values = F.pad(values[:, 1:], (0, 1)) * goes_on
    delta = rewards + gamma * next_values - values
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])          # A_{t+1}, from the answer's end back
    for t in reversed(range(rewards.shape[1])):
        last = delta[:, t] + gamma * lam * goes_on[:, t] * last
        adv[:, t] = last
    return adv * m, (adv + values) * m


def value_loss(values, old_values, returns, mask, clip=0.2, global_tokens=None, world=1):
    """PPO's clipped value loss: ½ max((V - G)², (clip(V, V_old ± ε) - G)²), global token
    mean ("dapo")."""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.max((values - returns) ** 2, (v_clip - returns) ** 2)
    return aggregate(per_token, mask, "dapo", global_tokens=global_tokens, world=world)


def soft_kd_loss(student_logits, teacher_logits, mask, tau=2.0, global_tokens=None, world=1):
    """Hinton et al.: τ² · KL(softmax(z_t/τ) ‖ softmax(z_s/τ)) -- FORWARD KL, per position,
    global token mean. τ² keeps gradient size independent of τ."""
    t = F.log_softmax(teacher_logits.float() / tau, -1)
    s = F.log_softmax(student_logits.float() / tau, -1)
    per_position = (t.exp() * (t - s)).sum(-1)
    return tau ** 2 * aggregate(per_position, mask, "dapo",
                                global_tokens=global_tokens, world=world)


# ----------------------------------------------------------------------------------------
# Rollouts (sample answers with the KV cache, keep each token's log-prob) and evaluation.

def sample(model, prompts, n, temperature, max_new, seeds, stop_id):
    """n answers per prompt. Randomness per PROMPT (a generator seeded by seeds[i], Gumbel-max
    sampling: argmax(log p + Gumbel noise) is a draw from p), so the answers do not depend on
    which rank or batch a prompt lands in: 2 ranks sample what one process samples.
    -> answers (list of token lists, stop token included if produced), their log-probs
    (log-softmax of logits/temperature, the "old" policy)."""
    device = model.output.weight.device
    V = model.config.vocab_size
    answers = [None] * (len(prompts) * n)
    logps = [None] * (len(prompts) * n)
    with torch.no_grad():
        for plen in sorted({len(p) for p in prompts}):     # a KV cache holds one length
            ids = [i for i, p in enumerate(prompts) if len(p) == plen]
            idx = torch.tensor([prompts[i] for i in ids for _ in range(n)], device=device)
            gens = [torch.Generator().manual_seed(int(seeds[i])) for i in ids]
            cache = KVCache(model.config, len(idx), plen + max_new, device)
            logits = model(idx, cache=cache)[0][:, -1]
            toks = []
            lps = []
            done = torch.zeros(len(idx), dtype=torch.bool, device=device)
            for _ in range(max_new):
                logp = F.log_softmax(logits.float() / (temperature or 1.0), -1)
                if temperature == 0:
                    gumbel = 0                  # greedy: the argmax of log p itself
                else:                           # -log(-log U), U uniform: Gumbel noise
                    uniform = torch.cat([torch.rand(n, V, generator=g) for g in gens])
                    gumbel = -torch.log(-torch.log(uniform.to(device)))
                nxt = (logp + gumbel).argmax(-1)
                toks.append(nxt)
                lps.append(logp.gather(1, nxt[:, None])[:, 0])
                done |= nxt == stop_id
                if done.all():
                    break
                logits = model(nxt[:, None], cache=cache)[0][:, -1]
            toks = torch.stack(toks, 1).tolist()
            lps = torch.stack(lps, 1).tolist()
            rows = [(i, k) for i in ids for k in range(n)]   # answer k of prompt i
            for row, (i, k) in enumerate(rows):
                if stop_id in toks[row]:
                    end = toks[row].index(stop_id) + 1
                else:
                    end = len(toks[row])
                answers[i * n + k] = toks[row][:end]
                logps[i * n + k] = lps[row][:end]
    return answers, logps


def pack(prompts, answers, device, *per_token):
    """Rows prompt + answer, right-padded. -> seq (N, L), mask (N, L-1) True where position
    t predicts an answer token, and each per-token list laid out on the same (N, L-1) grid."""
    seq, mask = data.pack_answers(prompts, answers)
    grids = [torch.zeros(mask.shape) for _ in per_token]
    for i, (p, a) in enumerate(zip(prompts, answers)):
        for g, vals in zip(grids, per_token):
            g[i, len(p) - 1:len(p) - 1 + len(a)] = torch.tensor(vals[i], dtype=torch.float)
    return (seq.to(device), mask.to(device), *(g.to(device) for g in grids))


def token_logprobs(model, seq, temperature=1.0, logits=None):
    """log π(seq[t+1] | seq[:t+1]) for every position, logits/temperature as when sampling."""
    if logits is None:
        logits = model(seq[:, :-1])[0]
    logp = F.log_softmax(logits.float() / (temperature or 1.0), -1)
    return logp.gather(-1, seq[:, 1:, None])[..., 0]


@torch.no_grad()
def evaluate(model, enc, problems, k=8, max_new=8, seed=0):
    """-> greedy exact match, sampled (T=1, k per prompt) exact match, sampled length."""
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    prompts = [enc.encode_ordinary(p.prompt) for p in problems]
    seeds = [seed + i for i in range(len(problems))]
    greedy = ev.greedy_answers(model, enc, problems, max_new)
    sampled, _ = sample(model, prompts, k, 1.0, max_new, seeds, nl)

    def accuracy(outs, per_prompt):
        right = sum(data.score(enc.decode(o), problems[i // per_prompt].answer)
                    for i, o in enumerate(outs))
        return right / len(outs)
    return dict(greedy=accuracy(greedy, 1), sampled=accuracy(sampled, k),
                length=sum(map(len, sampled)) / len(sampled), greedy_out=greedy)


# ----------------------------------------------------------------------------------------
# The models: an SFT'd policy, its frozen reference, PPO's critic, a teacher and a student.

def sft(model, enc, problems, steps, lr=1e-3, batch=32, seed=0, label="sft"):
    """Supervised fine-tuning on "a+b=" -> "c\\n", loss on the answer tokens only."""
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(p.answer + data.TERMINATOR))
             for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng([seed, 1234])
    progress = Progress(label, steps)      # a first run builds its caches for minutes
    for step in range(steps):
        progress.update(step)
        rows = [pairs[i] for i in rng.integers(0, len(pairs), batch)]
        seq, mask = pack([p for p, _ in rows], [a for _, a in rows], model.output.weight.device)
        opt.zero_grad(set_to_none=True)
        (-aggregate(token_logprobs(model, seq), mask, "bnpo")).backward()
        opt.step()
    progress.update(steps)
    return model


def same_tokenizer(a, b):                 # a teacher must score the student's very tokens
    return data.encoding_to_state(a) == data.encoding_to_state(b)


def cached(path, meta, enc, build, rt):
    """Load the model cached at `path` if it was built with the same `meta`, else build it
    and (rank 0) save it in train.py's checkpoint format, so load_model reads it too."""
    if path and os.path.exists(path):
        model, ck = load_model(path, rt.device)
        same = same_tokenizer(data.encoding_from_state(ck["tokenizer"]), enc)
        if ck.get("rl_meta") == meta and same:
            return model
    model = build()
    if path and rt.is_main:
        atomic_save({"config": asdict(model.config), "model": model.state_dict(),
                     "rl_meta": meta, "tokenizer": data.encoding_to_state(enc)}, path)
    return model


def checkpoint_tokenizer(path):
    """The tokenizer a checkpoint carries, read as plain data (model.load_checkpoint: never
    unpickles objects); a file that is not one of ours is one UserError line."""
    ck = load_checkpoint(path)
    if not isinstance(ck, dict) or not isinstance(ck.get("tokenizer"), dict):
        raise UserError(f"{path} carries no tokenizer (not a checkpoint written by train.py)")
    return data.encoding_from_state(ck["tokenizer"])


def make_critic(policy):
    """PPO's value model: a copy of the policy's trunk, the vocabulary head replaced by one
    scalar per position (zero-init: V = 0 at first). As big as the policy minus its head."""
    critic = copy.deepcopy(policy)
    critic.output = nn.Linear(policy.config.n_embd, 1).to(policy.output.weight.device)
    nn.init.zeros_(critic.output.weight)
    nn.init.zeros_(critic.output.bias)
    return critic


def build_models(args, rt, algos):
    """The SFT'd policy (= the distillation student) and the teacher, from fresh inits: `small`
    (Python-pretrained or fresh) learnt this task no faster per step than `draft`, at 3x the
    cost (measured: 8.5% held-out after 400 steps vs draft's 6.6% after 500). Cached."""
    if args.ckpt == "none":        # 256 bytes: tests, no corpus, no checkpoint
        enc = data.make_encoding({bytes([i]): i for i in range(256)})
        desc = "256-byte"
    elif not os.path.exists(args.ckpt):
        raise UserError(f"checkpoint {args.ckpt!r} not found (train one: python train.py)")
    else:                          # the repo's BPE, carried by the checkpoint
        enc = checkpoint_tokenizer(args.ckpt)
        desc = f"BPE of {args.ckpt}"
    train = data.make_problems(args.n_train, args.sft_seed, args.digits, args.ops, "train")
    key = dict(tokenizer=desc, digits=args.digits, ops=args.ops, n_train=args.n_train,
               seed=args.sft_seed, lr=args.sft_lr, batch=args.sft_batch)

    def fresh(name, preset, steps):
        """The SFT'd model `name`: from its cache file when one was built with these
        settings, else trained here (with a progress line) and cached."""
        path = os.path.join(args.cache_dir, f"rl_{name}.pt") if args.cache_dir else ""
        if args.ckpt == "none":
            path = ""                      # byte tokenizer runs (tests) are never cached
        meta = {**key, "preset": preset, "steps": steps}

        def build():
            model = GPT(get_config(preset, vocab_size=enc.n_vocab), seed=args.sft_seed)
            label = f"SFT of the {name} model ({preset}, cached in {path or 'no file'})"
            return sft(model.to(rt.device), enc, train, steps, args.sft_lr, args.sft_batch,
                       args.sft_seed, label=label)
        return cached(path, meta, enc, build, rt)
    out = dict(enc=enc, desc=desc, policy=fresh("sft", args.preset, args.sft_steps))
    if any(a in DISTILL_ALGOS for a in algos):
        if args.teacher == "auto":
            out["teacher"] = fresh("teacher", args.teacher_preset, args.teacher_sft_steps)
        else:
            out["teacher"], ck = load_model(args.teacher, rt.device)
            same = same_tokenizer(data.encoding_from_state(ck["tokenizer"]), enc)
            if not same or out["teacher"].config.vocab_size != enc.n_vocab:
                raise UserError(f"teacher {args.teacher} has a different tokenizer from the "
                                f"student's ({desc}): its log-probs score other tokens")
    return out


# ----------------------------------------------------------------------------------------
# The loop. Data parallel: the global batch of prompts is a function of (seed, step), rank r
# samples its slice; every global statistic (token counts, mean reward, whitening) is summed
# over ranks and gradients are averaged with one flat all-reduce, so 2 ranks == 1 process.

def allsum(*xs):
    """Sums of a few numbers over the ranks (on the GPU under NCCL: it reduces CUDA
    tensors only)."""
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64,
                     device="cuda" if nccl else "cpu")
    if torch.distributed.is_initialized():
        comm.all_reduce(t)
    return t.tolist()


def step_optimizer(params, opt, world, grad_clip):
    all_reduce_flat([p.grad for p in params], divide_by=world)   # data parallel: average
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def rollout(algo, policy, teacher, enc, args, rt, train_probs, step, temp, reward_fn):
    """Rollout: this rank's slice of the step's global prompts (a function of seed, step),
    G answers each from the policy (seqkd: the teacher's; softkd: the ground truth), their
    rewards, and the global counts. -> the batch: a dict the later steps read and extend."""
    P = args.prompts                     # prompts per rank
    G = args.group                       # answers per prompt
    W = rt.world_size
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    gidx = np.random.default_rng([args.seed, step]).integers(0, len(train_probs), P * W)
    local = range(rt.rank * P, (rt.rank + 1) * P)
    probs = [train_probs[gidx[j]] for j in local for _ in range(G)]
    prompts = [enc.encode_ordinary(p.prompt) for p in probs]
    seeds = [int(np.random.SeedSequence([args.seed, step, j]).generate_state(1)[0])
             for j in local]
    if algo == "softkd":
        answers = [enc.encode_ordinary(p.answer + data.TERMINATOR) for p in probs]
        old = [[0.0] * len(a) for a in answers]
    else:
        sampler = teacher if algo == "seqkd" else policy
        answers, old = sample(sampler, prompts[::G], G, temp, args.max_new, seeds, nl)
    texts = [enc.decode(a) for a in answers]
    rewards = compute_rewards(reward_fn, texts, [p.answer for p in probs]).to(rt.device)
    seq, mask, old_logp = pack(prompts, answers, rt.device, old)
    wrong = [len(a) for a, c, p in zip(answers, texts, probs) if not data.score(c, p.answer)]
    totals = allsum(mask.sum(), rewards.sum(), len(wrong), sum(wrong))
    n_tok, r_sum, n_wrong, len_wrong = totals
    n_answers = P * G * W                # in the global batch
    return dict(seq=seq, mask=mask, old_logp=old_logp, rewards=rewards, world=W,
                n_tok=n_tok, reward=r_sum / n_answers, length=n_tok / n_answers,
                len_wrong=len_wrong / max(n_wrong, 1))


@torch.no_grad()
def score(algo, b, ref, teacher, critic, temp):
    """Score: what the frozen models say of the sampled tokens, no gradient: π_ref's
    log-probs (the KL), the teacher's logits (distillation), the critic's values (PPO)."""
    inputs = b["seq"][:, :-1]
    b["ref_logp"] = token_logprobs(ref, b["seq"], temp) if ref is not None else None
    b["t_logits"] = teacher(inputs)[0] if algo in ("distill", "softkd") else None
    b["old_values"] = critic(inputs)[0][..., 0] if critic else None


def advantages(algo, b, args, m, temp):
    """Advantages, each algorithm's own: REINFORCE R - a running mean; GRPO (R - mean_G)/
    std_G, Dr. GRPO R - mean_G; PPO GAE on the per-token reward, whitened over the global
    batch; on-policy distillation -(log π_s - log π_t) per token. And the KL metric."""
    mask = b["mask"]
    n = max(b["n_tok"], 1)
    if algo == "reinforce":                  # a running-mean baseline (Williams 1992)
        reward = m["reward"][-1]
        b["baseline"] = reward if m["baseline"] is None else m["baseline"]
        decay = args.baseline_decay
        m["baseline"] = decay * b["baseline"] + (1 - decay) * reward
    elif algo in ("grpo", "drgrpo"):
        b["adv"] = group_advantages(b["rewards"], args.group, scale=algo == "grpo")
        m["zero_var"] += int(allsum(zero_variance_groups(b["rewards"], args.group))[0])
        m["groups"] += args.prompts * b["world"]
    elif algo == "ppo":                      # KL in the reward, R at the last token, GAE
        last = mask & ~F.pad(mask[:, 1:], (0, 1))
        kl_penalty = -args.beta * (b["old_logp"] - b["ref_logp"]) * mask
        tok_r = kl_penalty + b["rewards"][:, None] * last
        adv_t, b["returns"] = gae(tok_r, b["old_values"], mask, args.gamma, args.lam)
        s, s2 = allsum((adv_t * mask).sum(), (adv_t ** 2 * mask).sum())
        mean = s / n                         # whiten over the global batch's tokens
        b["adv_t"] = (adv_t - mean) / math.sqrt(max(s2 / n - mean ** 2, 0) + 1e-8)
    elif algo == "distill":                  # dense reward: minus the reverse KL sample
        teacher_logp = token_logprobs(None, b["seq"], temp, b["t_logits"])
        b["adv_t"] = -(b["old_logp"] - teacher_logp) * mask
    if b["ref_logp"] is not None:            # KL to π_ref (k3)
        kl = k3_kl(b["old_logp"], b["ref_logp"])
        m["kl"].append(allsum((kl * mask).sum())[0] / n)
    elif algo == "distill":                  # KL to the teacher (k1)
        kl = -b["adv_t"]
        m["kl"].append(allsum((kl * mask).sum())[0] / n)


def policy_loss(algo, logits, b, args, norm, temp):
    """The policy's loss on one pass over the batch -> (loss, clipped tokens or None).
    Token means are over the GLOBAL batch ("dapo": 2 ranks == 1 process) except GRPO's,
    which --norm chooses."""
    logp = token_logprobs(None, b["seq"], temp, logits)
    mask = b["mask"]
    n = b["n_tok"]
    W = b["world"]
    if algo == "reinforce":
        return reinforce_loss(logp, b["rewards"], b["baseline"], mask), None
    if algo in ("grpo", "drgrpo"):
        return grpo_loss(logp, b["old_logp"], b["ref_logp"], b["adv"], mask, args.eps_low,
                         args.eps_high, args.beta, norm, args.max_new, n, W,
                         args.kl_ratio_correction)
    if algo in ("ppo", "distill"):
        per_tok, clipped = clipped_surrogate(logp, b["old_logp"], b["adv_t"], args.eps_low,
                                             args.eps_high)
        return aggregate(per_tok, mask, "dapo", global_tokens=n, world=W), clipped
    if algo == "softkd":
        return soft_kd_loss(logits, b["t_logits"], mask, args.tau, n, W), None
    return -aggregate(logp, mask, "dapo", global_tokens=n, world=W), None   # seqkd: CE


def critic_step(critic, copt, b, args, m, rt):
    """PPO's critic: its own forward, backward and step on the clipped value loss."""
    with StepTimer(rt.device) as t, ActivationMeter(critic) as meter:
        values = critic(b["seq"][:, :-1])[0][..., 0]
        value_loss(values, b["old_values"], b["returns"], b["mask"], args.vf_clip, b["n_tok"],
                   b["world"]).backward()
        step_optimizer(list(critic.parameters()), copt, b["world"], args.grad_clip)
    m["critic"] += t.seconds
    m["critic_act"] = max(m["critic_act"], meter.bytes)
    m["critic_state"] = model_state_bytes(critic, copt)["total"]
    copt.zero_grad(set_to_none=True)


def log_step(m, algo, step, args, policy, enc, test_probs):
    kl = m["kl"][-1] if m["kl"] else 0
    clip = m["clip"][-1] if m["clip"] else 0
    line = (f"step {step + 1:3d} | {algo} | reward {m['reward'][-1]:.3f} | len "
            f"{m['length'][-1]:.2f} | kl {kl:.4f} | clip {clip:.1%}")
    if m["groups"]:
        line += f" | zero-var {m['zero_var']}/{m['groups']}"
    if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
        e = evaluate(policy, enc, test_probs, args.eval_samples, args.max_new)
        line += f" | held-out {e['greedy']:.1%} greedy, {e['sampled']:.1%} sampled"
        m["end"] = e
    if (step + 1) % args.log_interval == 0 or "held-out" in line:
        print0(line + f" | gen {m['gen']:.1f}s train {m['train'] + m['critic']:.1f}s")


def train(algo, policy, enc, args, rt, train_probs, test_probs, ref=None, teacher=None):
    """Run one algorithm for args.steps steps; each step: rollout -> score -> advantages ->
    policy loss and step (`epochs` passes, each followed by PPO's critic step). -> dict of
    what was measured."""
    W = rt.world_size
    reward_fn = make_reward_fn(args.reward, args.format_reward)
    norm = args.norm or ("dr_grpo" if algo == "drgrpo" else "grpo")
    temp = args.temperature if algo not in ("softkd", "seqkd") else 1.0
    epochs = args.epochs if algo in ("ppo", "grpo", "drgrpo") else 1
    params = [p for p in policy.parameters() if p.requires_grad]
    lr = args.lr if algo in RL_ALGOS else args.distill_lr
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    critic = None
    copt = None
    if algo == "ppo":
        critic = make_critic(policy)
        copt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
    m = new_metrics()
    m["start"] = m["end"] = evaluate(policy, enc, test_probs, args.eval_samples, args.max_new)
    print0(f"{algo}: start | held-out greedy {m['start']['greedy']:.1%} sampled "
           f"{m['start']['sampled']:.1%} | length {m['start']['length']:.2f}")
    for step in range(args.steps):
        with StepTimer(rt.device) as t:
            b = rollout(algo, policy, teacher, enc, args, rt, train_probs, step, temp, reward_fn)
        m["gen"] += t.seconds
        m["sampled"] += int(b["n_tok"]) if algo != "softkd" else 0
        for k in ("reward", "length", "len_wrong"):
            m[k].append(b[k])
        with StepTimer(rt.device) as t:
            score(algo, b, ref, teacher, critic, temp)
        m["score"] += t.seconds
        advantages(algo, b, args, m, temp)
        for _ in range(epochs):
            with StepTimer(rt.device) as t, ActivationMeter(policy) as meter:
                logits = policy(b["seq"][:, :-1])[0]
                loss, clipped = policy_loss(algo, logits, b, args, norm, temp)
                loss.backward()
                step_optimizer(params, opt, W, args.grad_clip)
            m["train"] += t.seconds
            m["act"] = max(m["act"], meter.bytes)
            m["state"] = model_state_bytes(policy, opt)["total"]   # grads still held
            opt.zero_grad(set_to_none=True)
            m["trained"] += int(b["n_tok"])
            if clipped is not None:
                n_clipped = allsum((clipped & b["mask"]).sum())[0]
                m["clip"].append(n_clipped / max(b["n_tok"], 1))
            if critic:
                critic_step(critic, copt, b, args, m, rt)
        log_step(m, algo, step, args, policy, enc, test_probs)
    # what this algorithm holds besides the policy: frozen models' weights, PPO's critic
    held = [(n, tensor_bytes(x.parameters()))
            for n, x in (("ref", ref), ("teacher", teacher)) if x is not None]
    if critic:
        held.append(("V", m["critic_state"]))
    critic_params = critic.num_params() if critic else 0
    m.update(algo=algo, params=policy.num_params(), critic_params=critic_params, held=held)
    return m


def new_metrics():
    """What train() measures: seconds per phase, tokens, peak activation bytes, and one
    entry per step of reward, length, KL and clip fraction."""
    return dict(gen=0.0, score=0.0, train=0.0, critic=0.0,
                sampled=0, trained=0, act=0, critic_act=0,
                zero_var=0, groups=0,
                clip=[], reward=[], length=[], len_wrong=[], kl=[],
                baseline=None)


# ----------------------------------------------------------------------------------------
# The ledger: rl_ledger.py measures the distilled students (distill_metrics) and lays out
# what train() measured; imported here at the run, because it imports this file.

def chosen_algos(args):
    """The algorithms this run trains, each checked before minutes of model building."""
    algos = args.algos.split(",") if args.mode == "compare" else [args.algo]
    for a in algos:
        if a not in ALGOS:
            raise UserError(f"unknown algorithm {a!r}: choose from {', '.join(ALGOS)}")
        if a in ("grpo", "drgrpo") and args.group < 2:
            raise UserError(f"{a} needs --group G >= 2: the advantage is a reward minus its "
                            f"group's mean, and a group of one is always 0")
    make_reward_fn(args.reward, args.format_reward)          # a bad --reward fails now
    return algos


def run_algorithms(algos, policy, teacher, enc, args, rt, train_probs, test_probs):
    """Each algorithm from a copy of the same SFT'd policy. -> (train()'s measurements per
    algorithm, distillation rows for rl_ledger, {algo: trained weights})."""
    import rl_ledger
    rows = []
    d_rows = []
    saved = {}
    if teacher is not None:
        teacher.requires_grad_(False)
        start = evaluate(policy, enc, test_probs, 1, args.max_new)["greedy"]
        metrics = rl_ledger.distill_metrics(policy, teacher, enc, test_probs, args.max_new)
        d_rows.append(("init", "-", "-", 0, 0, start, metrics))
    for algo in algos:
        comm.reset()
        model = copy.deepcopy(policy)        # every algorithm starts from the same SFT'd policy
        ref = copy.deepcopy(policy).requires_grad_(False) if algo in RL_ALGOS else None
        algo_teacher = teacher if algo in DISTILL_ALGOS else None
        rows.append(train(algo, model, enc, args, rt, train_probs, test_probs, ref,
                          algo_teacher))
        if algo in DISTILL_ALGOS:
            r = rows[-1]
            metrics = rl_ledger.distill_metrics(model, teacher, enc, test_probs, args.max_new)
            d_rows.append((algo, *rl_ledger.DISTILL_ROW[algo], r["trained"], r["sampled"],
                           r["end"]["greedy"], metrics))
        saved[algo] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if rt.world_size > 1:
            print0(comm.report(f"data-parallel communication, {algo} (this rank)"))
    return rows, d_rows, saved


def main(argv=None):
    args = parse_args(argv)
    rt = setup_runtime(args.device)
    torch.set_num_threads(args.threads)
    algos = chosen_algos(args)
    t0 = time.perf_counter()
    models = build_models(args, rt, algos)
    enc = models["enc"]
    policy = models["policy"]
    teacher = models.get("teacher")
    train_probs = data.make_problems(args.n_train, args.seed, args.digits, args.ops, "train")
    drawn = data.make_problems(args.eval_problems, args.sft_seed + 1, args.digits, args.ops,
                               "test")
    test_probs = list(dict.fromkeys(drawn))     # distinct held-out problems
    print0(f"models ready in {time.perf_counter() - t0:.0f} s | {models['desc']} | {args.digits}"
           f"-digit '{args.ops}', {len(test_probs)} held-out problems | {args.steps} steps × "
           f"{args.prompts * rt.world_size} prompts × G={args.group}, {rt.world_size} rank(s)")
    rows, d_rows, saved = run_algorithms(algos, policy, teacher, enc, args, rt, train_probs,
                                         test_probs)
    import rl_ledger
    cmd = " ".join(["python rl.py", *(sys.argv[1:] if argv is None else argv)])
    print0(f"\nledger ({cmd}; {rt.world_size} rank(s), {rt.device}; times are wall seconds "
           f"on a shared CPU: compare ratios, not absolutes):")
    rl_ledger.print_rl_table(rows)
    if len(d_rows) > 1:
        teacher_acc = evaluate(teacher, enc, test_probs, 1, args.max_new)["greedy"]
        print0(f"distillation: teacher {fmt_count(teacher.num_params())} params, held-out "
               f"{teacher_acc:.0%}; student = "
               f"the SFT'd policy; same steps and answers per step for each")
        rl_ledger.print_distill_table(d_rows)
    print0(f"total {time.perf_counter() - t0:.0f} s")
    if args.save and rt.is_main:
        torch.save(saved, args.save)
    return rows, d_rows


def add_rl_flags(g):
    g.add_argument("--steps", type=int, default=40, help="steps (rollout batches) per algorithm")
    g.add_argument("--prompts", type=int, default=16, help="prompts per step per rank")
    g.add_argument("--group", type=int, default=8, help="G: answers sampled per prompt")
    g.add_argument("--epochs", type=int, default=2,
                   help="passes over each batch (PPO, GRPO, "
                        "Dr. GRPO; the others take 1): the clip acts from pass 2 on")
    g.add_argument("--lr", type=float, default=2e-4, help="policy AdamW learning rate")
    g.add_argument("--critic-lr", type=float, default=3e-4, help="PPO critic learning rate")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--max-new", type=int, default=8,
                   help="max answer tokens (Dr. GRPO's constant)")
    g.add_argument("--beta", type=float, default=0.04,
                   help="KL weight: GRPO/Dr. GRPO k3 in the "
                        "loss, PPO k1 in the reward (REINFORCE: unused)")
    g.add_argument("--eps-low", type=float, default=0.2, help="clip ratio below 1 - eps_low")
    g.add_argument("--eps-high", type=float, default=0.2,
                   help="clip above 1 + eps_high (DAPO: 0.28)")
    g.add_argument("--norm", default="",
                   help=f"GRPO's loss normalisation, TRL's loss_type "
                        f"names {NORMS}; '' = grpo for grpo, dr_grpo for drgrpo")
    g.add_argument("--kl-ratio-correction", action="store_true",
                   help="GRPO: multiply the "
                        "per-token k3 KL by π/π_old (TRL's use_bias_correction_kl)")
    g.add_argument("--gamma", type=float, default=1.0, help="PPO discount")
    g.add_argument("--lam", type=float, default=0.95, help="PPO GAE λ")
    g.add_argument("--vf-clip", type=float, default=0.2, help="PPO value clip")
    g.add_argument("--baseline-decay", type=float, default=0.9, help="REINFORCE baseline EMA")
    g.add_argument("--grad-clip", type=float, default=1.0, help="0 = off")
    g.add_argument("--reward", default="exact",
                   help="'exact' or module:function(completion, answer)")
    g.add_argument("--format-reward", type=float, default=0.0,
                   help="+ weight × data.format_reward")


def add_distill_flags(g):
    g.add_argument("--teacher", default="auto",
                   help="checkpoint; auto = a --teacher-preset "
                        "model SFT'd --teacher-sft-steps (cached)")
    g.add_argument("--teacher-sft-steps", type=int, default=3000,
                   help="SFT steps of the auto teacher")
    g.add_argument("--teacher-preset", default="draft", help=f"one of {', '.join(PRESETS)}")
    g.add_argument("--distill-lr", type=float, default=1e-4, help="student learning rate")
    g.add_argument("--tau", type=float, default=2.0, help="soft-label KD temperature")


def add_task_flags(g):
    g.add_argument("--digits", type=int, default=2, help="digits per operand")
    g.add_argument("--ops", default="+", help="operators, from '+-*'")
    g.add_argument("--n-train", type=int, default=20000, help="training problems (drawn)")
    g.add_argument("--eval-problems", type=int, default=300,
                   help="held-out draws (deduplicated)")
    g.add_argument("--eval-samples", type=int, default=8,
                   help="sampled answers per held-out prompt")
    g.add_argument("--eval-interval", type=int, default=10, help="steps between held-out evals")
    g.add_argument("--sft-steps", type=int, default=1100, help="SFT of the RL policy (cached)")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="SFT learning rate")
    g.add_argument("--sft-batch", type=int, default=64, help="SFT batch size")
    g.add_argument("--sft-seed", type=int, default=0, help="SFT data and init seed")


def add_run_flags(g):
    g.add_argument("--ckpt", default="out/ckpt.pt", help="whose tokenizer; 'none' = 256 bytes")
    g.add_argument("--preset", default="draft", help="the policy (and student)")
    g.add_argument("--cache-dir", default=os.path.join("out", "rl"),
                   help="where SFT'd models are cached; '' = off")
    g.add_argument("--seed", type=int, default=0, help="RL prompts and sampling")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    g.add_argument("--log-interval", type=int, default=5, help="steps between log lines")
    g.add_argument("--save", default="", help="write {algo: trained weights} here")


def parse_args(argv=None):
    p = ArgumentParser(
        description="RL on the shared GPT (REINFORCE, PPO, GRPO, Dr. GRPO) and on-policy vs "
                    "off-policy distillation, with a ledger of what each costs.",
        formatter_class=HelpFormatter)
    p.add_argument("mode", nargs="?", default="train", choices=["train", "compare"],
                   help="train: one --algo; compare: each of --algos, tables")
    p.add_argument("--algo", default="grpo", help=f"one of {', '.join(ALGOS)}")
    p.add_argument("--algos", default=",".join(ALGOS), help="compare: algorithms to run")
    add_rl_flags(p.add_argument_group("RL"))
    add_distill_flags(p.add_argument_group("distillation"))
    add_task_flags(p.add_argument_group("task and SFT"))
    add_run_flags(p.add_argument_group("run"))
    args = p.parse_args(argv)
    require_at_least_one(args, ("steps", "prompts", "group", "epochs", "max_new",
                                "eval_samples", "eval_interval", "log_interval", "n_train",
                                "eval_problems", "threads", "sft_batch"))
    if args.norm and args.norm not in NORMS:
        raise UserError(f"unknown loss normalisation {args.norm!r}: "
                        f"choose from {', '.join(NORMS)}")
    if args.temperature < 0 or args.tau <= 0:
        raise UserError("--temperature must be >= 0 and --tau > 0")
    return args


if __name__ == "__main__":
    run_cli(main)
