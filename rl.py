"""
rl.py -- reinforcement learning on the shared GPT: REINFORCE -> PPO -> GRPO -> Dr. GRPO, and
on-policy distillation next to its off-policy forms; each measured for what it holds,
samples and costs (the ledger `compare` prints: training/rl_ledger.py).

Run:  python rl.py --algo grpo          # SFT'd `draft` policy (cached in out/rl/), 40 GRPO steps
      python rl.py compare              # all 7 algorithms, same budget, two tables (~4 min)
      torchrun --standalone --nproc_per_node=2 rl.py --algo grpo    # data parallel
      python rl.py --algo grpo --rollout engine --max-offpolicy-steps 2 --tis-cap 2

Task: core/data.py's 2-digit a+b, reward 1 for the exact answer then "\n". A fresh `draft` learns
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
 - Rollouts from a serving engine (--rollout engine), as RL for reasoning models runs now
   (verl, OpenRLHF, torchtitan's RL): serve.py's engine samples on its own copy of the
   weights (paged KV; a group's G answers share its prompt's blocks), the trainer learns,
   and after each step the new weights are synced in place (its cached K/V dropped). The
   engine may run K steps ahead (--max-offpolicy-steps): each batch carries the version
   that sampled it, the clip's ratio uses the sampler's log-probs μ, and --tis-cap C
   weighs each token by min(π_old/μ, C) (truncated IS, training/rl_sync.py). Costs: a
   second copy of the weights, the sync's bytes (an adapter's alone with --lora-rank), the
   mismatch KL(μ‖π_old) it measures (0 in fp32; int8 KV or weights, or staleness, are
   not); --rollout-rank puts the engine on its own torchrun rank, as at scale.
Measured (compare, 2 shared CPU cores): a PPO step costs 1.15-1.5x a GRPO step, REINFORCE
0.55-0.8x (one epoch, not two); the reference/teacher adds 5.7 MB of weights to the policy's
22.7 MB state, the critic 14.3 MB. Generation is a small part here (3-token answers).
"""
import copy
import dataclasses
import importlib
from collections import deque
import math
import numbers
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from core import data
from kvcache import blocks_for
from lora import apply_adapters
from serve import Engine
from serving.requests import SamplingParams
from training import rl_ledger, rl_sync
from training.rl_models import build_models
from training.rl_rollout import (batch_prompts, distill_metrics, evaluate, pack, prompt_room,
                                 sample, token_logprobs)
from model import PRESETS
from core.cli import command_line, fmt_count, knob, require_at_least_one
from core.distributed import all_reduce_flat, setup_runtime
from core.errors import UserError
from core.meters import ActivationMeter, comm, model_state_bytes, StepTimer, tensor_bytes
from core.runtime import print0, Progress, run_cli, TimingConditions

# RL_ALGOS each get a frozen copy of the start policy as π_ref, DISTILL_ALGOS the teacher
# (run_algorithms): what the ledger's "extra held" column counts.
RL_ALGOS = ("reinforce", "ppo", "grpo", "drgrpo")
DISTILL_ALGOS = ("distill", "softkd", "seqkd")
ALGOS = RL_ALGOS + DISTILL_ALGOS
NORMS = ("grpo", "bnpo", "dr_grpo", "dapo")         # TRL's loss_type names, TRL's meanings
ROLLOUTS = ("generate", "engine")                   # --rollout: who samples the answers


# ----------------------------------------------------------------------------------------
# Rewards: a program checks the answer. Any callable f(completion, answer) -> number works.

def make_reward_fn(spec="exact", format_weight=0.0):
    """'exact' = data.score (1 if the answer before the first "\\n" is right), plus
    format_weight · data.format_reward; or 'module:function' of your own."""
    try:
        # 'pkg.mod:fn' -> import pkg.mod, take fn. A failure is one UserError line, before any
        # minutes of SFT: chosen_algos calls this first.
        mod, _, name = spec.partition(":")
        base = data.score if spec == "exact" else getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"--reward {spec!r}: cannot load it ({e}); use 'exact' or "
                        f"'module:function'") from None
    if not format_weight:
        return base

    # A denser signal early (a well-shaped wrong answer earns something), and a reward a
    # policy can hack (right shape, wrong number) once the weight rivals the exact reward's 1.
    def with_format(completion, answer):
        return base(completion, answer) + format_weight * data.format_reward(completion)
    return with_format


def compute_rewards(fn, completions, answers):
    """-> (N,) float rewards. Each value is checked: a bool (True is an int in Python), a
    string, NaN or inf would poison the advantages silently (one NaN makes its whole group's
    mean and std NaN, and then the loss and every weight)."""
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
    r = rewards.view(-1, group_size)  # (prompts, G): rows i·G + k
    adv = r - r.mean(1, keepdim=True)
    if scale:
        # Bessel's n-1, as TRL: G = 2 rewards (0, 1) give std 0.707, not 0.5. eps: a group of
        # equal rewards gives 0/eps = 0, not NaN.
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


def zero_variance_groups(rewards, group_size):
    """How many groups have all G rewards equal: A = 0 on all their tokens, so they teach
    nothing but the KL term -- rollout compute spent for no gradient (DAPO's dynamic sampling
    over-samples and drops such groups; raise --group and fewer groups are all-equal)."""
    r = rewards.view(-1, group_size)
    return int((r == r[:, :1]).all(1).sum())


