"""
core/quant_format.py -- how a quantized weight is stored, and how it comes back.

The format every quantizer of quantize.py (RTN, GPTQ, AWQ, SmoothQuant, QAT) writes and
core/checkpoint.py reads, so that `load_model`, serve.py and spec_decode.py run a
quantized checkpoint without importing the methods that made it:
  - codes: b-bit integers, packed 8/b per byte for b = 4 (two nibbles) and 3 (kept in
    uint8, as GPTQ's reference kernels keep 3 bits in whole words only for speed);
  - one fp16 scale (and, for int4/int3, one uint8 zero point) per group of g inputs of
    each output row; int8 is symmetric with one scale per row (zero = 0);
  - w ≈ (code - zero) · scale, dequantized in every forward of a QuantLinear.

Cost: b + (16 + 8)/g bits per weight (int8: 8 + 16/in), counted from the stored tensors by
`stored_nbytes`; the dequantization per matmul is the price of the bytes (no fused kernel).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.errors import UserError
from model import GPT, GPTConfig


SUPPORTED_BITS = (3, 4, 8)


FORMAT_VERSION = 1


SCALE_BITS = 16               # scales are stored as fp16, as GPTQ's and AWQ's kernels use


ZERO_BITS = 8                 # zero points as uint8 (int3/int4 only; int8 is symmetric)


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


def swap_linears(model, make):
    """Replace every target linear by make(linear); -> model."""
    for name, lin in target_linears(model):
        replace_module(model, name, make(lin))
    return model


def model_from_checkpoint(ckpt, device="cpu"):
    """A plain model.GPT whose weights are the dequantized values (what serve.py and
    spec_decode.py run). Activation quantization (W8A8) is not part of a plain GPT: such a
    checkpoint runs weight-only here."""
    q = ckpt["quantization"]
    if not isinstance(q, dict) or q.get("format") != FORMAT_VERSION:
        found = q.get("format") if isinstance(q, dict) else type(q).__name__
        raise UserError(f"quantized checkpoint format {found!r} is not "
                        f"{FORMAT_VERSION}: re-run quantize.py --save")
    try:
        model = GPT(GPTConfig(**ckpt["config"]).validate(), seed=None)
        state = dict(ckpt["model"])
        for name, meta in q["layers"].items():
            state[name + ".weight"] = dequantize(ckpt["quantized"][name], meta["shape"],
                                                 meta["bits"], meta["group_size"])
        model.load_state_dict(state)
    except UserError:
        raise
    except Exception as e:        # a damaged or hand-edited file: one line, no traceback
        raise UserError(f"the quantized checkpoint is damaged or not quantize.py's "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
                        ) from None
    return model.to(device).eval()


def default_group(bits, group_size):
    return (0 if bits == 8 else 32) if group_size is None else group_size


def fmt_name(bits, group_size, act_bits=0):
    name = f"int{bits} " + (f"g{group_size}" if group_size else "per-row")
    return name + (" + int8 act" if act_bits else "")
