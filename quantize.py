"""
quantize.py -- make the trained GPT smaller after (or while) training it: round-to-nearest
int8/int4/int3, GPTQ, AWQ, SmoothQuant W8A8, quantization-aware training (STE, LSQ) and
pruning (magnitude, Wanda, 2:4), each written by hand, proven in tests/test_quantize.py and
measured in one ledger: bits/param counted from the stored tensors, bytes, validation loss
and perplexity vs fp32, top-1 agreement, greedy agreement, decode ms/token.

Run:  python quantize.py rtn --bits 4 --group-size 32 --save out/quantize/ckpt-int4.pt
      python quantize.py gptq --bits 3            # also: awq, smoothquant (W8A8)
      python quantize.py qat --bits 4 --steps 100 [--lsq]
      python quantize.py prune --sparsity 0.5 --pattern 2:4 --criterion wanda
      python quantize.py compare                  # every method at 8, 4 and 3 bits
Input: out/ckpt.pt, or, when there is none, a fresh tiny model trained for a few seconds.
Measured (docs/quantize.md, small preset): int8 costs nothing (Δ loss <= 1e-4); at int3
GPTQ keeps 97.4% of the next-token argmaxes where RTN keeps 95.2%; the weight-only
formats decode 1.6-8x slower on this CPU (a dequantization per matmul, no fused kernel).

What each technique saves, adds and sacrifices (Ψ = weights of the block linears; the
embedding, head and norms stay fp32 here, as most weight-only schemes keep them):
  - Round-to-nearest (RTN). int8: symmetric per output row, scale = max|w|/127; int4/int3:
    asymmetric per group of g inputs, scale = (max - min)/(2^b - 1), zero = round(-min/scale).
    Saves 32 -> b + (16 + 8)/g bits/param (fp16 scale, 8-bit zero per group; int8: 8 + 16/in).
    Adds a dequantization per matmul (unpack, subtract, multiply); sacrifices rounding error.
  - GPTQ (Frantar et al. 2022): quantize one input column at a time and spread its error onto
    the columns not yet quantized, weighted by the inverse Hessian of the layer's squared
    output error, H = 2XX^T from calibration activations. Same bytes as RTN; adds one
    calibration forward per group of layers and O(in^3) per layer; loses less than RTN.
  - AWQ (Lin et al. 2023): scale up the input channels whose activations are large (s = mean|x|
    ^alpha, alpha from a grid), fold 1/s into the previous norm or linear. Same bytes; adds a
    calibration forward and a grid search; protects the salient channels.
  - SmoothQuant (Xiao et al. 2023): s_j = max|X_j|^alpha / max|W_j|^(1-alpha) moves activation
    outliers into the weights, so both can be int8 (W8A8). Adds an activation quantization per
    matmul at run time; buys an int8 x int8 -> int32 matmul (torch._int_mm, used only where
    measured faster).
  - QAT: train through the quantizer (forward: dequantized weights; backward: straight-
    through, gradient 0 where a weight is clipped). LSQ (Esser et al. 2019) also learns the
    step sizes. Same bytes as PTQ; adds training steps; recovers part of the loss.
  - Pruning: zero the weights with the lowest |W| (magnitude) or |W|·||X_j|| (Wanda, Sun et al.
    2023), per output row, or 2 of every 4 along the input (2:4, Ampere sparse tensor cores).
    Saves bytes and FLOPs only when stored sparse (2:4: values + 2-bit indices) and run by a
    sparse kernel; here the weights stay dense: it saves nothing on this machine.
"""
import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

import data
from model import GPT, GPTConfig, get_config, load_model
from plumbing import (ArgumentParser, HelpFormatter, UserError, fmt_bytes, print0,
                      require_at_least_one, run_cli, seed_everything, tensor_bytes)

SUPPORTED_BITS = (3, 4, 8)
FORMAT_VERSION = 1
DEFAULT_CKPT = "out/ckpt.pt"
SCALE_BITS = 16               # scales are stored as fp16, as GPTQ's and AWQ's kernels use
ZERO_BITS = 8                 # zero points as uint8 (int3/int4 only; int8 is symmetric)


# ----------------------------------------------------------------------------------------
# Formats, stored for real

