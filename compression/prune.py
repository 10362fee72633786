"""
compression/prune.py -- pruning: set weights to zero and keep them there. A part of
quantize.py (compression by zeros, not by fewer bits): it runs as `python quantize.py
prune` and in `compare`, and uses compression/calibrated.py's calibration data,
compression/qat.py's fine-tuning and core/quant_format.py's layer plumbing.

  - scores: magnitude |W_ij|, or Wanda (Sun et al. 2023) |W_ij|·‖X_j‖₂ with the input norm
    over calibration tokens, compared within each output row, no weight update;
  - Wanda's calibration schedule: per-block (default, locuslab/wanda's prune_wanda: a whole
    block's statistics from one forward of the dense block, then all its linears pruned)
    or per-stage (statistics re-collected after each pruned stage: q/k/v, o, w1/w3, w2);
  - patterns: unstructured (the lowest-scored fraction of each row), or 2:4 semi-structured
    (two zeros in every four consecutive inputs: what NVIDIA's sparse tensor cores run);
  - masks that stay applied through fine-tuning (MaskedLinear: W ⊙ M in forward).
  saves: nothing as stored here (the checkpoint holds the dense weight with its zeros); a
  2:4 kernel would read the kept values + 2-bit indices (pack_24, measured). costs: the
  loss; Wanda one calibration pass per block (per-stage: one per stage, 4 per block).
"""
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from compression import calibrated
from compression.qat import finetune_as_flagged
from core import quant_format as Q
from core.cli import fmt_bytes
from core.errors import UserError
from core.runtime import print0


