"""
compression/qat.py -- quantization-aware training: train through the quantizer, so the weights learn
to sit where the codes are. A part of quantize.py (training a model to be
quantized, not quantizing a trained one): it runs as `python quantize.py qat` and in
`compare`, and uses core/quant_format.py's formats.

  - fake quantization with the straight-through estimator (Bengio et al. 2013): forward
    the dequantized weight, backward ∂ŵ/∂w = 1 -- except where the clamp was active, where
    the gradient is 0 (a clipped weight does not move the output);
  - LSQ (Esser et al. 2019): a learned step per group, with its own gradient and the
    gradient scale 1/√(N·Q_P);
  - the fair controls: PTQ at the same bits, and the same number of fp32 fine-tuning steps
    followed by round-to-nearest -- so a gain is the quantizer's, not the extra steps'.
  costs: a fake-quantization per weight per step and the training steps themselves; the
  exported model is the same stored format as PTQ's (quantize.QuantLinear).
"""
import copy
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from core import data
from core import quant_format as Q


class FakeQuantSTE(torch.autograd.Function):
    """Forward: the dequantized weight (code - zero)·scale. Backward: the straight-through
    estimator (Bengio et al. 2013), ∂ŵ/∂w = 1, except where the clamp to [qmin, qmax] was
    active: a clipped weight does not move the output, so its gradient is 0."""

    @staticmethod
    def forward(ctx, w, scale, zero, bits):
        qmin, qmax = Q.code_range(bits)
        unclipped = torch.round(w / scale) + zero
        ctx.save_for_backward((unclipped >= qmin) & (unclipped <= qmax))
        return (unclipped.clamp(qmin, qmax) - zero) * scale

    @staticmethod
    def backward(ctx, grad):
        inside, = ctx.saved_tensors
        return grad * inside, None, None, None


class LSQQuant(torch.autograd.Function):
    """LSQ (Esser et al. 2019): ŵ = round(clamp(w/s, -Q_N, Q_P))·s with a learned step s per
    group. ∂ŵ/∂w = 1 inside the range, 0 outside (eq. 4); ∂ŵ/∂s = round(w/s) - w/s inside,
    -Q_N or Q_P where clipped (eq. 3), times the gradient scale 1/√(N·Q_P), N = weights per
    step (Sec. 2.2), so the step learns at the same relative rate as the weights."""

    @staticmethod
    def forward(ctx, w, step, q_n, q_p):
        g = w.shape[1] // step.shape[1]
        r = w / Q.expand(step, g)
        inside = (r >= -q_n) & (r <= q_p)
        d_step = torch.where(inside, torch.round(r) - r, torch.where(r < -q_n, -q_n, q_p))
        ctx.save_for_backward(inside, d_step)
        ctx.grad_scale, ctx.g = 1 / math.sqrt(g * q_p), g
        return torch.round(r.clamp(-q_n, q_p)) * Q.expand(step, g)

    @staticmethod
    def backward(ctx, grad):
        inside, d_step = ctx.saved_tensors
        per_group = (grad * d_step).view(grad.shape[0], -1, ctx.g).sum(-1)
        return grad * inside, per_group * ctx.grad_scale, None, None


class QATLinear(nn.Module):
    """A linear trained through its quantizer. STE mode: scale/zero from the current
    weights' min/max each step (so, with min/max, no weight is ever clipped); LSQ mode: a
    learned fp16 step per group, codes symmetric around the format's middle zero point."""

    def __init__(self, weight, bits, group_size, lsq=False):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bits, self.group_size, self.lsq = bits, group_size, lsq
        qmin, qmax = Q.code_range(bits)
        self.zero = 0 if bits == 8 else 2 ** (bits - 1)
        self.q_n, self.q_p = self.zero - qmin, qmax - self.zero
        if lsq:   # the paper's init: s = 2·mean|w| / √Q_P
            mean_abs = weight.detach().abs().reshape(weight.shape[0], -1, group_size).mean(-1)
            self.step = nn.Parameter(2 * mean_abs / math.sqrt(self.q_p))

    def stored_step(self):
        """The step as stored (fp16), with a straight-through gradient to the fp32 step."""
        s = self.step.clamp(min=1e-5)
        return s + (s.half().float() - s).detach()

    def fake_weight(self):
        g = self.group_size
        if self.lsq:
            return LSQQuant.apply(self.weight, self.stored_step(), self.q_n, self.q_p)
        scale, zero = Q.group_params(self.weight.detach(), self.bits, g)
        return FakeQuantSTE.apply(self.weight, Q.expand(scale, g), Q.expand(zero, g), self.bits)

    def forward(self, x):
        return F.linear(x, self.fake_weight())

    @torch.no_grad()
    def export(self):
        """-> a quantize.QuantLinear whose dequantized weight is exactly this layer's
        forward weight."""
        w, g = self.weight, self.group_size
        if not self.lsq:
            return Q.QuantLinear(Q.rtn(w, self.bits, g), w.shape, self.bits, g)
        scale = self.stored_step()
        zero = torch.full_like(scale, float(self.zero))
        codes = Q.to_codes(w, Q.expand(scale, g), Q.expand(zero, g), self.bits)
        return Q.QuantLinear(Q.store(codes, scale, zero, self.bits), w.shape, self.bits, g)