def check_format(bits, group_size, in_features):
    """group_size 0 = one group per output row (the per-channel case)."""
    if bits not in SUPPORTED_BITS:
        raise UserError(f"--bits {bits} is not supported: choose one of {SUPPORTED_BITS}")
    if group_size < 0 or (group_size and in_features % group_size):
        raise UserError(f"--group-size {group_size} does not divide the input dimension "
                        f"{in_features} (groups run along the input of each row)")
    return group_size or in_features


def code_range(bits):
    """int8: signed codes, symmetric, no zero point. int3/int4: unsigned, asymmetric."""
    return (-127, 127) if bits == 8 else (0, 2 ** bits - 1)


def group_params(w, bits, group_size):
    """Scale and zero of every (row, group) of w (out, in), from the group's range. The
    range always holds 0 (so 0 stays exact, as in GPTQ's quantizer). Scales are rounded to
    fp16 here, because that is what is stored and what dequantization will multiply by."""
    groups = w.reshape(w.shape[0], -1, group_size)
    if bits == 8:
        scale = groups.abs().amax(-1) / 127
    else:
        lo = groups.amin(-1).clamp(max=0)
        hi = groups.amax(-1).clamp(min=0)
        scale = (hi - lo) / (2 ** bits - 1)
    scale = scale.clamp(min=1e-5).half().to(w.dtype)
    if bits == 8:
        return scale, torch.zeros_like(scale)
    zero = torch.round(-lo / scale).clamp(0, 2 ** bits - 1)
    return scale, zero


def to_codes(w, scale, zero, bits):
    """q = clamp(round(w/scale) + zero); scale/zero: one per element of w (expanded)."""
    qmin, qmax = code_range(bits)
    return torch.clamp(torch.round(w / scale) + zero, qmin, qmax)


def expand(per_group, group_size):
    return per_group.repeat_interleave(group_size, dim=1)


def pack_codes(codes, bits):
    """Eight b-bit codes -> b bytes: code i of eight sits at bits [b(7-i), b(8-i)) of a
    big-endian word, so for int4 the first code is the high nibble (as bitsandbytes).
    Pads to a multiple of 8 codes; -> 1-D uint8 of ceil(n·b/8) bytes."""
    flat = codes.flatten().to(torch.int64)
    flat = F.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    word = (flat << (bits * torch.arange(7, -1, -1))).sum(1)
    byte_shift = 8 * torch.arange(bits - 1, -1, -1)
    return ((word[:, None] >> byte_shift) & 0xFF).to(torch.uint8).flatten()


def unpack_codes(packed, bits, n):
    word = (packed.view(-1, bits).to(torch.int64) << (8 * torch.arange(bits - 1, -1, -1))).sum(1)
    codes = (word[:, None] >> (bits * torch.arange(7, -1, -1))) & (2 ** bits - 1)
    return codes.flatten()[:n]


def store(codes, scale, zero, bits):
    """The tensors a checkpoint holds for one weight: int8 codes as they are; int3/int4
    codes packed, fp16 scales, uint8 zeros."""
    if bits == 8:
        return {"codes": codes.to(torch.int8), "scales": scale.half()}
    return {"codes": pack_codes(codes, bits), "scales": scale.half(),
            "zeros": zero.to(torch.uint8)}


def dequantize(stored, shape, bits, group_size):
    """w_hat = (code - zero) · scale, per group along the input."""
    out_f, in_f = shape
    g = group_size or in_f
    if bits == 8:
        codes = stored["codes"].float()
        zero = 0.0
    else:
        codes = unpack_codes(stored["codes"], bits, out_f * in_f).view(out_f, in_f).float()
        zero = expand(stored["zeros"].float(), g)
    return (codes - zero) * expand(stored["scales"].float(), g)


def rtn(w, bits, group_size):
    """Round-to-nearest: each weight to its nearest level, nothing else."""
    g = group_size or w.shape[1]
    scale, zero = group_params(w, bits, g)
    return store(to_codes(w, expand(scale, g), expand(zero, g), bits), scale, zero, bits)


def format_bits_per_param(bits, group_size, in_features):
    """The formula: b + (scale bits + zero bits) / g."""
    g = group_size or in_features
    return bits + (SCALE_BITS + (0 if bits == 8 else ZERO_BITS)) / g


def stored_nbytes(stored):
    return sum(t.numel() * t.element_size() for t in stored.values())


# ----------------------------------------------------------------------------------------
# The quantized layer: holds the codes, dequantizes in every forward

