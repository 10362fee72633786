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

The part imports no topic (rl.py builds the engine and calls these); it reads plain modules
and tensors.
"""
import torch

from core.meters import StepTimer, tensor_bytes
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


def sync_weights(trainer, sampler, fmt="fp32"):
    """Copy every TRAINABLE parameter of the trainer into the sampler's same-named one, in
    place, then round it to the sampler's format. Frozen parameters (a LoRA run's base, the
    embedding of a frozen run) are equal since the sampler was copied from the trainer and
    are never sent. -> (bytes moved, seconds)."""
    device = next(trainer.parameters()).device
    trained = {n: p for n, p in trainer.named_parameters() if p.requires_grad}
    with StepTimer(device) as t, torch.no_grad():
        moved = []
        for name, p in sampler.named_parameters():
            if name in trained:
                # in place: the engine's modules keep pointing at the same tensors
                p.copy_(trained[name])
                moved.append(trained[name])
        if len(moved) != len(trained):     # names that differ: two different models
            raise RuntimeError(f"sampler lacks {len(trained) - len(moved)} of the trainer's "
                               f"trainable parameters")
        rounded_weights(sampler, fmt)
    return tensor_bytes(moved), t.seconds


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