def k3_kl(logp, ref_logp):
    """KL(π‖π_ref) per token, estimated on samples of π (Schulman's k3): with x = log π_ref -
    log π, e^x - x - 1 ≥ 0 (e^x ≥ 1 + x), 0 where they agree, unbiased since E_π[e^x] = 1."""
    # k1 = -x is unbiased too but negative on some samples; k2 = x²/2 is ≥ 0 but biased;
    # k3 is both (Schulman 2020, "Approximating KL divergence"). Its gradient in log π is
    # 1 - π_ref/π: each sampled token pulled toward π_ref's probability of it.
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def clipped_surrogate(logp, old_logp, adv, eps_low=0.2, eps_high=0.2):
    """Per-token -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) and where the clip was active: a token
    whose ratio already moved past the trust region in A's direction gets no gradient."""
    # ρ from a log difference (a quotient of probabilities would underflow). On the first
    # epoch ρ = 1 up to the rounding between the KV-cache sampling pass and this full forward
    # (~1e-5), so the clip only acts from epoch 2 on (--epochs 1: plain policy gradient).
    ratio = torch.exp(logp - old_logp)
    # min = the pessimistic bound (Schulman et al. 2017, PPO's clipped objective): for A > 0
    # the gain stops at ρ = 1+ε_high, for A < 0 at ρ = 1-ε_low.
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    # Clipped = where the clamped term is the min, so the gradient is 0. A ratio past the
    # OTHER side (A > 0, ρ < 1-ε) is not clipped: a token that moved the wrong way keeps its
    # full gradient back.
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
        # .item() syncs with the GPU; the loop passes the global count rollout already summed
        count = m.sum().item() if global_tokens is None else global_tokens
        return (per_token * m).sum() / (max(count, 1) / world)
    if norm == "dr_grpo":  # a constant: no length bias
        # N = this rank's answers, P·G on every rank: averaged over ranks, sum / (all answers ·
        # max_len). max_len = --max-new, the longest an answer can be.
        return (per_token * m).sum() / (per_token.shape[0] * max_len)
    raise UserError(f"unknown loss normalisation {norm!r}: choose from {', '.join(NORMS)}")


def grpo_loss(logp, old_logp, ref_logp, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0,
              norm="grpo", max_len=None, global_tokens=None, world=1, kl_ratio=False,
              is_weight=None):
    """GRPO / Dr. GRPO: each answer's advantage on all its tokens, clipped ratio, + β·k3.
    kl_ratio (TRL's use_bias_correction_kl, off by default there too): multiply each
    token's k3 by ρ = π_θ/π_old (not detached, as TRL): the tokens were sampled from
    π_old, not π_θ, so E_π_old[ρ·k3] is the KL of π_θ -- the importance-sampling
    correction (DeepSeek-V3.2) that matters from the second epoch on, when π_θ ≠ π_old.
    is_weight: truncated importance sampling's min(π_old/μ, C) per token (rl_sync), for
    tokens a sampler μ drew that is not the trainer's π_old; None = 1."""
    # adv[:, None]: one advantage per answer on all its tokens (DeepSeekMath's outcome
    # supervision: a sequence-level reward, no per-token credit assignment)
    per_token, clipped = clipped_surrogate(logp, old_logp, adv[:, None], eps_low, eps_high)
    if is_weight is not None:  # the policy-gradient term only: the KL below is π_θ's own
        per_token = per_token * is_weight
    if beta:  # β = 0: π_ref is not even read
        kl = k3_kl(logp, ref_logp)
        if kl_ratio:
            kl = kl * torch.exp(logp - old_logp)
        # The KL in the LOSS (GRPO), not in the reward (PPO's k1): neither whitened nor clipped
        # with the advantage, so ÷std_G never rescales its weight β.
        per_token = per_token + beta * kl
    return aggregate(per_token, mask, norm, max_len, global_tokens, world), clipped


