"""
compression/calibrated.py -- post-training quantization that looks at calibration activations first:
GPTQ (the inverse Hessian H = 2XXᵀ spreads each column's rounding error onto the columns
not yet quantized), AWQ (scale up the input channels whose mean |x| is large before
rounding) and SmoothQuant (move activation outliers into the weights so both are int8).

A part of quantize.py, imported one way: core/quant_format.py holds the format (what is
stored, how it is packed, round-to-nearest as the baseline) and the quantized linear
layer, quantize.py the ledger and the command line; this file holds what calibration data
buys. It runs as `python quantize.py gptq | awq | smoothquant`.

What each costs (the header of quantize.py has the whole ledger):
  - statistics: one calibration forward per stage of linears (GPTQ: sequential, each
    stage on the already quantized earlier stages' outputs) or one for the whole model
    (AWQ, SmoothQuant: scaling is an identity in fp32), with XᵀX in float64: in² numbers
    per linear;
  - GPTQ: a Cholesky factorisation and O(in³) per linear, same bytes as RTN;
  - AWQ: a grid of α values, each a quantize-and-compare on a sample of rows;
  - SmoothQuant: an activation quantization per matmul at run time (W8A8).
"""
import math

import torch

from core import data
from model import RMSNorm
from core.moe import MoE
from core.plumbing import UserError
from core.quant_format import (QuantLinear, check_format, dequantize, group_params, replace_module,
                               rtn, store, target_linears, to_codes)


# ----------------------------------------------------------------------------------------
# Calibration: activation statistics of chosen linears, collected with forward hooks

class ActStats:
    """Per input channel: token count, XᵀX, Σ|x|, max|x|, Σx², and the first `keep` rows."""

    def __init__(self, dim, keep=0):
        self.n, self.keep, self.rows = 0, keep, []
        self.xtx = torch.zeros(dim, dim, dtype=torch.float64)
        self.abs_sum = torch.zeros(dim, dtype=torch.float64)
        self.abs_max = torch.zeros(dim)
        self.sq_sum = torch.zeros(dim, dtype=torch.float64)

    def add(self, x):
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.n += x.shape[0]
        x64 = x.double()
        self.xtx += x64.t() @ x64
        self.abs_sum += x64.abs().sum(0)
        self.sq_sum += x64.pow(2).sum(0)
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(0))
        have = sum(r.shape[0] for r in self.rows)
        if have < self.keep:
            self.rows.append(x[: self.keep - have])

    def hessian(self):
        """H = 2XXᵀ/N: the Hessian of the mean squared output error ||WX - ŴX||²/N in Ŵ's rows."""
        return (2 * self.xtx / self.n).float()

    def sample(self):
        return torch.cat(self.rows)


@torch.no_grad()
def collect_stats(model, batches, linears, keep=0):
    """One forward over the calibration batches; every listed linear records its input."""
    stats = {id(m): ActStats(m.weight.shape[1], keep) for m in linears}   # a Linear or a router
    hooks = [m.register_forward_pre_hook(lambda mod, args: stats[id(mod)].add(args[0]))
             for m in linears]
    try:
        for x in batches:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return stats


def mlps(feed_forward):
    """Every SwiGLU MLP of a block: an MoE's routed experts and its shared experts (all
    read the same normed input), or the one dense MLP."""
    if not isinstance(feed_forward, MoE):
        return [feed_forward]
    shared = [feed_forward.shared_experts] if feed_forward.shared_experts is not None else []
    return list(feed_forward.experts) + shared


def plain_attention(block):
    """The block's attention, if it is the GQA one these methods know (q/k/v from the same
    input); multi-head latent attention (core/mla.py) has other stages: refused in one line."""
    att = block.attention
    if not all(hasattr(att, name) for name in ("wq", "wk", "wv", "wo")):
        raise UserError("the calibrated methods (gptq, awq, smoothquant) know GQA attention "
                        "only; this model has latent attention (kv_lora_rank > 0): use rtn")
    return att


