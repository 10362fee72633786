"""
compression/nf4.py -- 4-bit NormalFloat, the storage format of QLoRA's frozen base (Dettmers et al.
2023, Sec. 3), by hand. A part of lora.py: how a frozen weight is stored in 4 bits,
not how it is adapted (lora.py's QLoRA wraps these in its adapted linear layer).

  saves: 32 -> 4.5 bits/param (4-bit codes + one fp32 absmax per block of 64), or 4.127
         with double quantization (the absmax constants themselves in int8, blocks of 256);
  adds:  a dequantization of the whole weight in every forward and every backward (no
         full-precision copy is kept);
  costs: quantization error (the base the adapter learns on is not the original W0).

Checked against bitsandbytes' codebook and packing order (tests/test_lora.py).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.cli import fmt_count
from core.errors import UserError
from core.meters import tensor_bytes
from core.runtime import print0


# ----------------------------------------------------------------------------------------
# NF4: 4-bit NormalFloat (QLoRA, Sec. 3). Pretrained weights are ~normal, so the 16 levels
# are quantiles of N(0, 1) rescaled to [-1, 1] (asymmetric so that 0 is exactly
# representable): each level is used about equally often -- information-theoretically
# optimal for normal data. The exact values bitsandbytes uses:
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def nf4_bits(block=64, dq_block=256, double_quant=True):
    """Stored bits per parameter, by formula: the 4-bit code plus, per block, one absmax of
    8 bits (itself quantized, with one fp32 constant per dq_block absmaxes) or of 32 (fp32)."""
    return 4 + 8 / block + 32 / (block * dq_block) if double_quant else 4 + 32 / block


NF4_DQ_BITS = nf4_bits()          # 4 + 8/64 + 32/(64·256) = 4.127: codes + int8 absmax + fp32


def pack_nibbles(codes):
    """Two 4-bit codes per byte, the first element in the high nibble (bitsandbytes)."""
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed):
    return torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten()


class NF4Weight(nn.Module):
    """A frozen weight in NF4. Stored: `packed` (uint8, numel/2: two codes per byte) and
    either `absmax` (fp32, one per block of 64: 4 + 32/64 = 4.5 bits/param) or, with
    double quantization (QLoRA Sec. 3), the absmax constants minus their mean as int8
    `absmax_q`, one fp32 `absmax_scale` per 256 of them and the fp32 mean: 4 + 8/64 +
    32/(64·256) = 4.127 bits/param. (bitsandbytes codes the constants with its 8-bit
    dynamic-tree float map; we use plain symmetric int8: same bits, simpler code.)"""

    def __init__(self, weight, block=64, double_quant=True, dq_block=256):
        super().__init__()
        self.shape, self.block, self.dq_block = tuple(weight.shape), block, dq_block
        flat = weight.detach().float().reshape(-1)
        if flat.numel() % block:
            raise UserError(f"NF4 needs a weight size that is a multiple of the block "
                            f"({block}); this layer has {tuple(weight.shape)} = {flat.numel()}")
        blocks = flat.view(-1, block)
        absmax = blocks.abs().amax(1)
        # nearest level: bucketize against the midpoints between neighbouring levels
        mid = ((NF4_CODE[1:] + NF4_CODE[:-1]) / 2).to(flat.device)
        codes = torch.bucketize(blocks / absmax.clamp_min(1e-12)[:, None], mid)
        codes = codes.to(torch.uint8).reshape(-1)
        self.register_buffer("packed", pack_nibbles(codes))
        self.double_quant = double_quant
        if double_quant:
            mean = absmax.mean()
            groups = F.pad(absmax - mean, (0, -absmax.numel() % dq_block)).view(-1, dq_block)
            scale = groups.abs().amax(1).clamp_min(1e-12) / 127
            q = (groups / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.register_buffer("absmax_q", q.reshape(-1)[:absmax.numel()].clone())
            self.register_buffer("absmax_scale", scale)
            self.register_buffer("absmax_mean", mean.reshape(1))
        else:
            self.register_buffer("absmax", absmax)

    def absmax_values(self):
        if not self.double_quant:
            return self.absmax
        scale = self.absmax_scale.repeat_interleave(self.dq_block)[:self.absmax_q.numel()]
        return self.absmax_q.float() * scale + self.absmax_mean

    def dequantize(self, dtype=torch.float32):
        values = NF4_CODE.to(self.packed.device)[unpack_nibbles(self.packed).long()]
        w = values.view(-1, self.block) * self.absmax_values()[:, None]
        return w.view(self.shape).to(dtype)

    @property
    def nbytes(self):
        return tensor_bytes(self.buffers())

    @property
    def bits_per_param(self):
        return 8 * self.nbytes / math.prod(self.shape)


class NF4Matmul(torch.autograd.Function):
    """y = x Wᵀ, W dequantized on the fly. W is frozen, so backward needs only grad_x =
    grad_y W: dequantize again rather than keep an fp32 W (and x is not saved at all): no
    full-precision W0 outlives one matmul. Price: two dequantizations per layer per step."""

    @staticmethod
    def forward(ctx, x, qweight):
        ctx.qweight = qweight               # module state, not an activation
        return F.linear(x, qweight.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y @ ctx.qweight.dequantize(grad_y.dtype), None


def nf4_bits_report(linears, block=64, dq_block=256):
    """Quantize the weights of these (name, nn.Linear) both ways (with and without double
    quantization) and print the stored bits per parameter next to the formula."""
    # the formula's label names the default blocks, as the papers write it
    for dq, label in ((True, "4 + 8/64 + 32/(64·256)"), (False, "4 + 32/64")):
        formula = nf4_bits(block, dq_block, dq)
        qs = [NF4Weight(m.weight, block, dq, dq_block) for _, m in linears]
        n = sum(math.prod(q.shape) for q in qs)
        bits = 8 * sum(q.nbytes for q in qs) / n
        err = max((q.dequantize() - m.weight).abs().max().item()
                  for q, (_, m) in zip(qs, linears))
        print0(f"NF4 {'with' if dq else 'without'} double quantization: measured "
               f"{bits:.4f} bits/param over {fmt_count(n)} weights | formula {label} = "
               f"{formula:.4f} | max |W - deq(W)| {err:.2e}")


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nnf4.py is a library: QLoRA runs as `python lora.py --method qlora` "
          "(see lora.py --help).")