def measure_int_mm(in_features, out_features, rows=(1, 16, 64, 256), repeats=20):
    """Time torch._int_mm (int8 x int8 -> int32) against the fp32 matmul it would replace.
    -> (smallest row count from which int8 wins at every measured size, or None; lines)."""
    if not hasattr(torch, "_int_mm"):
        return None, ["torch._int_mm: not in this torch build"]
    lines, wins = [], []
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    for m in rows:
        x = torch.randint(-127, 128, (m, in_features), dtype=torch.int8)
        try:
            t_int = _best_time(lambda: torch._int_mm(x, w.t()), repeats)
        except RuntimeError as e:
            return None, [f"torch._int_mm fails here: {str(e).splitlines()[0]}"]
        xf, wf = x.float(), w.float()
        t_fp = _best_time(lambda: xf @ wf.t(), repeats)
        wins.append(t_int < t_fp)
        lines.append(f"  rows {m:4d} x {in_features}x{out_features}: int8 {t_int * 1e6:7.1f} us"
                     f" | fp32 {t_fp * 1e6:7.1f} us")
    first = next((m for i, m in enumerate(rows) if all(wins[i:])), None)
    return first, lines


def _best_time(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class QuantLinear(nn.Module):
    """A bias-free linear whose weight lives as codes + scales (+ zeros). Weight-only: the
    weight is dequantized to fp32 in every forward (the cost of saving the bytes). act_bits
    = 8 (SmoothQuant W8A8): activations are quantized per token at run time and the matmul
    runs on integers; int_mm_rows: from this many rows torch._int_mm does it (measured)."""

    def __init__(self, stored, shape, bits, group_size, act_bits=0, int_mm_rows=None):
        super().__init__()
        self.shape, self.bits, self.group_size = tuple(shape), bits, group_size
        self.act_bits, self.int_mm_rows = act_bits, int_mm_rows
        if act_bits and (bits != 8 or group_size not in (0, shape[1])):
            raise UserError("W8A8 needs int8 weights with one scale per output row")
        for name, t in stored.items():
            self.register_buffer(name, t)
        self.in_features, self.out_features = shape[1], shape[0]

    def stored(self):
        return {name: t for name, t in self.named_buffers()}

    def dequantized(self):
        return dequantize(self.stored(), self.shape, self.bits, self.group_size)

    def forward(self, x):
        if self.act_bits:
            return self.w8a8(x)
        return F.linear(x, self.dequantized().to(x.dtype))

    def w8a8(self, x):
        """y = (x_q @ W_qᵀ) · s_x · s_w, with x_q = round(x / s_x), s_x = max|x_t|/127 per token.
        The integer accumulate is exact in fp32 too (|sums| ≤ 127²·in < 2^24 for in ≤ 1040),
        so the int_mm path and the fp32 path give the same numbers."""
        flat = x.reshape(-1, self.in_features).float()
        s_x = flat.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        x_q = torch.round(flat / s_x).clamp(-127, 127)
        if self.int_mm_rows is not None and flat.shape[0] >= self.int_mm_rows:
            acc = torch._int_mm(x_q.to(torch.int8), self.codes.t()).float()
        else:
            acc = x_q @ self.codes.float().t()
        y = acc * s_x * self.scales.float().t()
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def target_linears(model):
    """The linears inside the blocks (attention, MLP, experts); the MoE router stays fp32
    (n_expert outputs: nothing to save)."""
    out = []
    for name, m in model.named_modules():
        if name.startswith("layers.") and isinstance(m, nn.Linear) and not name.endswith("router"):
            out.append((name, m))
    return out


def replace_module(model, name, new):
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def quantize_model(model, bits, group_size):
    """RTN on every target linear, in place; -> model."""
    for name, lin in target_linears(model):
        g = check_format(bits, group_size, lin.in_features)
        w = lin.weight.detach()
        replace_module(model, name, QuantLinear(rtn(w, bits, g), w.shape, bits, g))
    return model


def model_bytes(model):
    """-> (stored bytes of the quantized linears, their weights' count, all bytes). Counted
    from the tensors the model holds: parameters and stored buffers (the state_dict)."""
    q_bytes = q_params = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            q_bytes += stored_nbytes(m.stored())
            q_params += m.shape[0] * m.shape[1]
    return q_bytes, q_params, tensor_bytes(model.state_dict(keep_vars=True).values())


# ----------------------------------------------------------------------------------------
# Swapping layers and fine-tuning: shared by qat.py (quantization-aware training) and
# prune.py (pruning with masks), which are split out of this file by concept

def swap_linears(model, make):
    """Replace every target linear by make(linear); -> model."""
    for name, lin in target_linears(model):
        replace_module(model, name, make(lin))
    return model


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


# ----------------------------------------------------------------------------------------
# The ledger: every row measured against the fp32 model in the same run

class Evaluator:
    """The fp32 reference, measured once: validation batches, next-token argmax, greedy
    continuations of held-out prompts (windows of the validation split), decode ms/token."""

    def __init__(self, fp32, corpus, args):
        seq = min(fp32.config.block_size, args.seq_len)
        self.batches = [data.get_batch(corpus.val, args.batch_size, seq, args.seed + 1, i)
                        for i in range(args.eval_batches)]
        gen = torch.Generator().manual_seed(args.seed)
        starts = torch.randint(0, len(corpus.val) - args.prompt_len, (args.prompts,),
                               generator=gen).tolist()
        self.prompts = [corpus.val[s:s + args.prompt_len].astype("int64").tolist()
                        for s in starts]
        self.args, self.fp32 = args, fp32
        self.ref_loss, self.ref_top1 = self.loss_and_top1(fp32)
        self.ref_greedy = [fp32.generate(p, args.new_tokens, temperature=0) for p in self.prompts]

    @torch.no_grad()
    def loss_and_top1(self, model):
        losses, top1 = [], []
        for x, y in self.batches:
            logits, loss = model(x, y)
            losses.append(loss.item())
            top1.append(logits.argmax(-1))
        return sum(losses) / len(losses), top1

    def decode_ms(self, model):
        """ms per new token of model and of fp32: best of --repeats greedy generations of one
        prompt each, alternated, so both see the same load on a shared machine."""
        n, best = self.args.new_tokens, [math.inf, math.inf]
        pair = (model,) if model is self.fp32 else (model, self.fp32)
        for _ in range(self.args.repeats):
            for i, m in enumerate(pair):
                best[i] = min(best[i], _best_time(
                    lambda: m.generate(self.prompts[0], n, temperature=0), 1))
        ms = [1000 * b / n for b in best]
        return ms[0], (ms[0] if model is self.fp32 else ms[1])

    def row(self, model, method, fmt, seconds=0.0, passes=0, note=""):
        model.eval()
        loss, top1 = self.loss_and_top1(model)
        agree = sum(int((a == b).sum()) for a, b in zip(top1, self.ref_top1))
        greedy = [model.generate(p, self.args.new_tokens, temperature=0) for p in self.prompts]
        same = [_prefix(a, b) / len(b) for a, b in zip(greedy, self.ref_greedy)]
        q_bytes, q_params, total = model_bytes(model)
        ms, ref_ms = self.decode_ms(model)
        return dict(method=method, format=fmt,
                    bits_per_weight=8 * q_bytes / q_params if q_params else 32.0,
                    model_bytes=total, val_loss=loss, d_loss=loss - self.ref_loss,
                    ppl=math.exp(loss), top1=agree / sum(t.numel() for t in top1),
                    greedy=sum(same) / len(same), ms_per_token=ms, vs_fp32=ms / ref_ms,
                    calib_passes=passes, seconds=seconds, note=note)


def _prefix(a, b):
    """Length of the common prefix: greedy decoding diverges for good at the first miss."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


LEDGER_HEAD = ("| method | format | bits/weight | model bytes | val loss | Δ loss | ppl | "
               "top-1 = fp32 | greedy = fp32 | decode ms/tok | × fp32 | calib passes | s | "
               "note |")


def ledger_lines(rows):
    lines = [LEDGER_HEAD, "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['method']} | {r['format']} | {r['bits_per_weight']:.3f} | "
                     f"{fmt_bytes(r['model_bytes'])} | {r['val_loss']:.4f} | "
                     f"{r['d_loss']:+.4f} | {r['ppl']:.2f} | {r['top1']:.1%} | "
                     f"{r['greedy']:.1%} | {r['ms_per_token']:.2f} | {r['vs_fp32']:.2f} | "
                     f"{r['calib_passes']} | {r['seconds']:.1f} | {r['note']} |")
    return lines


# ----------------------------------------------------------------------------------------
# Checkpoints: codes, scales and zeros as integer/fp16 tensors, the rest as plain tensors

def save_checkpoint(path, model, enc, meta, data_path):
    """A file torch.load(weights_only=True) reads: plain dicts, strings, numbers, tensors.
    With quantized layers: "quantization" (format + per-layer metadata) and "quantized"
    (name -> stored tensors); model.load_model hands such a file to model_from_checkpoint."""
    quantized, layers = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            quantized[name] = {k: v.clone() for k, v in m.stored().items()}
            layers[name] = dict(shape=list(m.shape), bits=m.bits, group_size=m.group_size,
                                act_bits=m.act_bits)
    plain = {k: v.clone() for k, v in model.state_dict().items()
             if k.rpartition(".")[0] not in quantized}
    ckpt = dict(config=asdict(model.config), model=plain, tokenizer=data.encoding_to_state(enc),
                args={"data": data_path})
    if quantized:
        ckpt["quantization"] = dict(format=FORMAT_VERSION, layers=layers, **meta)
        ckpt["quantized"] = quantized
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


def model_from_checkpoint(ckpt, device="cpu"):
    """A plain model.GPT whose weights are the dequantized values (what serve.py and
    spec_decode.py run). Activation quantization (W8A8) is not part of a plain GPT: such a
    checkpoint runs weight-only here."""
    q = ckpt["quantization"]
    if q.get("format") != FORMAT_VERSION:
        raise UserError(f"quantized checkpoint format {q.get('format')!r} is not "
                        f"{FORMAT_VERSION}: re-run quantize.py --save")
    model = GPT(GPTConfig(**ckpt["config"]).validate(), seed=None)
    state = dict(ckpt["model"])
    for name, meta in q["layers"].items():
        state[name + ".weight"] = dequantize(ckpt["quantized"][name], meta["shape"],
                                             meta["bits"], meta["group_size"])
    model.load_state_dict(state)
    return model.to(device).eval()


# ----------------------------------------------------------------------------------------
# The base model, the data, and the methods

def load_base(args):
    """-> (fp32 model, corpus, description). No --ckpt and no out/ckpt.pt: a fresh tiny
    model, trained for --base-steps steps right here."""
    if args.ckpt is None and not os.path.exists(DEFAULT_CKPT):
        cfg = get_config("tiny")
        corpus = data.load_corpus(args.data, cfg.vocab_size)
        model = GPT(cfg, seed=args.seed)
        t0 = time.perf_counter()
        loss = finetune(model, corpus, args.base_steps, 3e-3, 16, cfg.block_size, args.seed)
        print0(f"no {DEFAULT_CKPT}: trained a fresh tiny model instead ({args.base_steps} steps"
               f" in {time.perf_counter() - t0:.0f} s, train loss {loss:.3f})")
        return model, corpus, f"fresh tiny model ({args.base_steps} steps)"
    path = args.ckpt or DEFAULT_CKPT
    model, ckpt = load_model(path, "cpu")          # a missing file: one clear UserError
    if "quantization" in ckpt:
        raise UserError(f"{path} is already quantized: start from an fp32 checkpoint")
    data_path = args.data or (ckpt.get("args") or {}).get("data")
    corpus = data.load_corpus(data_path, model.config.vocab_size)
    if data.encoding_from_state(ckpt["tokenizer"])._mergeable_ranks != corpus.enc._mergeable_ranks:
        raise UserError(f"{path}'s tokenizer is not the one of corpus "
                        f"{data_path or 'stdlib'}: pass the --data it was trained on")
    return model.float().eval(), corpus, path


def calibration(corpus, model, args, method):
    """--calib-batches windows of the training split (never the validation split)."""
    if args.calib_batches < 1:
        raise UserError(f"{method} needs calibration data: --calib-batches must be >= 1")
    seq = min(model.config.block_size, args.seq_len)
    return [data.get_batch(corpus.train, args.batch_size, seq, args.seed + 2, i)[0]
            for i in range(args.calib_batches)]


def default_group(bits, group_size):
    return (0 if bits == 8 else 32) if group_size is None else group_size


def ptq(base, method, bits, group_size, calib, args, int_mm_rows=None):
    """Post-training quantization of a copy of base. -> (model, calibration passes, note).
    The calibrated methods live in calibrated.py (it imports this file, so it is imported
    here, when one is asked for)."""
    model = copy.deepcopy(base)
    for _, lin in target_linears(model):            # bad formats fail before any work
        check_format(bits, group_size, lin.in_features)
    if method == "rtn":
        return quantize_model(model, bits, group_size), 0, ""
    import calibrated
    if method == "gptq":
        transform = calibrated.gptq_transform(bits, group_size, block_size=args.block_size,
                                              damp=args.damp, act_order=args.act_order)
        passes = calibrated.sequential(model, calib, transform)
        return model, passes, "act-order" if args.act_order else ""
    if method == "awq":
        def choose(stats, weights):
            mean_abs = (stats.abs_sum / stats.n).float()
            return calibrated.awq_search(stats.sample(), weights, mean_abs, bits, group_size,
                                         args.grid)
        alphas = calibrated.scale_model(model, calib, choose, keep=args.awq_tokens)
        return quantize_model(model, bits, group_size), 1, f"alpha {min(alphas)}..{max(alphas)}"

    def smooth(stats, weights):
        return calibrated.smooth_scales(stats.abs_max, weights, args.alpha), args.alpha
    calibrated.scale_model(model, calib, smooth)
    return calibrated.w8a8_model(model, int_mm_rows), 1, f"alpha {args.alpha}"


def fmt_name(bits, group_size, act_bits=0):
    name = f"int{bits} " + (f"g{group_size}" if group_size else "per-row")
    return name + (" + int8 act" if act_bits else "")


def int_mm_decision(base):
    """Measure torch._int_mm on the widest block linear; -> rows from which to use it."""
    widest = max((lin for _, lin in target_linears(base)), key=lambda m: m.weight.numel())
    rows, lines = measure_int_mm(widest.in_features, widest.out_features)
    print0("int8 x int8 -> int32 matmul (torch._int_mm) vs fp32, best of 20:")
    for line in lines:
        print0(line)
    print0(f"  -> W8A8 uses torch._int_mm from {rows} rows on" if rows is not None else
           "  -> W8A8 uses the fp32 matmul on integer values (exact, and faster here)")
    return rows


class Table:
    """Prints the ledger row by row as the rows come (a long compare shows progress)."""

    def __init__(self, title):
        print0(f"\n{title}")
        print0("\n".join(ledger_lines([])))
        self.rows = []

    def add(self, row):
        self.rows.append(row)
        print0(ledger_lines([row])[-1])


def cmd_ptq(args, base, corpus, ev, table, int_mm_rows):
    bits = args.bits
    g = default_group(bits, args.group_size)
    calib = calibration(corpus, base, args, args.mode) if args.mode != "rtn" else []
    t0 = time.perf_counter()
    model, passes, note = ptq(base, args.mode, bits, g, calib, args, int_mm_rows)
    fmt = fmt_name(bits, g, 8 if args.mode == "smoothquant" else 0)
    table.add(ev.row(model, args.mode, fmt, time.perf_counter() - t0, passes, note))
    return model


def cmd_compare(args, base, corpus, ev, table, int_mm_rows):
    import prune, qat      # they import this file (see run_mode)
    bits_list = bits_of(args)
    calib = calibration(corpus, base, args, "compare")
    for bits in bits_list:
        g = default_group(bits, args.group_size)
        act_order = argparse.Namespace(**{**vars(args), "act_order": True})
        for method, opts in (("rtn", args), ("gptq", args), ("gptq", act_order), ("awq", args)):
            if opts is act_order and (bits == 8 or args.act_order):
                continue
            t0 = time.perf_counter()
            model, passes, note = ptq(base, method, bits, g, calib, opts)
            table.add(ev.row(model, method, fmt_name(bits, g), time.perf_counter() - t0,
                             passes, note))
    t0 = time.perf_counter()
    model, passes, note = ptq(base, "smoothquant", 8, 0, calib, args, int_mm_rows)
    table.add(ev.row(model, "smoothquant", fmt_name(8, 0, 8), time.perf_counter() - t0,
                     passes, note))
    for row, _ in qat.qat_rows(base, corpus, ev, [b for b in bits_list if b != 8],
                               [False, True], args, args.qat_steps):
        table.add(row)
    for row in prune.compare_rows(base, corpus, ev, calib, args):
        table.add(row)
    return None


def run_mode(args, base, corpus, ev, table, int_mm_rows):
    """The mode's command. qat.py and prune.py, split out by concept, import this file for
    its formats and calibration, so they are imported here, when their mode runs."""
    import prune, qat
    commands = {"rtn": cmd_ptq, "gptq": cmd_ptq, "awq": cmd_ptq, "smoothquant": cmd_ptq,
                "qat": qat.cmd_qat, "prune": prune.cmd_prune, "compare": cmd_compare}
    return commands[args.mode](args, base, corpus, ev, table, int_mm_rows)


def bits_of(args):
    if args.mode != "compare":
        return [args.bits] if hasattr(args, "bits") else []
    try:
        return [int(b) for b in args.bits_list.split(",")]
    except ValueError:
        raise UserError(f"--bits-list wants comma-separated integers, got {args.bits_list!r}")


def check_args(args, model):
    """Everything that can be checked against the model's shapes, before any work."""
    import prune          # it imports this file (see run_mode)
    for bits in bits_of(args):
        for _, lin in target_linears(model):
            check_format(bits, default_group(bits, args.group_size), lin.in_features)
    if args.mode == "prune":
        prune.check_prune(model, args.sparsity, args.pattern)
    if args.mode == "compare":
        prune.check_prune(model, 0.5, "2:4")


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    require_at_least_one(args, ("eval_batches", "batch_size", "seq_len", "prompts",
                                "prompt_len", "new_tokens", "repeats", "base_steps"))
    if args.mode == "smoothquant":
        args.bits, args.group_size = 8, 0
    for bits in bits_of(args):
        if bits not in SUPPORTED_BITS:
            raise UserError(f"--bits {bits} is not supported: choose one of {SUPPORTED_BITS}")
    for name in ("steps", "qat_steps", "finetune_steps", "calib_batches"):
        if getattr(args, name, 0) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0")
    if args.mode == "prune" and not 0 <= args.sparsity < 1:
        raise UserError(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if args.save and args.mode == "compare":
        raise UserError("compare writes its table to --out-dir; --save needs one method")
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    t_start = time.perf_counter()
    base, corpus, source = load_base(args)
    check_args(args, base)
    print0(f"base: {source} | {base.num_params():,} params, {len(target_linears(base))} "
           f"block linears | corpus {corpus.name} | {torch.get_num_threads()} thread(s)")
    ev = Evaluator(base, corpus, args)
    int_mm_rows = int_mm_decision(base) if args.mode in ("smoothquant", "compare") else None
    table = Table(f"ledger (python quantize.py {' '.join(args.argv)}):")
    table.add(ev.row(base, "fp32", "fp32"))
    model = run_mode(args, base, corpus, ev, table, int_mm_rows)
    rows = table.rows
    seconds = time.perf_counter() - t_start
    print0(f"total {seconds:.0f} s; timings: wall clock on this (possibly shared) CPU")
    if args.mode == "compare":
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "compare.json"), "w") as f:
            json.dump(dict(command=" ".join(["python quantize.py"] + args.argv), base=source,
                           seconds=seconds, rows=rows), f, indent=1)
        with open(os.path.join(args.out_dir, "compare.md"), "w") as f:
            f.write("\n".join(ledger_lines(rows)) + "\n")
        print0(f"wrote {args.out_dir}/compare.md and compare.json")
    if args.save:
        meta = dict(method=args.mode, bits=getattr(args, "bits", 32))
        save_checkpoint(args.save, model, corpus.enc, meta, args.data)
        print0(f"wrote {args.save}" + (" (W8A8: loaders get the int8 weights; activation "
               "quantization is quantize.py's own)" if args.mode == "smoothquant" else ""))
    return rows