def block_stages(block):
    """The block's linears in forward order, grouped by the input they share: q/k/v, o,
    gate/up, down. A later stage's inputs depend on the earlier stages' (quantized) outputs."""
    att, experts = plain_attention(block), mlps(block.feed_forward)
    return [[att.wq, att.wk, att.wv], [att.wo],
            [m for e in experts for m in (e.w1, e.w3)], [e.w2 for e in experts]]


def sequential(model, batches, transform):
    """Layers in order, each stage calibrated on the outputs of the already transformed
    (quantized or pruned) earlier stages, as GPTQ and Wanda do. transform(name, linear,
    stats) -> the replacement module. Returns the number of calibration forwards."""
    names = {id(m): n for n, m in model.named_modules()}
    passes = 0
    for block in model.layers:
        for stage in block_stages(block):
            stats = collect_stats(model, batches, stage)
            passes += 1
            for lin in stage:
                replace_module(model, names[id(lin)], transform(names[id(lin)], lin,
                                                                stats[id(lin)]))
    return passes


# ----------------------------------------------------------------------------------------
# GPTQ (Frantar et al. 2022, Algorithm 1; the gptq repository's fasterquant)

def gptq(w, h, bits, group_size, block_size=128, damp=0.01, act_order=False):
    """Quantize w (out, in) column by column, minimising ||WX - ŴX||² with H = 2XXᵀ.

    After quantizing column q, its error e = (w_q - ŵ_q)/[H⁻¹]_qq is spread over the columns
    not yet quantized: W[:, q+1:] -= e·[H⁻¹]_{q, q+1:} (the OBS update). The rows of H⁻¹
    needed are those of its upper Cholesky factor (H⁻¹ shrinks by one row/column per step,
    and its Cholesky rows are exactly those shrunken rows, scaled). Lazy batching: updates
    inside a block of columns go to the block only; the rest of W gets them at once at the
    block's end (a matmul instead of one rank-1 update per column). Group scales/zeros are
    chosen when the group's first column is reached, from the already updated weights; with
    act_order (columns by decreasing diag H) they come from the original weights ("static
    groups"), so groups stay contiguous in the stored format. Computes in w's dtype."""
    w = w.clone()
    h = h.to(w.dtype).clone()
    cols = w.shape[1]
    g = group_size or cols
    dead = h.diagonal() == 0                   # inputs that are always 0: nothing to fit
    h[dead, dead] = 1
    w[:, dead] = 0
    static = group_params(w, bits, g) if act_order or g == cols else None
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * h.diagonal().mean() * torch.eye(cols, dtype=w.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros_like(w)
    if static is not None:
        scale, zero = static[0].clone(), static[1].clone()
    else:                                      # filled in as each group is reached
        scale = torch.zeros(w.shape[0], cols // g, dtype=w.dtype)
        zero = torch.zeros_like(scale)
    block = g * max(1, block_size // g) if static is None else block_size
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            grp = int(perm[col]) // g
            if static is None and col % g == 0:    # a group's parameters, from current w
                scale[:, grp], zero[:, grp] = (t[:, 0] for t in
                                               group_params(w1[:, i:i + g], bits, g))
            codes[:, col] = to_codes(w1[:, i], scale[:, grp], zero[:, grp], bits)
            q = (codes[:, col] - zero[:, grp]) * scale[:, grp]
            err[:, i] = (w1[:, i] - q) / hinv[col, col]
            w1[:, i:] -= err[:, i:i + 1] * hinv[col:col + 1, col:i2]
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    codes = codes[:, torch.argsort(perm)]
    return store(codes, scale, zero, bits)


def gptq_transform(bits, group_size, **gptq_args):
    def transform(name, lin, stats):
        g = check_format(bits, group_size, lin.in_features)
        w = lin.weight.detach()
        stored = gptq(w, stats.hessian(), bits, g, **gptq_args) if stats.n else rtn(w, bits, g)
        return QuantLinear(stored, w.shape, bits, g)
    return transform


# ----------------------------------------------------------------------------------------
# Activation-aware scaling: AWQ and SmoothQuant. Both multiply W's input channels by s and
# divide the activations by s, folded into the op before: an identity in fp32.

def scale_groups(block):
    """(the op that produces the input, its consumers, the consumers to quantize). The norm's
    gain or the producing linear's output rows absorb 1/s. wv -> wo only when each wo input
    channel is one v channel (no GQA sharing), as llm-awq does; an MoE router is scaled
    with its experts (it reads the same input) but never quantized."""
    att, ff = plain_attention(block), block.feed_forward
    groups = [(block.attention_norm, [att.wq, att.wk, att.wv])]
    if att.wv.out_features == att.wo.in_features:
        groups.append((att.wv, [att.wo]))
    experts = mlps(ff)
    groups.append((block.ffn_norm, [m for e in experts for m in (e.w1, e.w3)]))
    groups += [(e.w3, [e.w2]) for e in experts]
    router = [ff.router] if isinstance(ff, MoE) else []
    return [(p, (router + c if p is block.ffn_norm else c), c) for p, c in groups]


@torch.no_grad()
def fold_scales(producer, consumers, s):
    """W_c ← W_c·diag(s) for each consumer, the producer's output ← output / s."""
    for c in consumers:
        c.weight.mul_(s[None, :])
    if isinstance(producer, RMSNorm):
        producer.weight.div_(s)
    else:
        producer.weight.div_(s[:, None])


def fake_quant(w, bits, g):
    """The RTN-quantized-then-dequantized weight."""
    return dequantize(rtn(w, bits, g), w.shape, bits, g)


@torch.no_grad()
def awq_search(x, weights, mean_abs, bits, group_size, n_grid=20):
    """llm-awq's auto_scale: s = mean|x|^α, normalised by √(max s · min s), α = i/n_grid;
    keep the α whose quantized output (x/s)·Q(W·diag(s))ᵀ is closest to x·Wᵀ. α = 0 is RTN,
    so the search never does worse than RTN on the calibration sample. -> (s, α)."""
    ref = [x @ w.t() for w in weights]
    best = (math.inf, None, None)
    for i in range(n_grid):
        alpha = i / n_grid
        s = mean_abs.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for w, r in zip(weights, ref):
            g = check_format(bits, group_size, w.shape[1])
            err += ((x / s) @ fake_quant(w * s, bits, g).t() - r).pow(2).sum().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def smooth_scales(act_max, weights, alpha=0.5):
    """SmoothQuant eq. 4: s_j = max|X_j|^α / max|W_j|^(1-α), W_j the j-th input column of
    every consumer."""
    w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
    return (act_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha))


def scale_model(model, batches, choose, keep=0):
    """One calibration forward (scaling is an identity, so the fp32 statistics hold for
    every group), then for each group choose(stats, weights to quantize) -> (s, info), and
    fold s in. Returns the infos (α for AWQ) for the log."""
    groups = [grp for block in model.layers for grp in scale_groups(block)]
    # the first consumer sees every token (an MoE router does; an expert would not)
    stats = collect_stats(model, batches, [consumers[0] for _, consumers, _ in groups], keep)
    chosen = []
    for producer, consumers, quantized in groups:
        if stats[id(consumers[0])].n == 0:       # an expert no calibration token reached
            continue
        s, info = choose(stats[id(consumers[0])], [c.weight.detach() for c in quantized])
        fold_scales(producer, consumers, s.float())
        chosen.append(info)
    return chosen


def w8a8_model(model, int_mm_rows):
    for name, lin in target_linears(model):
        w = lin.weight.detach()
        replace_module(model, name, QuantLinear(rtn(w, 8, 0), w.shape, 8, 0, act_bits=8,
                                                int_mm_rows=int_mm_rows))
    return model




def calibration(corpus, model, args, method):
    """--calib-batches windows of the training split (never the validation split)."""
    if args.calib_batches < 1:
        raise UserError(f"{method} needs calibration data: --calib-batches must be >= 1")
    seq = min(model.config.block_size, args.seq_len)
    return [data.get_batch(corpus.train, args.batch_size, seq, args.seed + 2, i)[0]
            for i in range(args.calib_batches)]


if __name__ == "__main__":
    print(__doc__.strip())
    print("\ncalibrated.py runs as `python quantize.py gptq`, `awq` or `smoothquant` "
          "(see their --help).")
