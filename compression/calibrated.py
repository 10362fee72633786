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
  - AWQ: a grid of α values, each a quantization and a run of the scored module (the
    attention, the MLP, or the linear) on the calibration tokens;
  - SmoothQuant: an activation quantization per matmul at run time (W8A8).
"""
import math

import torch
from torch.func import functional_call

from core import data
from model import RMSNorm
from core.moe import MoE
from core.errors import UserError
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


class Calls:
    """What a module was called with during calibration: the (args, kwargs) of its first
    calls, the leading tensor cut along its first dimension to hold `keep` tokens (rounded
    up to whole rows of that dimension: whole sequences for an attention's input)."""

    def __init__(self, keep):
        self.keep, self.tokens, self.calls = keep, 0, []

    def add(self, args, kwargs):
        x = args[0]
        per_row = x[0].numel() // x.shape[-1] if x.shape[0] else 0    # tokens per x[i]
        if self.tokens >= self.keep or per_row == 0:
            return
        x = x[:math.ceil((self.keep - self.tokens) / per_row)].detach()
        self.tokens += x.shape[0] * per_row
        self.calls.append(((x, *args[1:]), dict(kwargs)))


@torch.no_grad()
def collect(model, batches, linears, keep=0, recorded=(), record_keep=0):
    """One forward over the calibration batches: every listed linear records its input's
    statistics (ActStats, `keep` rows of it), every `recorded` module its calls (Calls,
    `record_keep` tokens). -> (stats, calls), both by id(module)."""
    stats = {id(m): ActStats(m.weight.shape[1], keep) for m in linears}   # a Linear or a router
    calls = {id(m): Calls(record_keep) for m in recorded}
    hooks = [m.register_forward_pre_hook(lambda mod, args: stats[id(mod)].add(args[0]))
             for m in linears]
    hooks += [m.register_forward_pre_hook(lambda mod, args, kw: calls[id(mod)].add(args, kw),
                                          with_kwargs=True) for m in recorded]
    try:
        for x in batches:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return stats, calls


def collect_stats(model, batches, linears, keep=0):
    """One forward over the calibration batches; every listed linear records its input."""
    return collect(model, batches, linears, keep)[0]


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

# Which weights a group's scale and zero are fitted on, when a group starts inside a lazy
# block (group size < block size: this repo's default, groups of 32 in blocks of 128):
#   block-start (the default) is IST-DASLab/gptq's fasterquant: `find_params(W[:, (i1 + i):
#     (i1 + i + groupsize)])` reads W, the whole matrix, which gets the error feedback only
#     at each block's end (`W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])`); the feedback of
#     the block's own earlier columns goes to its copy W1. So the group is fitted on the
#     weights as they were when the block began: every earlier block's feedback in, none
#     of this block's. (A group at a block's first column sees the same either way.)
#     The AutoGPTQ-style ports of fasterquant copy that line: their weights are these.
#   updated (this repo's earlier rule, kept as an option) fits on the block's working copy,
#     every earlier column's feedback in: the range the group's columns will actually be
#     rounded in, so fewer of them clip. It equals block-start run with blocks of one group
#     (tests/test_quantize.py checks both), i.e. the rule of Algorithm 1 without lazy
#     batching. Measured (docs/quantize.md; small preset, int3 g32, both fits on the same
#     Hessians): layer output error 2.2% lower at the median, lower in 29 of 42 layers,
#     0.3% lower summed; Δ loss the same within noise (+0.0003 vs +0.0004).
GROUP_FITS = ("block-start", "updated")


def gptq(w, h, bits, group_size, block_size=128, damp=0.01, act_order=False,
         group_fit="block-start"):
    """Quantize w (out, in) column by column, minimising ||WX - ŴX||² with H = 2XXᵀ.

    After quantizing column q, its error e = (w_q - ŵ_q)/[H⁻¹]_qq is spread over the columns
    not yet quantized: W[:, q+1:] -= e·[H⁻¹]_{q, q+1:} (the OBS update). The rows of H⁻¹
    needed are those of its upper Cholesky factor (H⁻¹ shrinks by one row/column per step,
    and its Cholesky rows are exactly those shrunken rows, scaled). Lazy batching: updates
    inside a block of columns go to the block only; the rest of W gets them at once at the
    block's end (a matmul instead of one rank-1 update per column). Group scales/zeros are
    chosen when the group's first column is reached, by `group_fit` (GROUP_FITS above);
    with act_order (columns by decreasing diag H) they come from the original weights
    ("static groups", fasterquant's static_groups=True), so groups stay contiguous in the
    stored format. Computes in w's dtype."""
    if group_fit not in GROUP_FITS:
        raise UserError(f"unknown GPTQ group fit {group_fit!r}: use one of {list(GROUP_FITS)}")
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
    # updated: whole groups per block, so the block's copy w1 holds each group it fits on;
    # block-start fits on w, which holds every column: blocks as given, as fasterquant's
    updated = static is None and group_fit == "updated"
    block = g * max(1, block_size // g) if updated else block_size
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            grp = int(perm[col]) // g
            if static is None and col % g == 0:    # a group's parameters, by group_fit
                fit_on = w1[:, i:i + g] if updated else w[:, col:col + g]
                scale[:, grp], zero[:, grp] = (t[:, 0] for t in group_params(fit_on, bits, g))
            codes[:, col] = to_codes(w1[:, i], scale[:, grp], zero[:, grp], bits)
            q = (codes[:, col] - zero[:, grp]) * scale[:, grp]
            err[:, i] = (w1[:, i] - q) / hinv[col, col]
            w1[:, i:] -= err[:, i:i + 1] * hinv[col:col + 1, col:i2]
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    codes = codes[:, torch.argsort(perm)]
    return store(codes, scale, zero, bits)


def output_error(w, w_hat, stats):
    """GPTQ's objective on the layer's calibration inputs: the mean over tokens of
    ||(W - Ŵ)x||², = tr(ΔW·XᵀX/N·ΔWᵀ) (in float64, from the XᵀX the Hessian came from)."""
    d = (w - w_hat).double()
    return float(((d @ (stats.xtx / stats.n)) * d).sum())


def gptq_transform(bits, group_size, errors=None, **gptq_args):
    """-> transform(name, linear, stats) for `sequential`. errors: a list that gets, per
    layer, (GPTQ's output error, RTN's on the same inputs) -- the ledger's "layer err"."""
    def transform(name, lin, stats):
        g = check_format(bits, group_size, lin.in_features)
        w = lin.weight.detach()
        stored = gptq(w, stats.hessian(), bits, g, **gptq_args) if stats.n else rtn(w, bits, g)
        layer = QuantLinear(stored, w.shape, bits, g)
        if errors is not None and stats.n:
            plain = dequantize(rtn(w, bits, g), w.shape, bits, g)
            errors.append((output_error(w, layer.dequantized(), stats),
                           output_error(w, plain, stats)))
        return layer
    return transform


# ----------------------------------------------------------------------------------------
# Activation-aware scaling: AWQ and SmoothQuant. Both multiply W's input channels by s and
# divide the activations by s, folded into the op before: an identity in fp32.

def scale_groups(block):
    """(the op that produces the input, its consumers, the consumers to quantize, the module
    whose output AWQ scores). The norm's gain or the producing linear's output rows absorb
    1/s. wv -> wo only when each wo input channel is one v channel (no GQA sharing), as
    llm-awq does; an MoE router is scaled with its experts (it reads the same input) but
    never quantized. The scored module is llm-awq auto_scale's module2inspect: the whole
    attention for q/k/v, the whole MLP (an MoE: routed and shared experts) for gate/up,
    the linear itself for o and down."""
    att, ff = plain_attention(block), block.feed_forward
    groups = [(block.attention_norm, [att.wq, att.wk, att.wv], att)]
    if att.wv.out_features == att.wo.in_features:
        groups.append((att.wv, [att.wo], att.wo))
    experts = mlps(ff)
    groups.append((block.ffn_norm, [m for e in experts for m in (e.w1, e.w3)], ff))
    groups += [(e.w3, [e.w2], e.w2) for e in experts]
    router = [ff.router] if isinstance(ff, MoE) else []
    return [(p, (router + c if p is block.ffn_norm else c), c, m) for p, c, m in groups]


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
    """The RTN-quantized-then-dequantized weight, in the stored format."""
    return dequantize(rtn(w, bits, g), w.shape, bits, g)


def awq_fake_quant(w, bits, g):
    """llm-awq's pseudo_quantize_tensor (zero_point=True, the one its search uses): per
    group of g, plain min/max (the range need not hold 0), fp32 scale = max(max - min,
    1e-5)/(2^b - 1), zero = clamp(-round(min/scale), 0, 2^b - 1); asymmetric at 8 bits too."""
    groups = w.reshape(-1, g)
    hi, lo = groups.amax(1, keepdim=True), groups.amin(1, keepdim=True)
    qmax = 2 ** bits - 1
    scale = (hi - lo).clamp(min=1e-5) / qmax
    zero = (-torch.round(lo / scale)).clamp(0, qmax)
    return ((torch.clamp(torch.round(groups / scale) + zero, 0, qmax) - zero) * scale
            ).reshape(w.shape)


# What AWQ's grid search scores each α by, and with which quantizer:
#   objective module (the default) is llm-awq's auto_scale (_search_module_scale): the
#     output of module2inspect (scale_groups above) -- the whole attention for q/k/v, the
#     whole MLP for gate/up, the linear itself for o and down -- with the group's weights
#     replaced by Q(W·diag(s))/s and everything else fp32: the paper's objective (Lin et
#     al. 2023, eq. 4) taken where the errors of q, k and v (gate and up) meet.
#   objective linear (this repo's earlier rule, kept as an option) sums each linear's own
#     output error ||(x/s)·Q(W·diag(s))ᵀ - x·Wᵀ||²: no attention or MLP to run, but an error
#     in q or k counts as much as one in v, though the softmax and the gate shrink or grow
#     them. Measured (docs/quantize.md; small preset, int3 g32): it picks another α in 12
#     of 18 groups (all q/k/v and gate/up), and by the module output those are worse in
#     11 of 12 (median ×1.31); Δ loss +0.0006 against the module objective's +0.0002.
#   quantizer llm-awq (the default): its pseudo_quantize_tensor (awq_fake_quant above);
#   quantizer stored (this repo's earlier rule, an option): the format the weights are then
#     stored in (fake_quant: 0 inside the range, fp16 scales, int8 symmetric), so the search
#     scores the very rounding that follows. Both round by the stored format afterwards.
#     Measured (same run): another α in 2 of 18 groups, whose module output error with
#     the stored rounding is 1.6% lower; Δ loss +0.0003 against +0.0002: noise.
AWQ_OBJECTIVES = ("module", "linear")
AWQ_QUANTIZERS = {"llm-awq": awq_fake_quant, "stored": fake_quant}


def awq_grid(error, mean_abs, n_grid=20):
    """llm-awq's grid: s = mean|x|^α clamped at 1e-4, normalised by √(max s · min s), for
    α = i/n_grid, i = 0 .. n_grid - 1 (α = 0 is s = 1, plain RTN: the search never does
    worse than RTN on its sample; α = 1 is never tried); the first α of least error(s)
    wins (a strict <, as there). -> (s, α)."""
    best = (math.inf, None, None)
    for i in range(n_grid):
        alpha = i / n_grid
        s = mean_abs.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = error(s)
        if err < best[0]:
            best = (err, s, alpha)
    if best[1] is None:
        raise UserError("AWQ's search found no finite error (NaN in the calibration data?)")
    return best[1], best[2]


@torch.no_grad()
def awq_search(x, weights, mean_abs, bits, group_size, n_grid=20, quantizer="llm-awq"):
    """The per-linear objective (`linear`): keep the α whose quantized outputs
    (x/s)·Q(W·diag(s))ᵀ, summed over the group's linears, are closest to x·Wᵀ. -> (s, α)."""
    quant = AWQ_QUANTIZERS[quantizer]
    ref = [x @ w.t() for w in weights]

    def error(s):
        err = 0.0
        for w, r in zip(weights, ref):
            g = check_format(bits, group_size, w.shape[1])
            err += ((x / s) @ quant(w * s, bits, g).t() - r).pow(2).sum().item()
        return err
    return awq_grid(error, mean_abs, n_grid)


@torch.no_grad()
def awq_module_search(module, linears, calls, mean_abs, bits, group_size, n_grid=20,
                      quantizer="llm-awq"):
    """The module objective (`module`, llm-awq's): the module run on its recorded calls with
    each linear's weight replaced by Q(W·diag(s))/s (torch.func.functional_call: the module
    itself is never modified); error = the mean squared difference to its fp32 output,
    `(org_out - out).float().pow(2).mean()` as there. -> (s, α)."""
    quant = AWQ_QUANTIZERS[quantizer]
    path = {id(m): name for name, m in module.named_modules()}
    keys = [f"{path[id(lin)]}.weight".lstrip(".") for lin in linears]   # "" = module itself

    def run(params):
        return torch.cat([functional_call(module, params, args, kwargs).reshape(-1)
                          for args, kwargs in calls])
    ref = run({})

    def error(s):
        params = {k: quant(lin.weight * s, bits, check_format(bits, group_size,
                                                               lin.in_features)) / s
                  for k, lin in zip(keys, linears)}
        return (ref - run(params)).float().pow(2).mean().item()
    return awq_grid(error, mean_abs, n_grid)


@torch.no_grad()
def awq_scale(model, batches, bits, group_size, n_grid=20, objective="module",
              quantizer="llm-awq", tokens=0):
    """AWQ's scales (Lin et al. 2023), folded into the fp32 model: an identity, quantize it
    afterwards. One calibration forward records every group's mean|x| over all tokens and
    the inputs its search scores: the first `tokens` calibration tokens (0: all of them, as
    llm-awq, whose statistic and search use the same tokens). The search of a group runs on
    weights no other group's folding has touched yet (each group's producer and consumers
    lie outside the modules the earlier groups score), so the order changes nothing.
    -> the α chosen per group."""
    if objective not in AWQ_OBJECTIVES or quantizer not in AWQ_QUANTIZERS:
        raise UserError(f"AWQ: objective {objective!r} / quantizer {quantizer!r}: use one of "
                        f"{list(AWQ_OBJECTIVES)} / {list(AWQ_QUANTIZERS)}")
    keep = tokens or sum(b.numel() for b in batches)
    groups = [grp for block in model.layers for grp in scale_groups(block)]
    module_obj = objective == "module"
    # the first consumer sees every token (an MoE router does; an expert would not)
    stats, calls = collect(model, batches, [grp[1][0] for grp in groups],
                           0 if module_obj else keep,
                           [grp[3] for grp in groups] if module_obj else (), keep)
    alphas = []
    for producer, consumers, quantized, module in groups:
        st = stats[id(consumers[0])]
        if st.n == 0:                          # an expert no calibration token reached
            continue
        mean_abs = (st.abs_sum / st.n).float()
        if module_obj:
            s, alpha = awq_module_search(module, quantized, calls[id(module)].calls, mean_abs,
                                         bits, group_size, n_grid, quantizer)
        else:
            s, alpha = awq_search(st.sample(), [c.weight.detach() for c in quantized],
                                  mean_abs, bits, group_size, n_grid, quantizer)
        fold_scales(producer, consumers, s.float())
        alphas.append(alpha)
    return alphas


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
    stats = collect_stats(model, batches, [consumers[0] for _, consumers, _, _ in groups], keep)
    chosen = []
    for producer, consumers, quantized, _ in groups:
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