def _parent(title, *flags):
    """A parent parser holding one group of flags: (name, kwargs) pairs."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group(title)
    for name, kwargs in flags:
        group.add_argument(name, **kwargs)
    return parser


def build_parser():
    common = _parent(
        "model, data and ledger",
        ("--ckpt", dict(default=None, help=f"fp32 checkpoint; not given: {DEFAULT_CKPT}, or a "
                        "fresh tiny model trained here when that file does not exist")),
        ("--data", dict(default=None, help="UTF-8 text the checkpoint was trained on (not given: "
                        "what the checkpoint records, else the built-in corpus)")),
        ("--base-steps", dict(type=int, default=600, help="training steps of a fresh model")),
        ("--calib-batches", dict(type=int, default=4, help="calibration batches (train split)")),
        ("--eval-batches", dict(type=int, default=8, help="validation batches")),
        ("--batch-size", dict(type=int, default=8, help="rows per batch")),
        ("--seq-len", dict(type=int, default=128, help="tokens per row")),
        ("--prompts", dict(type=int, default=16, help="held-out prompts, greedy agreement")),
        ("--prompt-len", dict(type=int, default=16, help="tokens per prompt")),
        ("--new-tokens", dict(type=int, default=32, help="greedy tokens per prompt")),
        ("--repeats", dict(type=int, default=3, help="decode timing: best of this many")),
        ("--seed", dict(type=int, default=0, help="batches, prompts, the fresh model")),
        ("--threads", dict(type=int, default=1, help="torch CPU threads")),
        ("--save", dict(default="", help="write the result to this checkpoint (read by "
                        "model.load_model, serve.py, spec_decode.py)")),
        ("--out-dir", dict(default="out/quantize", help="compare: where the table goes")))
    fmt = _parent(
        "format",
        ("--bits", dict(type=int, default=4, help=f"one of {SUPPORTED_BITS}")),
        ("--group-size", dict(type=int, default=None, help="inputs per scale/zero; not given: 0 "
                              "(one group per output row) for int8, 32 for int3/int4")))
    gptq_flags = _parent(
        "GPTQ",
        ("--damp", dict(type=float, default=0.01, help="dampening λ = damp · mean(diag H)")),
        ("--block-size", dict(type=int, default=128, help="columns per lazy batch")),
        ("--act-order", dict(action="store_true", help="columns by decreasing diag H")))
    awq_flags = _parent(
        "AWQ",
        ("--grid", dict(type=int, default=20, help="α grid points on [0, 1)")),
        ("--awq-tokens", dict(type=int, default=512, help="calibration tokens in the search")))
    sq_flags = _parent("SmoothQuant", ("--alpha", dict(type=float, default=0.5,
                                                         help="migration strength α")))
    train = _parent("training", ("--lr", dict(type=float, default=3e-4,
                                              help="QAT / fine-tuning learning rate")))
    p = ArgumentParser(description="Quantize or prune the GPT; a ledger of what each "
                                "method saves and costs.")
    return _subcommands(p, common, fmt, gptq_flags, awq_flags, sq_flags, train)


def _subcommands(p, common, fmt, gptq_flags, awq_flags, sq_flags, train):
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    add = lambda name, help, *parents: sub.add_parser(
        name, help=help, description=help, parents=[common, *parents],
        formatter_class=HelpFormatter)
    add("rtn", "round-to-nearest", fmt)
    add("gptq", "GPTQ: column-by-column with error compensation", fmt, gptq_flags)
    add("awq", "AWQ: activation-aware scales, then RTN", fmt, awq_flags)
    add("smoothquant", "SmoothQuant: W8A8 (int8 weights and per-token int8 activations)",
        sq_flags)
    qat = add("qat", "quantization-aware training vs PTQ and fp32 fine-tuning", fmt, train)
    qat.add_argument("--steps", type=int, default=100, help="QAT (and control) steps")
    qat.add_argument("--lsq", action="store_true", help="learn the step sizes (LSQ)")
    prune = add("prune", "magnitude or Wanda pruning, unstructured or 2:4", train)
    prune.add_argument("--sparsity", type=float, default=0.5, help="fraction of zeros")
    prune.add_argument("--pattern", default="unstructured", choices=["unstructured", "2:4"],
                       help="per-row fraction, or 2 of every 4 inputs")
    prune.add_argument("--criterion", default="wanda", choices=["magnitude", "wanda"],
                       help="|W|, or |W|·||X||")
    prune.add_argument("--finetune-steps", type=int, default=0, help="masked fine-tuning")
    cmp = add("compare", "every method at --bits-list, QAT, pruning: one table",
              gptq_flags, awq_flags, sq_flags, train)
    cmp.add_argument("--bits-list", default="8,4,3", help="weight bits to compare")
    cmp.add_argument("--group-size", type=int, default=None, help="not given: 0 for int8, 32 "
                     "for int3/int4")
    cmp.add_argument("--qat-steps", type=int, default=100, help="QAT and fine-tuning steps")
    return p


if __name__ == "__main__":
    # qat.py and prune.py import this file as the module `quantize`: run that module's
    # main, so that every layer class (QuantLinear, ...) exists once, not also as __main__'s
    import quantize
    run_cli(quantize.main)
