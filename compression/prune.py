"""
compression/prune.py -- pruning: set weights to zero and keep them there. A part of
quantize.py (compression by zeros, not by fewer bits): it runs as `python quantize.py
prune` and in `compare`, and uses compression/calibrated.py's calibration data,
compression/qat.py's fine-tuning and core/quant_format.py's layer plumbing.

  - scores: magnitude |W_ij|, or Wanda (Sun et al. 2023) |W_ij|·‖X_j‖₂ with the input norm
    over calibration tokens, compared within each output row, no weight update;
  - patterns: unstructured (the lowest-scored fraction of each row), or 2:4 semi-structured
    (two zeros in every four consecutive inputs: what NVIDIA's sparse tensor cores run);
  - masks that stay applied through fine-tuning (MaskedLinear: W ⊙ M in forward).
  saves: nothing as stored here (the checkpoint holds the dense weight with its zeros); a
  2:4 kernel would read the kept values + 2-bit indices (pack_24, measured). costs: the
  loss; Wanda one calibration pass per layer.
"""
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from compression import calibrated
from compression.qat import finetune
from core import quant_format as Q
from core.plumbing import UserError, fmt_bytes, print0



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
    (Wanda's comparison group); 2:4: the two lowest of every four consecutive inputs."""
    out_f, in_f = score.shape
    if pattern == "2:4":
        groups = score.reshape(out_f, -1, 4)
        drop = groups.argsort(-1)[..., :2]
        return torch.ones_like(groups).scatter(-1, drop, 0.0).reshape(out_f, in_f)
    drop = score.argsort(1)[:, :int(in_f * sparsity)]
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


def prune_model(model, batches, sparsity, pattern, criterion):
    """-> calibration forwards used. Wanda runs layer by layer on the pruned earlier
    layers' outputs (Sun et al. 2023, as GPTQ); magnitude needs no data."""
    check_prune(model, sparsity, pattern)
    make = lambda lin, stats: MaskedLinear(lin.weight, prune_mask(
        prune_score(lin.weight.detach(), criterion, stats), sparsity, pattern))
    if criterion == "magnitude":
        Q.swap_linears(model, lambda lin: make(lin, None))
        return 0
    return calibrated.sequential(model, batches, lambda name, lin, stats: make(lin, stats))


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
    passes = prune_model(model, calib, args.sparsity, args.pattern, args.criterion)
    fmt = f"{args.pattern} {args.sparsity:.0%}"
    table.add(ev.row(model, args.criterion, fmt, time.perf_counter() - t0, passes))
    if args.finetune_steps:
        t0 = time.perf_counter()
        seq = min(base.config.block_size, args.seq_len)
        finetune(model, corpus, args.finetune_steps, args.lr, args.batch_size, seq, args.seed + 3)
        table.add(ev.row(model, f"{args.criterion} + {args.finetune_steps} steps", fmt,
                         time.perf_counter() - t0, passes))
    print0("sparsity after pruning" + (" and fine-tuning:" if args.finetune_steps else ":"))
    for line in sparsity_report(model, args.pattern):
        print0(line)
    return model




def compare_rows(base, corpus, ev, calib, args):
    """The pruning rows of `quantize.py compare`: magnitude and Wanda, unstructured and
    2:4 at 50%, then the last (Wanda 2:4) fine-tuned with its masks. Yields ledger rows."""
    for criterion in ("magnitude", "wanda"):
        for pattern in ("unstructured", "2:4"):
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            passes = prune_model(model, calib, 0.5, pattern, criterion)
            yield ev.row(model, criterion, f"{pattern} 50%", time.perf_counter() - t0, passes)
    seq = min(base.config.block_size, args.seq_len)
    t0 = time.perf_counter()
    finetune(model, corpus, args.qat_steps, args.lr, args.batch_size, seq, args.seed + 3)
    yield ev.row(model, f"wanda + {args.qat_steps} steps", "2:4 50%",
                 time.perf_counter() - t0, passes)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nprune.py runs as `python quantize.py prune` (see its --help).")
