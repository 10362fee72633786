"""
core/recipe.py -- the mechanisms every training loop shares, one helper each, so "warmup +
cosine" or "decay the matrices, not the norms" means the same thing in every file
(train.py, parallel.py, training/data_parallel.py):

  - warmup_cosine:   the learning-rate schedule;
  - decay_groups:    AdamW's parameter groups;
  - all_reduce_flat: one all-reduce over a list of gradients (one bucket).
"""
import math

import torch
import torch.distributed as dist

from core.meters import comm


def warmup_cosine(step, total, warmup, peak, final):
    """The learning rate at `step` (0-based): linear warmup to `peak` over `warmup` steps
    ((step + 1)/warmup · peak), then half a cosine from peak down to `final` at step
    `total` (SGDR, Loshchilov & Hutter 2017; the GPT-3 / Chinchilla recipe)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_groups(tensors, weight_decay):
    """AdamW parameter groups from (tensor, ndim of its parameter) pairs: decay the
    matrices, not the norms' gains and biases (the usual GPT recipe; AdamW, Loshchilov &
    Hutter 2019). ndim is passed separately because a sharded tensor may be flat."""
    return [{"params": [t for t, ndim in tensors if ndim >= 2], "weight_decay": weight_decay},
            {"params": [t for t, ndim in tensors if ndim < 2], "weight_decay": 0.0}]


def all_reduce_flat(tensors, group=None, divide_by=1):
    """Sum a list of tensors (gradients) over the group in ONE all-reduce of their
    concatenation (one bucket: one call's latency instead of one per tensor), divide by
    `divide_by` (the number of replicas, to average), and copy the result back."""
    several = dist.is_initialized() and dist.get_world_size(group) > 1
    if not tensors or (not several and divide_by == 1):
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if several:
        comm.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
