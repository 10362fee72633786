"""
training/rl_sync.py -- what joins an RL trainer to a serving engine that samples for it
(rl.py --rollout engine): the weights going from trainer to sampler, the importance weight
that corrects for a sampler that is not the trainer, and the measurement of how far apart
the two are.

Every RL stack for reasoning models now splits the loop in two: an inference engine
generates (paged KV, continuous batching, prefix caching), a trainer learns, and weights
flow from one to the other (torchtitan's RL experiment, verl, OpenRLHF, AReaL). Three
things follow, one function each below:

  - weight sync: after each optimizer step the trainer's new weights are copied into the
    sampler's, in place (the engine keeps its buffers; its cached K/V of the old weights
    are dropped by the caller: serve.Engine.reset_prefix_cache). Costs the bytes of every
    weight that changed -- 4Ψ for fp32 full fine-tuning, only the adapter's for LoRA (the
    frozen base never changes, so it is never sent) -- and the copy's time.
    Under a sampler that runs a QUANTIZED checkpoint (--engine-weights int8), the synced
    weights are rounded again on arrival, as a serving stack quantizes each new checkpoint.
  - the off-policy correction: the sampler's log-probs μ(a) are not the trainer's π_old(a):
    the sampler may run K optimizer steps behind (--max-offpolicy-steps K) and computes
    with other kernels, another KV precision or rounded weights. Truncated importance
    sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"; Espeholt et al. 2018, IMPALA's truncated ρ) multiplies each token's
    policy-gradient term by w = min(π_old(a)/μ(a), C): unbiased where the ratio is below
    C, a bounded variance always. The clip of GRPO/PPO then acts on π_θ/π_old as usual.
    Costs one more no-grad forward of the batch (π_old recomputed by the trainer).
  - the mismatch itself, measured: the per-token KL(μ‖π_old) on the sampled tokens by the
    k3 estimator r - 1 - log r with r = π_old/μ (Schulman 2020; unbiased, never negative),
    which is exactly 0 where sampler and trainer compute the same numbers.

Under torchrun with --rollout-rank the two are separate processes, as at scale: the last
rank runs the engine and samples for the others, which train (data parallel among
themselves). Each step the sampler broadcasts the batch it made (tokens, μ, the policy
version that made it) and trainer 0 broadcasts the new weights to the sampler over a group
of the two (one flat buffer: one call's latency). What a process group costs at nano scale
is what it costs at scale: bytes on the wire, a trainer idle while the sampler generates
(K = 0), a sampler idle while the trainers learn (unless K > 0 lets it run ahead).

The part imports no topic (rl.py builds the engine and calls these); it reads plain modules
and tensors.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.errors import UserError
from core.meters import comm, StepTimer, tensor_bytes
from core.quant_format import dequantize, rtn, target_linears

# Weight formats a sampler can run (--engine-weights): the trainer's fp32 as they are, or
# int8 round-to-nearest per output row (core/quant_format.py's int8: symmetric, one scale
# per row), dequantized into the sampler's Parameters -- the numbers a quantized checkpoint
# computes with, so the mismatch it causes is the one measured.
SAMPLER_WEIGHTS = ("fp32", "int8")


def rounded_weights(sampler, fmt):
    """Round the sampler's block linears to `fmt` in place (fp32: nothing to do)."""
    if fmt == "fp32":
        return
    with torch.no_grad():
        for _, lin in target_linears(sampler):
            w = lin.weight
            # int8, group = the whole row (in_features): one fp16 scale per output row
            stored = rtn(w.detach().float(), 8, w.shape[1])
            w.copy_(dequantize(stored, w.shape, 8, w.shape[1]).to(w.dtype))