def reinforce_loss(logp, rewards, baseline, mask):
    """-(R - b) Σ_t log π(o_t), mean over answers: the score-function estimator of -∇E[R]."""
    # Σ_t log π(o_t): the answer's log-likelihood; R - b is a constant per answer (rewards are
    # data). The mean over this rank's answers: ranks hold equal counts, so the gradient
    # all-reduce's average is the global mean.
    return -((rewards - baseline) * (logp * mask).sum(1)).mean()


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over each answer's tokens (right-padded rows):
    δ_t = r_t + γV_{t+1} - V_t, A_t = δ_t + γλA_{t+1}, V past the answer's end = 0.
    λ = 1: A_t = (return from t) - V_t (unbiased, high variance); λ = 0: one-step TD δ_t.
    -> (advantages, returns = A + V), zero off the mask."""
    m = mask.float()
    goes_on = F.pad(m[:, 1:], (0, 1))              # 1 where the answer has a next token
    next_values = F.pad(values[:, 1:], (0, 1)) * goes_on  # V_{t+1}; 0 past the end
    delta = rewards + gamma * next_values - values
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])          # A_{t+1}, from the answer's end back
    # Backwards over columns. Prompt positions are computed too (their reward is 0) and masked
    # out at the end; goes_on cuts A_{t+1} to 0 past the answer's last token (no bootstrap).
    for t in reversed(range(rewards.shape[1])):
        last = delta[:, t] + gamma * lam * goes_on[:, t] * last
        adv[:, t] = last
    # returns = A + V: the λ-return the critic regresses onto (value_loss)
    return adv * m, (adv + values) * m


def value_loss(values, old_values, returns, mask, clip=0.2, global_tokens=None, world=1):
    """PPO's clipped value loss: ½ max((V - G)², (clip(V, V_old ± ε) - G)²), global token
    mean ("dapo")."""
    # V may move at most ±clip from V_old per batch (value clipping as in OpenAI baselines'
    # PPO2); the max of the two squared errors is pessimistic, as the policy's min is.
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.max((values - returns) ** 2, (v_clip - returns) ** 2)
    return aggregate(per_token, mask, "dapo", global_tokens=global_tokens, world=world)


def soft_kd_loss(student_logits, teacher_logits, mask, tau=2.0, global_tokens=None, world=1):
    """Hinton et al.: τ² · KL(softmax(z_t/τ) ‖ softmax(z_s/τ)) -- FORWARD KL, per position,
    global token mean. τ² keeps gradient size independent of τ."""
    # τ > 1 softens both: the teacher's small probabilities (Hinton's "dark knowledge") carry
    # signal. fp32 log-softmax, as everywhere a loss reads logits.
    t = F.log_softmax(teacher_logits.float() / tau, -1)
    s = F.log_softmax(student_logits.float() / tau, -1)
    per_position = (t.exp() * (t - s)).sum(-1)  # exact: all V terms
    return tau ** 2 * aggregate(per_position, mask, "dapo",
                                global_tokens=global_tokens, world=world)


# ----------------------------------------------------------------------------------------
# Rollouts. The reference: training/rl_rollout.sample, the policy itself sampling G answers
# per prompt with a plain KV cache (each token's log-prob kept). The same contract through
# the serving engine (--rollout engine), as RL stacks sample now: a sampler with its OWN
# copy of the weights (synced after each optimizer step: train()), paged KV, continuous
# batching, and the group's shared prompt computed once.

def build_engine(policy, args, prompt_room):
    """serve.py's engine on a copy of the policy, sized for one step's P·G answers of at
    most prompt_room + max_new tokens. Its log-probs are "processed" (vLLM's logprobs_mode):
    of the distribution each token was drawn from, as the importance ratio needs."""
    # the copy is the sampler: from here on the trainer's steps reach it only by sync
    sampler = copy.deepcopy(policy).requires_grad_(False)
    rl_sync.rounded_weights(sampler, args.engine_weights)    # a quantized checkpoint
    rows = args.prompts * args.group
    per_answer = blocks_for(prompt_room + args.max_new, args.engine_block)
    # the pool must also hold one max-length sequence (the engine's own check)
    room = blocks_for(sampler.config.block_size, args.engine_block)
    kv = None if args.engine_kv == "fp32" else args.engine_kv
    return Engine(sampler, block_size=args.engine_block, num_blocks=rows * per_answer + room,
                  max_num_batched_tokens=rows * (prompt_room + 1), max_num_seqs=rows,
                  kv_dtype=kv, logprobs_mode="processed")


def engine_sample(engine, prompts, n, temperature, max_new, seeds, stop_id):
    """sample()'s contract through the engine -> (answers, their log-probs), answer k of
    prompt i at i·n + k. Each prompt goes in as n requests: the first computes it, the n-1
    others are held behind it (the engine's `after`) and start from its blocks as prefix-
    cache hits. Each request has its own seeded generator (the engine's sampler: other
    draws than sample()'s Gumbel noise, from the same law; greedy: the same tokens)."""
    seqs = []
    for prompt, seed in zip(prompts, seeds):
        first = None
        for k in range(n):
            params = SamplingParams(max_tokens=max_new, temperature=temperature,
                                    seed=(int(seed) * n + k) % 2 ** 63,
                                    stop_token_ids=(stop_id,), logprobs=0)
            seq = engine.add_request(prompt, params, after=first)
            first = first or seq
            seqs.append(seq)
    while engine.has_work():
        engine.step()
    errors = [s.error for s in seqs if s.finish_reason == "error"]
    if errors:                  # a fault the engine isolated: this batch cannot be trained on
        raise RuntimeError(f"engine rollout failed: {errors[0]}")
    # output_ids end with the stop token when it came, as sample()'s answers do
    return [s.output_ids for s in seqs], [[lp for _, lp, _ in s.logprobs] for s in seqs]


# ----------------------------------------------------------------------------------------
# The loop. Data parallel: the global batch of prompts is a function of (seed, step), rank r
# samples its slice; every global statistic (token counts, mean reward, whitening) is summed
# over ranks and gradients are averaged with one flat all-reduce, so 2 ranks == 1 process.

def allsum(*xs, group=None):
    """Sums of a few numbers over the ranks of `group` (None: all; --rollout-rank: the
    trainers). On the GPU under NCCL: it reduces CUDA tensors only."""
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    # float64: token counts and reward sums stay exact far past fp32's 2^24. ONE all-reduce
    # for all of them (each call is a latency). Every rank must call allsum at the same points
    # in the same order, or the job deadlocks: it is never inside a rank-dependent branch.
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64,
                     device="cuda" if nccl else "cpu")
    if torch.distributed.is_initialized():
        comm.all_reduce(t, group=group)
    return t.tolist()


def step_optimizer(params, opt, world, grad_clip, group=None):
    """Average the grads over the ranks (one flat all-reduce), clip the global norm (the
    same on every rank, so replicas stay equal), step. The policy and PPO's critic each."""
    all_reduce_flat([p.grad for p in params], group, divide_by=world)   # data parallel
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def rollout(algo, policy, teacher, enc, args, rt, train_probs, step, temp, reward_fn,
            source=None):
    """Rollout: this rank's slice of the step's global prompts (a function of seed, step),
    G answers each from the policy (seqkd: the teacher's; softkd: the ground truth; from
    `source` when given: an Engine on a synced copy, or the sampler rank's broadcast under
    --rollout-rank, rl_sync.Roles), their rewards, and the global counts. -> the batch: a
    dict the later steps read and extend."""
    P = args.prompts                     # prompts per rank
    G = args.group                       # answers per prompt
    W = rt.world_size                    # the ranks that train
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    probs, prompts, seeds = batch_prompts(args, enc, train_probs, step, rt.rank * P, P)
    roles = source if isinstance(source, rl_sync.Roles) else None
    version = None                       # the policy version that sampled (None: this one)
    if algo == "softkd":
        # ground truth, no sampling; old log-probs 0 (unused: softkd reads the teacher's logits)
        answers = [enc.encode_ordinary(p.answer + data.TERMINATOR) for p in probs]
        old = [[0.0] * len(a) for a in answers]
    elif roles is not None:              # the sampler rank's batch: this trainer's rows
        everyone, lps, version = rl_sync.broadcast_batch(roles, P * G * W, args.max_new,
                                                         device=rt.device)
        mine = slice(rt.rank * P * G, (rt.rank + 1) * P * G)
        answers, old = everyone[mine], lps[mine]
    elif source is not None:             # old: the ENGINE's log-probs, μ
        answers, old = engine_sample(source, prompts[::G], G, temp, args.max_new, seeds, nl)
    else:
        sampler = teacher if algo == "seqkd" else policy  # seqkd: teacher samples
        answers, old = sample(sampler, prompts[::G], G, temp, args.max_new, seeds, nl)  # G each
    texts = [enc.decode(a) for a in answers]
    rewards = compute_rewards(reward_fn, texts, [p.answer for p in probs]).to(rt.device)
    seq, mask, old_logp = pack(prompts, answers, rt.device, old)
    # wrong answers' lengths: Dr. GRPO's claim is that GRPO's 1/|o| lets these grow
    wrong = [len(a) for a, c, p in zip(answers, texts, probs) if not data.score(c, p.answer)]
    group = roles.trainers if roles is not None else None    # the ranks that train
    totals = allsum(mask.sum(), rewards.sum(), len(wrong), sum(wrong), group=group)
    n_tok, r_sum, n_wrong, len_wrong = totals
    n_answers = P * G * W                # in the global batch
    return dict(seq=seq, mask=mask, old_logp=old_logp, rewards=rewards, world=W, group=group,
                n_tok=n_tok, reward=r_sum / n_answers, length=n_tok / n_answers,
                len_wrong=len_wrong / max(n_wrong, 1), version=version)


@torch.no_grad()
def score(algo, b, ref, teacher, critic, temp):
    """Score: what the frozen models say of the sampled tokens, no gradient: π_ref's
    log-probs (the KL), the teacher's logits (distillation), the critic's values (PPO)."""
    inputs = b["seq"][:, :-1]
    # π_ref at the sampling temperature, as old_logp: k3 compares like with like. The teacher:
    # full logits, B·T·V floats held until the loss (softkd needs all; distill one per token).
    b["ref_logp"] = token_logprobs(ref, b["seq"], temp) if ref is not None else None
    b["t_logits"] = teacher(inputs)[0] if algo in ("distill", "softkd") else None
    b["old_values"] = critic(inputs)[0][..., 0] if critic else None  # V_old


def advantages(algo, b, args, m, temp):
    """Advantages, each algorithm's own: REINFORCE R - a running mean; GRPO (R - mean_G)/
    std_G, Dr. GRPO R - mean_G; PPO GAE on the per-token reward, whitened over the global
    batch; on-policy distillation -(log π_s - log π_t) per token. And the KL metric."""
    mask = b["mask"]
    n = max(b["n_tok"], 1)
    if algo == "reinforce":                  # a running-mean baseline (Williams 1992)
        # The baseline is the EMA from BEFORE this batch (step 0: the batch's own mean), so it
        # does not depend on this batch's samples and the estimator stays unbiased. Built from
        # the global mean reward: every rank uses the same baseline.
        reward = m["reward"][-1]
        b["baseline"] = reward if m["baseline"] is None else m["baseline"]
        decay = args.baseline_decay
        m["baseline"] = decay * b["baseline"] + (1 - decay) * reward
    elif algo in ("grpo", "drgrpo"):
        b["adv"] = group_advantages(b["rewards"], args.group, scale=algo == "grpo")
        zero_var = zero_variance_groups(b["rewards"], args.group)
        m["zero_var"] += int(allsum(zero_var, group=b["group"])[0])  # global
        m["groups"] += args.prompts * b["world"]
    elif algo == "ppo":                      # KL in the reward, R at the last token, GAE
        last = mask & ~F.pad(mask[:, 1:], (0, 1))  # where R is paid
        # k1 per token in the REWARD (Ouyang et al. 2022): GAE spreads it back like any reward
        kl_penalty = -args.beta * (b["old_logp"] - b["ref_logp"]) * mask
        tok_r = kl_penalty + b["rewards"][:, None] * last
        adv_t, b["returns"] = gae(tok_r, b["old_values"], mask, args.gamma, args.lam)
        s, s2 = allsum((adv_t * mask).sum(), (adv_t ** 2 * mask).sum(), group=b["group"])
        mean = s / n                         # whiten over the global batch's tokens
        b["adv_t"] = (adv_t - mean) / math.sqrt(max(s2 / n - mean ** 2, 0) + 1e-8)
    elif algo == "distill":                  # dense reward: minus the reverse KL sample
        teacher_logp = token_logprobs(None, b["seq"], temp, b["t_logits"])
        # Each token's own reward: a k1 sample of -KL(π_s‖π_t), no baseline, no GAE, no
        # whitening (test_distill_advantage_is_reverse_kl_gradient checks the expectation)
        b["adv_t"] = -(b["old_logp"] - teacher_logp) * mask
    # The KL columns: metrics only, no gradient (old_logp is data)
    kl = None
    if b["ref_logp"] is not None:            # KL to π_ref (k3)
        kl = k3_kl(b["old_logp"], b["ref_logp"])
    elif algo == "distill":                  # KL to the teacher (k1)
        kl = -b["adv_t"]
    if kl is not None:                       # the same choice on every rank: allsum is safe
        m["kl"].append(allsum((kl * mask).sum(), group=b["group"])[0] / n)


def policy_loss(algo, logits, b, args, norm, temp):
    """The policy's loss on one pass over the batch -> (loss, clipped tokens or None).
    Token means are over the GLOBAL batch ("dapo": 2 ranks == 1 process) except GRPO's,
    which --norm chooses."""
    logp = token_logprobs(None, b["seq"], temp, logits)  # with grad
    mask = b["mask"]
    n = b["n_tok"]
    W = b["world"]
    if algo == "reinforce":
        return reinforce_loss(logp, b["rewards"], b["baseline"], mask), None
    if algo in ("grpo", "drgrpo"):
        # n: the global token count ("dapo" divides by it; "grpo", "bnpo", "dr_grpo" do not)
        return grpo_loss(logp, b["old_logp"], b["ref_logp"], b["adv"], mask, args.eps_low,
                         args.eps_high, args.beta, norm, args.max_new, n, W,
                         args.kl_ratio_correction, b.get("is_weight"))
    if algo in ("ppo", "distill"):
        # per-token advantages; distill runs 1 epoch, so ρ ≈ 1: plain policy gradient
        per_tok, clipped = clipped_surrogate(logp, b["old_logp"], b["adv_t"], args.eps_low,
                                             args.eps_high)
        return aggregate(per_tok, mask, "dapo", global_tokens=n, world=W), clipped
    if algo == "softkd":
        return soft_kd_loss(logits, b["t_logits"], mask, args.tau, n, W), None
    return -aggregate(logp, mask, "dapo", global_tokens=n, world=W), None   # seqkd: CE


def make_critic(policy):
    """PPO's value model: a copy of the policy's trunk, the vocabulary head replaced by one
    scalar per position (zero-init: V = 0 at first). As big as the policy minus its head."""
    # The SFT'd trunk as a start: InstructGPT (Ouyang et al. 2022) initialises the value model
    # from the reward model; with a program for a reward, the policy is the nearest thing.
    critic = copy.deepcopy(policy)
    critic.output = nn.Linear(policy.config.n_embd, 1).to(policy.output.weight.device)
    # weight and bias (nn.Linear's default) zeroed: V = 0 at first, so the first advantages
    # are the γλ-discounted rewards-to-go
    nn.init.zeros_(critic.output.weight)
    nn.init.zeros_(critic.output.bias)
    return critic


def critic_step(critic, copt, b, args, m, rt):
    """PPO's critic: its own forward, backward and step on the clipped value loss."""
    with StepTimer(rt.device) as t, ActivationMeter(critic) as meter:
        # a forward WITH grad (score()'s was no_grad): the critic's activations are its own
        values = critic(b["seq"][:, :-1])[0][..., 0]
        value_loss(values, b["old_values"], b["returns"], b["mask"], args.vf_clip, b["n_tok"],
                   b["world"]).backward()
        step_optimizer(list(critic.parameters()), copt, b["world"], args.grad_clip, b["group"])
    m["critic"] += t.seconds
    m["critic_act"] = max(m["critic_act"], meter.bytes)
    m["critic_state"] = model_state_bytes(critic, copt)["total"]  # PPO's extra state
    copt.zero_grad(set_to_none=True)


def log_step(m, algo, step, args, policy, enc, test_probs):
    """One log line; every --eval-interval steps and at the last, a held-out evaluation
    (greedy, then --eval-samples samples per problem: the slow part), kept as m["end"]."""
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


def policy_step(algo, policy, params, opt, b, args, norm, temp, m, rt):
    """One pass of the policy over the batch: its forward, loss, backward and step, timed and
    metered; the share of clipped tokens (PPO, GRPO, distill) kept per pass."""
    with StepTimer(rt.device) as t, ActivationMeter(policy) as meter:
        # teacher-forced forward WITH grad over prompt + answer: on epoch 1 its
        # log-probs equal old_logp up to rounding; on epoch 2 the policy has moved
        logits = policy(b["seq"][:, :-1])[0]
        loss, clipped = policy_loss(algo, logits, b, args, norm, temp)
        loss.backward()
        step_optimizer(params, opt, b["world"], args.grad_clip, b["group"])
    m["train"] += t.seconds
    m["act"] = max(m["act"], meter.bytes)
    m["state"] = model_state_bytes(policy, opt)["total"]   # grads still held
    opt.zero_grad(set_to_none=True)
    m["trained"] += int(b["n_tok"])  # per epoch
    if clipped is not None:
        n_clipped = allsum((clipped & b["mask"]).sum(), group=b["group"])[0]
        m["clip"].append(n_clipped / max(b["n_tok"], 1))


def make_optimizers(algo, policy, args):
    """AdamW over the policy's trainable parameters (RL: --lr, distillation: --distill-lr)
    and, for PPO only, the critic and its own AdamW. -> (params, opt, critic, critic opt)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    lr = args.lr if algo in RL_ALGOS else args.distill_lr
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if algo != "ppo":
        return params, opt, None, None
    # PPO only: the critic and its AdamW, +16 B/param of state the GRPO path does without
    critic = make_critic(policy)
    copt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
    return params, opt, critic, copt


def sample_batch(algo, policy, teacher, enc, args, rt, train_probs, j, temp, reward_fn,
                 source, m):
    """Batch j from the sampler (rollout), timed, its metrics kept; tagged with the policy
    version that sampled it (the optimizer steps taken so far: m["version"], unless the
    sampler rank says which)."""
    with StepTimer(rt.device) as t:
        b = rollout(algo, policy, teacher, enc, args, rt, train_probs, j, temp, reward_fn,
                    source)
    m["gen"] += t.seconds
    m["sampled"] += int(b["n_tok"]) if algo != "softkd" else 0  # softkd samples none
    for k in ("reward", "length", "len_wrong"):
        m[k].append(b[k])
    if b["version"] is None:
        b["version"] = m["version"]
    return b


@torch.no_grad()
def correct_off_policy(b, policy, args, m, temp):
    """Engine rollouts: the trainer's own π_old of the sampled tokens (a no-grad forward),
    the mismatch KL(μ‖π_old) it shows (0 where sampler and trainer compute alike), and with
    --tis-cap C the truncated importance weight min(π_old/μ, C) -- then the clip's ratio is
    π_θ/π_old, the trainer's own. Without it, μ stands in for π_old (as on-policy GRPO)."""
    trainer_logp = token_logprobs(policy, b["seq"], temp)
    kl_sum, n = allsum(*rl_sync.mismatch_kl(b["old_logp"], trainer_logp, b["mask"]),
                       group=b["group"])
    m["mismatch"].append(kl_sum / max(n, 1))
    if args.tis_cap:
        b["is_weight"] = rl_sync.truncated_is_weight(trainer_logp, b["old_logp"], args.tis_cap)
        b["old_logp"] = trainer_logp


def sync_sampler(policy, source, args, m, rank=0):
    """After the step: the trainer's weights into the engine's copy, in place, and the
    engine's cached K/V dropped -- they were computed by the old weights, and a prefix hit
    on them would sample the next group from a mixture of two policies. Under
    --rollout-rank: trainer 0's broadcast to the sampler rank (which drops its cache)."""
    if isinstance(source, rl_sync.Roles):
        if rank != 0:                   # the other trainers hold the same weights: not sent
            return
        names = rl_sync.trainable_names(policy)
        moved, seconds = rl_sync.broadcast_weights(source, policy, names, receive=False)
    else:
        moved, seconds = rl_sync.sync_weights(policy, source.model, args.engine_weights)
        source.reset_prefix_cache()
    m["sync_bytes"] += moved
    m["sync_s"] += seconds


def train(algo, policy, enc, args, rt, train_probs, test_probs, ref=None, teacher=None,
          roles=None):
    """Run one algorithm for args.steps steps; each step: rollout -> score -> advantages ->
    policy loss and step (`epochs` passes, each followed by PPO's critic step). With an
    engine (--rollout engine) the sampler runs up to K batches ahead (K =
    --max-offpolicy-steps; 0 = on-policy) and gets the new weights after each step; with
    roles (--rollout-rank) the engine is another rank's. -> dict of what was measured."""
    reward_fn = make_reward_fn(args.reward, args.format_reward)
    norm = args.norm or ("dr_grpo" if algo == "drgrpo" else "grpo")
    # Off-policy distillation at T = 1: the teacher's distributions as they are. REINFORCE and
    # distillation take one pass: a second would reuse samples of a policy that moved, with
    # no ratio or clip to correct for it.
    temp = args.temperature if algo not in ("softkd", "seqkd") else 1.0
    epochs = args.epochs if algo in ("ppo", "grpo", "drgrpo") else 1
    params, opt, critic, copt = make_optimizers(algo, policy, args)
    m = new_metrics()
    m["start"] = m["end"] = evaluate(policy, enc, test_probs, args.eval_samples, args.max_new)
    print0(f"{algo}: start | held-out greedy {m['start']['greedy']:.1%} sampled "
           f"{m['start']['sampled']:.1%} | length {m['start']['length']:.2f}")
    source = roles                # who samples: None (the policy), an Engine, or a rank
    if args.rollout == "engine" and roles is None:
        source = build_engine(policy, args, prompt_room(enc, train_probs))
    # the sampler rank runs ahead by itself: a trainer takes each batch as it comes
    ahead_max = 0 if roles is not None else args.max_offpolicy_steps
    # % of the steps and an eta, at most every 10 s (and at the end): the unit that moves
    progress = Progress(algo, args.steps, unit="steps")
    ahead = deque()               # batches sampled, not yet trained on
    for step in range(args.steps):
        # the sampler runs ahead by at most K batches: batch step+K is sampled by the policy
        # of step (K = 0: each batch by the policy that learns from it, today's GRPO)
        while len(ahead) <= ahead_max and step + len(ahead) < args.steps:
            ahead.append(sample_batch(algo, policy, teacher, enc, args, rt, train_probs,
                                      step + len(ahead), temp, reward_fn, source, m))
        b = ahead.popleft()
        m["staleness"].append(m["version"] - b["version"])
        with StepTimer(rt.device) as t:
            score(algo, b, ref, teacher, critic, temp)
            if source is not None:
                correct_off_policy(b, policy, args, m, temp)
        m["score"] += t.seconds
        advantages(algo, b, args, m, temp)  # no forward: arithmetic
        for _ in range(epochs):
            policy_step(algo, policy, params, opt, b, args, norm, temp, m, rt)
            if critic:  # after each policy pass
                critic_step(critic, copt, b, args, m, rt)
        m["version"] += 1
        if source is not None:
            sync_sampler(policy, source, args, m, rt.rank)
        log_step(m, algo, step, args, policy, enc, test_probs)
        progress.update(step + 1)
    critic_params = critic.num_params() if critic else 0
    m.update(algo=algo, params=policy.num_params(), critic_params=critic_params,
             held=held_besides_policy(ref, teacher, critic, m))
    if source is not None:         # the prefix cache's counts: on the sampler rank's engine
        m["engine"] = source.stats if roles is None else None
        rl_ledger.print_engine_line(m, args.steps)
    return m


def sample_for_trainers(policy, enc, args, rt, roles, train_probs):
    """The sampler rank's whole run (--rollout-rank): each step, broadcast batch t to the
    trainers, sample ahead up to batch t+K with the weights it has (while they learn on
    batch t: the overlap K buys), then wait for trainer 0's new weights and drop the cached
    K/V of the old ones. Batch j is the one a single process would sample (same prompts,
    seeds, weights): its trainers' run equals one process's."""
    if args.lora_rank:                  # the trainers' adapters, the same A's (same seed)
        policy = copy.deepcopy(policy)
        apply_adapters(policy, "lora", rank=args.lora_rank, seed=args.seed)
    names = rl_sync.trainable_names(policy)     # before build_engine freezes its copy
    engine = build_engine(policy, args, prompt_room(enc, train_probs))
    nl = enc.encode_ordinary(data.TERMINATOR)[0]
    trainers = roles.sampler            # ranks 0 .. sampler-1 train
    rows = args.prompts * args.group * trainers
    ahead = deque()                     # (answers, log-probs, version) sampled ahead
    version, waited, sampled = 0, 0.0, 0

    def make(j):                        # batch j, every trainer's prompts, this version
        _, prompts, seeds = batch_prompts(args, enc, train_probs, j, 0, args.prompts * trainers)
        answers, lps = engine_sample(engine, prompts[::args.group], args.group,
                                     args.temperature, args.max_new, seeds, nl)
        return answers, lps, version
    for step in range(args.steps):
        if not ahead:
            ahead.append(make(step))
        answers, lps, v = ahead.popleft()
        rl_sync.broadcast_batch(roles, rows, args.max_new, answers, lps, v, rt.device)
        sampled += sum(map(len, answers))
        while len(ahead) < args.max_offpolicy_steps and step + 1 + len(ahead) < args.steps:
            ahead.append(make(step + 1 + len(ahead)))    # overlaps the trainers' step
        with StepTimer(rt.device) as t:                  # idle: waiting for the weights
            rl_sync.broadcast_weights(roles, engine.model, names, True, args.engine_weights)
        waited += t.seconds
        engine.reset_prefix_cache()
        version += 1
    stats = engine.stats
    print(f"sampler rank {rt.rank}: {sampled} tokens for {trainers} trainer rank(s) | "
          f"prefix-cache hits {stats['cached_tokens'] / max(stats['prompt_tokens'], 1):.0%} "
          f"of prompt tokens | waited {waited:.1f} s for weights", flush=True)


def held_besides_policy(ref, teacher, critic, m):
    """What an algorithm holds besides the policy, for the ledger's "extra held" column:
    the frozen models' weights (π_ref, a teacher) and PPO's critic with its AdamW state."""
    held = [(n, tensor_bytes(x.parameters()))
            for n, x in (("ref", ref), ("teacher", teacher)) if x is not None]
    if critic:
        held.append(("V", m["critic_state"]))
    return held


def new_metrics():
    """What train() measures: seconds per phase, tokens, peak activation bytes, and one
    entry per step of reward, length, KL and clip fraction (with an engine: staleness in
    optimizer steps and the sampler/trainer mismatch KL too)."""
    return dict(gen=0.0, score=0.0, train=0.0, critic=0.0,
                sampled=0, trained=0, act=0, critic_act=0,
                zero_var=0, groups=0,
                clip=[], reward=[], length=[], len_wrong=[], kl=[],
                baseline=None,
                # engine rollouts: policy version, staleness and mismatch per batch, sync
                version=0, staleness=[], mismatch=[], sync_bytes=0, sync_s=0.0)


# ----------------------------------------------------------------------------------------
# The runs and their ledger. The models they start from: an SFT'd policy (the distillation
# student too) and a teacher, each trained once by supervised fine-tuning and cached
# (training/rl_models.py); π_ref is a copy of the policy, PPO's critic make_critic's (the
# loop, above). training/rl_rollout.distill_metrics measures the distilled students;
# training/rl_ledger.py lays out the tables of what train() measured.

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
    if args.rollout == "engine" or args.lora_rank:
        # the engine's loop (staleness, sync, the importance weight) is written for the
        # group algorithms: their old log-probs and clip are what the correction acts on
        other = [a for a in algos if a not in ("grpo", "drgrpo")]
        if other:
            raise UserError(f"--rollout engine and --lora-rank train grpo or drgrpo, not "
                            f"{', '.join(other)}")
    if args.rollout_rank and len(algos) > 1:      # the sampler rank serves one run
        raise UserError("--rollout-rank trains one algorithm: give --algo, not compare")
    return algos


def task_problems(args):
    """-> the RL prompts' problems (drawn with --seed) and the distinct held-out ones."""
    train_probs = data.make_problems(args.n_train, args.seed, args.digits, args.ops, "train")
    drawn = data.make_problems(args.eval_problems, args.sft_seed + 1, args.digits, args.ops,
                               "test")
    # "test" split (core/data.py: a hash of the prompt), so no RL or SFT prompt is a test one
    return train_probs, list(dict.fromkeys(drawn))     # distinct held-out problems


def run_algorithms(algos, policy, teacher, enc, args, rt, train_probs, test_probs, roles=None):
    """Each algorithm from a copy of the same SFT'd policy. -> (train()'s measurements per
    algorithm, distillation rows for rl_ledger, {algo: trained weights})."""
    rows = []
    d_rows = []
    saved = {}
    if teacher is not None:
        teacher.requires_grad_(False)
        start = evaluate(policy, enc, test_probs, 1, args.max_new)["greedy"]
        metrics = distill_metrics(policy, teacher, enc, test_probs, args.max_new)
        d_rows.append(("init", "-", "-", 0, 0, start, metrics))
    # one line as each algorithm of a compare starts; one alone counts its steps (train's
    # progress), not 0 of 1 algorithms
    progress = Progress("rl compare", len(algos), every=0)
    for i, algo in enumerate(algos):
        if len(algos) > 1:
            progress.update(i, now_on=algo)
        comm.reset()
        model = copy.deepcopy(policy)        # every algorithm starts from the same SFT'd policy
        if args.lora_rank:   # LoRA RL: the adapter alone trains (LoRA Without Regret, 2025)
            apply_adapters(model, "lora", rank=args.lora_rank, seed=args.seed)
        # π_ref: a frozen copy of the START policy (REINFORCE's loss ignores it: only the KL
        # metric reads it, yet the ledger counts it as held)
        ref = copy.deepcopy(policy).requires_grad_(False) if algo in RL_ALGOS else None
        algo_teacher = teacher if algo in DISTILL_ALGOS else None
        rows.append(train(algo, model, enc, args, rt, train_probs, test_probs, ref,
                          algo_teacher, roles))
        if algo in DISTILL_ALGOS:
            r = rows[-1]
            metrics = distill_metrics(model, teacher, enc, test_probs, args.max_new)
            d_rows.append((algo, *rl_ledger.DISTILL_ROW[algo], r["trained"], r["sampled"],
                           r["end"]["greedy"], metrics))
        saved[algo] = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # --save
        if rt.world_size > 1 or roles is not None:
            print0(comm.report(f"data-parallel communication, {algo} (this rank)"))
    return rows, d_rows, saved


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables)

MODE_KNOBS = [
    knob("mode", "train", "train: one --algo; compare: each of --algos, tables", nargs="?",
         choices=["train", "compare"]),
    knob("--algo", "grpo", f"one of {', '.join(ALGOS)}"),
    knob("--algos", ",".join(ALGOS), "compare: algorithms to run"),
]

RL_KNOBS = [
    knob("--steps", 40, "steps (rollout batches) per algorithm"),
    knob("--prompts", 16, "prompts per step per rank"),
    knob("--group", 8, "G: answers sampled per prompt"),
    knob("--epochs", 2, "passes over each batch (PPO, GRPO, Dr. GRPO; the others take 1): "
         "the clip acts from pass 2 on"),
    knob("--lr", 2e-4, "policy AdamW learning rate"),
    knob("--critic-lr", 3e-4, "PPO critic learning rate"),
    knob("--temperature", 1.0, "sampling temperature"),
    knob("--max-new", 8, "max answer tokens (Dr. GRPO's constant)"),
    knob("--beta", 0.04, "KL weight: GRPO/Dr. GRPO k3 in the loss, PPO k1 in the reward "
         "(REINFORCE: unused)"),
    knob("--eps-low", 0.2, "clip ratio below 1 - eps_low"),
    knob("--eps-high", 0.2, "clip above 1 + eps_high (DAPO: 0.28)"),
    knob("--norm", "", f"GRPO's loss normalisation, TRL's loss_type names {NORMS}; '' = grpo "
         "for grpo, dr_grpo for drgrpo"),
    knob("--kl-ratio-correction", False, "GRPO: multiply the per-token k3 KL by π/π_old "
         "(TRL's use_bias_correction_kl)"),
    knob("--gamma", 1.0, "PPO discount"),
    knob("--lam", 0.95, "PPO GAE λ"),
    knob("--vf-clip", 0.2, "PPO value clip"),
    knob("--baseline-decay", 0.9, "REINFORCE baseline EMA"),
    knob("--grad-clip", 1.0, "0 = off"),
    knob("--reward", "exact", "'exact' or module:function(completion, answer)"),
    knob("--format-reward", 0.0, "+ weight × data.format_reward"),
]

ROLLOUT_KNOBS = [
    knob("--rollout", "generate", "who samples: generate (the policy itself, a plain KV "
         "cache: the reference) or engine (serve.py's engine on a synced copy)",
         choices=ROLLOUTS),
    knob("--max-offpolicy-steps", 0, "K: the engine samples batch t+K while the trainer "
         "learns on batch t (0 = on-policy)"),
    knob("--tis-cap", 0.0, "truncated importance sampling: weigh each token by min(π_old/μ, "
         "C), π_old recomputed by the trainer; 0 = off (μ stands in for π_old)"),
    knob("--engine-kv", "fp32", "the engine's KV cache", choices=["fp32", "int8"]),
    knob("--engine-weights", "fp32", "the sampler's weights: the trainer's, or int8 RTN "
         "per row (a quantized checkpoint)", choices=rl_sync.SAMPLER_WEIGHTS),
    knob("--engine-block", 2, "the engine's KV block (tokens): only full blocks are shared, "
         "and the task's prompts are a few tokens"),
    knob("--rollout-rank", False, "under torchrun: the last rank runs the engine and samples, "
         "the others train; weights and batches go by broadcast"),
    knob("--lora-rank", 0, "train a LoRA adapter of this rank only, the base frozen "
         "(0 = full fine-tuning); the sync then sends the adapter alone"),
]

DISTILL_KNOBS = [
    knob("--teacher", "auto", "checkpoint; auto = a --teacher-preset model SFT'd "
         "--teacher-sft-steps (cached)"),
    knob("--teacher-sft-steps", 3000, "SFT steps of the auto teacher"),
    knob("--teacher-preset", "draft", f"one of {', '.join(PRESETS)}"),
    knob("--distill-lr", 1e-4, "student learning rate"),
    knob("--tau", 2.0, "soft-label KD temperature"),
]

TASK_KNOBS = [
    knob("--digits", 2, "digits per operand"),
    knob("--ops", "+", "operators, from '+-*'"),
    knob("--n-train", 20000, "training problems (drawn)"),
    knob("--eval-problems", 300, "held-out draws (deduplicated)"),
    knob("--eval-samples", 8, "sampled answers per held-out prompt"),
    knob("--eval-interval", 10, "steps between held-out evals"),
    knob("--sft-steps", 1100, "SFT of the RL policy (cached)"),
    knob("--sft-lr", 1e-3, "SFT learning rate"),
    knob("--sft-batch", 64, "SFT batch size"),
    knob("--sft-seed", 0, "SFT data and init seed"),
]

RUN_KNOBS = [
    knob("--checkpoint --ckpt", "out/ckpt.pt", "whose tokenizer; 'none' = 256 bytes (--ckpt: "
         "the old name)", dest="ckpt"),
    knob("--preset", "draft", "the policy (and student)"),
    knob("--cache-dir", os.path.join("out", "rl"), "where SFT'd models are cached; '' = off"),
    knob("--seed", 0, "RL prompts and sampling"),
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--log-interval", 5, "steps between log lines"),
    knob("--save", "", "write {algo: trained weights} here"),
]

KNOBS = {None: MODE_KNOBS, "RL": RL_KNOBS, "rollouts": ROLLOUT_KNOBS,
         "distillation": DISTILL_KNOBS,
         "task and SFT": TASK_KNOBS, "run": RUN_KNOBS}


def parse_args(argv=None):
    p = command_line("RL on the shared GPT (REINFORCE, PPO, GRPO, Dr. GRPO) and on-policy vs "
                     "off-policy distillation, with a ledger of what each costs.", KNOBS)
    args = p.parse_args(argv)
    require_at_least_one(args, ("steps", "prompts", "group", "epochs", "max_new",
                                "eval_samples", "eval_interval", "log_interval", "n_train",
                                "eval_problems", "threads", "sft_batch"))
    if args.norm and args.norm not in NORMS:
        raise UserError(f"unknown loss normalisation {args.norm!r}: "
                        f"choose from {', '.join(NORMS)}")
    # --temperature 0 is allowed (greedy), but then a group's G answers are identical: every
    # group is zero-variance and GRPO / Dr. GRPO never move. Try it and watch zero-var.
    if args.temperature < 0 or args.tau <= 0:
        raise UserError("--temperature must be >= 0 and --tau > 0")
    check_rollout_args(args)
    return args


def check_rollout_args(args):
    """The rollout flags' one-line errors: the engine's knobs need the engine, K >= 0, and
    a cap C >= 1 (below 1 it would shrink even the on-policy tokens' weight)."""
    engine_only = dict(max_offpolicy_steps=0, tis_cap=0.0, engine_kv="fp32",
                       engine_weights="fp32")
    changed = [k for k, v in engine_only.items() if getattr(args, k) != v]
    if args.rollout_rank:
        changed.append("rollout_rank")
    if args.rollout != "engine" and changed:
        raise UserError(f"--{changed[0].replace('_', '-')} needs --rollout engine (generate "
                        f"samples with the trainer's own weights)")
    if args.max_offpolicy_steps < 0 or args.lora_rank < 0 or args.engine_block < 1:
        raise UserError("--max-offpolicy-steps and --lora-rank must be >= 0, --engine-block "
                        ">= 1")
    if args.lora_rank and args.engine_weights != "fp32":   # LoRA's frozen base: not rounded
        raise UserError("--engine-weights int8 rounds plain linears; with --lora-rank the "
                        "adapted layers' base would stay fp32: use one or the other")
    if args.tis_cap and args.tis_cap < 1:
        raise UserError(f"--tis-cap must be 0 (off) or >= 1, got {args.tis_cap}")

def main(argv=None):
    args = parse_args(argv)
    with setup_runtime(args.device) as rt:
        torch.set_num_threads(args.threads)
        algos = chosen_algos(args)
        roles = rl_sync.make_roles(rt.world_size) if args.rollout_rank else None
        t0 = time.perf_counter()
        models = build_models(args, rt, any(a in DISTILL_ALGOS for a in algos))
        enc = models["enc"]
        policy = models["policy"]
        teacher = models.get("teacher")
        train_probs, test_probs = task_problems(args)
        if roles is not None and rt.rank == roles.sampler:   # this rank samples for the rest
            sample_for_trainers(policy, enc, args, rt, roles, train_probs)
            return [], []
        if roles is not None:           # from here on, the world is the ranks that train
            rt = dataclasses.replace(rt, world_size=roles.sampler)
        print0(f"models ready in {time.perf_counter() - t0:.0f} s | {models['desc']} | "
               f"{args.digits}-digit '{args.ops}', {len(test_probs)} held-out problems | "
               f"{args.steps} steps × "
               f"{args.prompts * rt.world_size} prompts × G={args.group}, {rt.world_size} rank(s)")
        with TimingConditions() as conditions:     # the load around the ledger's seconds
            rows, d_rows, saved = run_algorithms(algos, policy, teacher, enc, args, rt,
                                                 train_probs, test_probs, roles)
        cmd = " ".join(["python rl.py", *(sys.argv[1:] if argv is None else argv)])
        print0(f"\nledger ({cmd}; {rt.world_size} rank(s), {rt.device}; times are wall "
               f"seconds: compare ratios, not absolutes):")
        rl_ledger.print_rl_table(rows)
        conditions.report(out=print0)              # one line when too busy to trust them
        if len(d_rows) > 1:
            teacher_acc = evaluate(teacher, enc, test_probs, 1, args.max_new)["greedy"]
            print0(f"distillation: teacher {fmt_count(teacher.num_params())} params, held-out "
                   f"{teacher_acc:.0%}; student = "
                   f"the SFT'd policy; same steps and answers per step for each")
            rl_ledger.print_distill_table(d_rows)
        print0(f"total {time.perf_counter() - t0:.0f} s")
        if args.save and rt.is_main:
            torch.save(saved, args.save)  # rank 0: replicas are equal
        return rows, d_rows


if __name__ == "__main__":
    run_cli(main)