def export_qat(model):
    for name, m in list(model.named_modules()):
        if isinstance(m, QATLinear):
            Q.replace_module(model, name, m.export())
    return model


def qat_run(base, corpus, bits, group_size, lsq, args, steps):
    """QAT from the fp32 weights for `steps` steps, exported to the stored format."""
    model = Q.swap_linears(copy.deepcopy(base),
                         lambda lin: QATLinear(lin.weight, bits, group_size, lsq))
    finetune_as_flagged(model, corpus, steps, args)
    return export_qat(model)


def qat_rows(base, corpus, ev, bits_list, quantizers, args, steps):
    """QAT against its two controls: PTQ at the same bits, and the same number of fp32
    fine-tuning steps (then RTN) -- so the gain is the quantizer's, not the extra steps'.
    Yields (ledger row, model)."""
    t0 = time.perf_counter()
    tuned = copy.deepcopy(base)
    finetune_as_flagged(tuned, corpus, steps, args)
    yield ev.row(tuned, f"fp32 + {steps} steps", "fp32", time.perf_counter() - t0), tuned
    for bits in bits_list:
        g = Q.default_group(bits, args.group_size)
        control = Q.quantize_model(copy.deepcopy(tuned), bits, g)
        yield ev.row(control, f"fp32 + {steps} steps, rtn", Q.fmt_name(bits, g)), control
        for lsq in quantizers:
            t0 = time.perf_counter()
            model = qat_run(base, corpus, bits, g, lsq, args, steps)
            yield ev.row(model, f"qat-{'lsq' if lsq else 'ste'} {steps} steps",
                         Q.fmt_name(bits, g), time.perf_counter() - t0), model


def cmd_qat(args, base, corpus, ev, table, int_mm_rows):
    g = Q.default_group(args.bits, args.group_size)
    table.add(ev.row(Q.quantize_model(copy.deepcopy(base), args.bits, g), "rtn (PTQ)",
                     Q.fmt_name(args.bits, g)))
    for row, model in qat_rows(base, corpus, ev, [args.bits], [args.lsq], args, args.steps):
        table.add(row)
    return model                        # the last one: the QAT model


def finetune(model, corpus, steps, lr, batch_size, seq_len, seed):
    """AdamW on the training split (no weight decay: a pruned weight stays exactly 0).
    -> the last training loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        # ten warm-up steps, then cosine down to lr/10
        cosine = 0.55 + 0.45 * math.cos(math.pi * step / max(steps - 1, 1))
        for group in opt.param_groups:
            group["lr"] = lr * min((step + 1) / 10, cosine)
        x, y = data.get_batch(corpus.train, batch_size, seq_len, seed, step)
        loss = model(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()
    return loss.item()


def finetune_as_flagged(model, corpus, steps, args):
    """finetune at the command line's --lr and batch shape (--seq-len capped at the model's
    context), on seed + 3: calibration draws seed + 2 and validation seed + 1, so the
    fine-tuning never sees the tokens a method is calibrated or measured on."""
    seq = min(model.config.block_size, args.seq_len)
    return finetune(model, corpus, steps, args.lr, args.batch_size, seq, args.seed + 3)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nqat.py runs as `python quantize.py qat` (see its --help).")
