"""
core/recipe.py -- the mechanisms every training loop shares, one helper each, so "warmup +
cosine" or "decay the matrices, not the norms" means the same thing in every file
(train.py, parallel.py, training/data_parallel.py):

  - warmup_cosine:   the learning-rate schedule;
  - decay_groups:    AdamW's parameter groups.
(The flat gradient all-reduce, a collective, is core/distributed.py's all_reduce_flat.)
"""
import math


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