class MaskedLinear(nn.Module):
    """A linear with a fixed 0/1 mask: forward uses W ⊙ M, so pruned weights get a zero
    gradient and stay 0 through fine-tuning. The mask is not part of the stored state: the
    checkpoint holds the dense weight with its zeros (what it costs here)."""

    def __init__(self, weight, mask):
        super().__init__()
        self.weight = nn.Parameter(weight.detach() * mask)
        self.register_buffer("mask", mask, persistent=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        return F.linear(x, self.weight * self.mask)


def prune_mask(score, sparsity, pattern):
    """0 where pruned. unstructured: the int(in·sparsity) lowest scores of each output row
    (Wanda's comparison group); 2:4: the two lowest of every four consecutive inputs.
    Stable sorts, as locuslab/wanda's torch.sort(stable=True): of tied scores (an input no
    token reached scores 0 in every row) the earlier inputs go first. torch's CPU sort is
    stable already; the flag pins it on every device. (The reference's 2:4 uses topk, whose
    order among ties is unspecified: equal masks wherever the four scores differ.)"""
    out_f, in_f = score.shape
    if pattern == "2:4":
        groups = score.reshape(out_f, -1, 4)
        drop = groups.argsort(dim=-1, stable=True)[..., :2]
        return torch.ones_like(groups).scatter(-1, drop, 0.0).reshape(out_f, in_f)
    drop = score.argsort(dim=1, stable=True)[:, :int(in_f * sparsity)]
    return torch.ones_like(score).scatter(1, drop, 0.0)


def prune_score(w, criterion, stats=None):
    """magnitude |W_ij|; Wanda |W_ij|·||X_j||₂ (the input norm over calibration tokens)."""
    if criterion == "magnitude" or stats.n == 0:    # no token reached it: magnitude
        return w.abs()
    return w.abs() * stats.sq_sum.sqrt().float()[None, :]


def check_prune(model, sparsity, pattern):
    if not 0 <= sparsity < 1:
        raise UserError(f"--sparsity must be in [0, 1), got {sparsity}")
    if pattern == "2:4" and sparsity != 0.5:
        raise UserError(f"2:4 keeps 2 of every 4 weights: sparsity is 0.5, not {sparsity}")
    for name, lin in Q.target_linears(model):
        if pattern == "2:4" and lin.in_features % 4:
            raise UserError(f"{name}: input dimension {lin.in_features} is not a multiple of 4")


# Wanda's calibration schedules, both block by block on the pruned earlier blocks' outputs:
#   per-block (the default) is locuslab/wanda's prune_wanda (lib/prune.py): hooks on every
#     linear of a layer, one forward of the calibration batch through the still dense
#     layer, then all its linears pruned from those statistics, then the layer run again
#     with the pruned weights to give the next layer its inputs. So o, w1/w3 and w2 are
#     scored on activations of the dense q/k/v, o, w1/w3 of their own block.
#   per-stage (this repo's earlier rule, kept as an option) re-collects after each pruned
#     stage (q/k/v, then o, then w1/w3, then w2), as GPTQ does (calibrated.sequential):
#     a later stage is scored on the inputs it will really see, at 4 forwards a block.
# Measured on quantize.py's fresh tiny model, 4 calibration batches, 50% (docs/quantize.md,
# "Pruning: equal to / differs from locuslab/wanda"): block 0's q/k/v masks are the same
# (same inputs), the others agree on 95.7-100% of weights; Δ val loss per-block minus
# per-stage over seeds 0/1/2: unstructured +0.0005/-0.0029/+0.0011, 2:4 -0.0036/-0.0001/
# -0.0024 nats. So per-stage buys nothing measurable here, at 4x the calibration forwards.
SCHEDULES = ("per-block", "per-stage")


def wanda_per_block(model, batches, transform):
    """locuslab/wanda's schedule: per block, one calibration forward with hooks on all its
    linears (the block itself still dense; the earlier blocks already pruned, so its inputs
    are the pruned model's), then every linear replaced by transform(name, linear, stats).
    The next block's forward runs through this one pruned: the reference's second pass
    (`outs = layer(inps)` after pruning). Returns the number of calibration forwards."""
    names = {id(m): n for n, m in model.named_modules()}
    for block in model.layers:
        linears = [lin for stage in calibrated.block_stages(block) for lin in stage]
        stats = calibrated.collect_stats(model, batches, linears)
        for lin in linears:
            name = names[id(lin)]
            Q.replace_module(model, name, transform(name, lin, stats[id(lin)]))
    return len(model.layers)


def prune_model(model, batches, sparsity, pattern, criterion, schedule="per-block"):
    """-> calibration forwards used. Wanda runs block by block on the pruned earlier
    blocks' outputs (Sun et al. 2023), by `schedule` (SCHEDULES above); magnitude needs no
    data."""
    check_prune(model, sparsity, pattern)
    if schedule not in SCHEDULES:
        raise UserError(f"unknown Wanda schedule {schedule!r}: use one of {list(SCHEDULES)}")
    make = lambda lin, stats: MaskedLinear(lin.weight, prune_mask(
        prune_score(lin.weight.detach(), criterion, stats), sparsity, pattern))
    # Magnitude compares within each output row here, as Wanda does. locuslab/wanda's own
    # magnitude baseline (prune_magnitude) thresholds the whole matrix instead; measured
    # on the fresh tiny model (seeds 0/1/2, unstructured 50%) that rule loses 0.012/0.006/
    # 0.025 nats less. Not changed here (Wanda is this file's reference): docs/quantize.md.
    if criterion == "magnitude":
        Q.swap_linears(model, lambda lin: make(lin, None))
        return 0
    run = wanda_per_block if schedule == "per-block" else calibrated.sequential
    return run(model, batches, lambda name, lin, stats: make(lin, stats))


def schedule_of(args):
    """--wanda-schedule, per-block when the parser has no such flag."""
    return getattr(args, "wanda_schedule", "per-block")


def method_name(criterion, schedule):
    """The ledger's method column: the non-default Wanda schedule is named in it."""
    return f"{criterion} per-stage" if criterion == "wanda" and schedule != "per-block" \
        else criterion


def pack_24(w, mask):
    """2:4 stored sparse: the two kept values of every four (in order) + their 2-bit
    positions, four per byte: 4 bytes·n/2 + n/8 bytes for fp32 values, vs 4n dense."""
    out_f, in_f = w.shape
    _, order = torch.sort(-mask.reshape(out_f, -1, 4), dim=-1, stable=True)
    idx = order[..., :2].sort(-1).values
    values = w.reshape(out_f, -1, 4).gather(-1, idx)
    return {"values": values.reshape(out_f, -1), "indices": Q.pack_codes(idx, 2)}


def unpack_24(packed, shape):
    out_f, in_f = shape
    idx = Q.unpack_codes(packed["indices"], 2, out_f * in_f // 2).view(out_f, -1, 2)
    w = torch.zeros(out_f, in_f // 4, 4, dtype=packed["values"].dtype)
    return w.scatter(-1, idx, packed["values"].view(out_f, -1, 2)).view(out_f, in_f)


def sparsity_report(model, pattern):
    """Per-layer and total sparsity of the masked linears, and the 2:4 storage bytes."""
    lines, zeros, total, sparse_bytes = [], 0, 0, 0
    for name, m in model.named_modules():
        if isinstance(m, MaskedLinear):
            z = int((m.weight == 0).sum())
            zeros, total = zeros + z, total + m.weight.numel()
            lines.append(f"  {name:<28} {z / m.weight.numel():6.1%} zeros")
            if pattern == "2:4":
                sparse_bytes += Q.stored_nbytes(pack_24(m.weight.detach(), m.mask))
    lines.append(f"  {'total (block linears)':<28} {zeros / max(total, 1):6.1%} zeros of {total:,}")
    if pattern == "2:4":
        lines.append(f"  2:4 stored sparse (fp32 values + 2-bit indices): {fmt_bytes(sparse_bytes)}"
                     f" vs dense {fmt_bytes(4 * total)} -- what a sparse kernel would read; here"
                     f" the weights stay dense, so nothing is saved")
    return lines


def cmd_prune(args, base, corpus, ev, table, int_mm_rows):
    calib = calibrated.calibration(corpus, base, args, "wanda") if args.criterion == "wanda" else []
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    schedule = schedule_of(args)
    passes = prune_model(model, calib, args.sparsity, args.pattern, args.criterion, schedule)
    fmt, name = f"{args.pattern} {args.sparsity:.0%}", method_name(args.criterion, schedule)
    table.add(ev.row(model, name, fmt, time.perf_counter() - t0, passes))
    if args.finetune_steps:
        t0 = time.perf_counter()
        finetune_as_flagged(model, corpus, args.finetune_steps, args)
        table.add(ev.row(model, f"{name} + {args.finetune_steps} steps", fmt,
                         time.perf_counter() - t0, passes))
    print0("sparsity after pruning" + (" and fine-tuning:" if args.finetune_steps else ":"))
    for line in sparsity_report(model, args.pattern):
        print0(line)
    return model


def compare_rows(base, corpus, ev, calib, args):
    """The pruning rows of `quantize.py compare`: magnitude and Wanda, unstructured and
    2:4 at 50%, then the last (Wanda 2:4) fine-tuned with its masks. Yields ledger rows.
    Wanda by --wanda-schedule (per-block when compare's parser has no such flag)."""
    schedule = schedule_of(args)
    for criterion in ("magnitude", "wanda"):
        for pattern in ("unstructured", "2:4"):
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            passes = prune_model(model, calib, 0.5, pattern, criterion, schedule)
            yield ev.row(model, method_name(criterion, schedule), f"{pattern} 50%",
                         time.perf_counter() - t0, passes)
    t0 = time.perf_counter()
    finetune_as_flagged(model, corpus, args.qat_steps, args)
    yield ev.row(model, f"{method_name('wanda', schedule)} + {args.qat_steps} steps", "2:4 50%",
                 time.perf_counter() - t0, passes)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nprune.py runs as `python quantize.py prune` (see its --help).")