def trainable_names(model):
    """The names of a model's trainable parameters, in order: what a sync sends."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def load_weights(model, names, tensors, fmt="fp32"):
    """The sampler's end of a sync: `tensors` into `model`'s Parameters of those `names`, in
    place (the engine's modules keep pointing at the same tensors), then rounded to its
    format. A name it lacks: two different models, a RuntimeError."""
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(f"the sampler lacks {len(missing)} of the trainer's trainable "
                           f"parameters ({missing[0]}, ...)")
    with torch.no_grad():
        for name, t in zip(names, tensors):
            params[name].copy_(t.view_as(params[name]))
        rounded_weights(model, fmt)


def sync_weights(trainer, sampler, fmt="fp32"):
    """Copy every TRAINABLE parameter of the trainer into the sampler's same-named one, in
    place, then round it to the sampler's format. Frozen parameters (a LoRA run's base) are
    equal since the sampler was copied from the trainer and are never sent.
    -> (bytes moved, seconds)."""
    names = trainable_names(trainer)
    params = dict(trainer.named_parameters())
    sent = [params[n] for n in names]
    with StepTimer(sent[0].device) as t:
        load_weights(sampler, names, sent, fmt)
    return tensor_bytes(sent), t.seconds


def truncated_is_weight(old_logp, sampler_logp, cap):
    """Per-token w = min(π_old/μ, C), no gradient (it weighs the samples, it is not
    learnt). cap = 0: no correction, w = 1 (the sampler's log-probs already stand in for
    π_old in the loss, as on-policy GRPO takes them)."""
    if not cap:
        return None
    # from a log difference (a quotient of probabilities underflows); clamp only above:
    # a ratio below 1 is kept whole (down-weighting is never a variance problem)
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


def mismatch_kl(sampler_logp, trainer_logp, mask):
    """Σ over the answer tokens of k3 = r - 1 - log r, r = π/μ: an unbiased sample of
    KL(μ‖π) per token, since the tokens were drawn from μ. -> (sum, token count)."""
    # float64 and expm1: the gaps measured here are ~1e-4 in log-prob, and k3 ≈ gap²/2 ~
    # 1e-8 is lost to cancellation in fp32's exp(x) - 1 - x (eps 1.2e-7)
    log_r = (trainer_logp.double() - sampler_logp.double()) * mask
    k3 = (torch.expm1(log_r) - log_r) * mask
    return k3.sum().item(), mask.sum().item()


# ----------------------------------------------------------------------------------------
# Separate roles under torchrun (--rollout-rank): the last rank samples, the others train.

@dataclass
class Roles:
    sampler: int        # the sampler's global rank: the last one
    trainers: object    # the trainers' process group: gradient averages, global sums
    link: object        # {trainer 0, sampler}: the weight sync's broadcast


def make_roles(world_size):
    """Every rank must create both groups, in the same order (torch.distributed's rule for
    new_group), even those not in them."""
    if world_size < 2:
        raise UserError("--rollout-rank needs torchrun with at least 2 ranks: the last "
                        "samples, the others train")
    sampler = world_size - 1
    trainers = dist.new_group(list(range(sampler)))
    link = dist.new_group([0, sampler])
    return Roles(sampler, trainers, link)


def broadcast_batch(roles, rows, max_new, answers=None, logps=None, version=0, device="cpu"):
    """The sampler's batch to every trainer: answers (rows of at most max_new tokens) as one
    (rows, max_new) int64 tensor padded with -1, their log-probs as one fp32 tensor, and the
    policy version that sampled them. The sampler passes its lists; a trainer passes None and
    gets them back. -> (answers, logps, version), the whole global batch on every rank.
    device: the ranks' device (NCCL broadcasts CUDA tensors only)."""
    tokens = torch.full((rows, max_new), -1, dtype=torch.int64)
    lp = torch.zeros(rows, max_new)
    head = torch.tensor([version], dtype=torch.int64)
    if answers is not None:             # the sampler: its lists into the padded tensors
        for i, (a, l) in enumerate(zip(answers, logps)):
            tokens[i, :len(a)] = torch.tensor(a, dtype=torch.int64)
            lp[i, :len(l)] = torch.tensor(l)
    head, tokens, lp = (t.to(device) for t in (head, tokens, lp))
    for t in (head, tokens, lp):        # a broadcast to all: a scatter would send each trainer
        comm.broadcast(t, src=roles.sampler)   # only its slice (rows/trainers of them)
    head, tokens, lp = (t.cpu() for t in (head, tokens, lp))
    lengths = (tokens >= 0).sum(1).tolist()
    answers = [row[:n] for row, n in zip(tokens.tolist(), lengths)]
    logps = [row[:n] for row, n in zip(lp.tolist(), lengths)]
    return answers, logps, int(head[0])


def broadcast_weights(roles, model, names, receive, fmt="fp32"):
    """Trainer 0's trainable weights (`names`: trainable_names of the trainer's policy, the
    same list on both sides) to the sampler, in ONE broadcast of their concatenation over
    the two-rank link; the sampler (receive=True) loads them (load_weights) in place and
    rounds them to its format. Called by those two ranks only. -> (bytes, seconds)."""
    by_name = dict(model.named_parameters())
    params = [by_name[n] for n in names]
    with StepTimer(params[0].device) as t, torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
        comm.broadcast(flat, src=0, group=roles.link)
        if receive:
            load_weights(model, names, flat.split([p.numel() for p in params]), fmt)
    return tensor_bytes(params), t.seconds
