"""
lora_estimate.py -- QLoRA's storage arithmetic: the bits per parameter of the NF4 base,
measured on the model's own weights against the formula (4 + 8/64 + 32/(64·256) = 4.127
with double quantization, 4 + 32/64 = 4.5 without; the last lines of every lora.py run),
and `python lora.py --estimate 65B`: the memory arithmetic of lora.py's ledger for the
models the QLoRA paper talks about (LLaMA-65B, Llama-2-70B), which no CPU here can load.
Per parameter: full fine-tuning in mixed precision holds 16 B (weights, grads, Adam m and
v); LoRA on a bf16 base 2 B plus 12 B per adapter parameter; QLoRA's NF4 base 4.5 bits
without double quantization, 4.127 with it (nf4.NF4_DQ_BITS); activations with activation
checkpointing (every block's input kept, one block recomputed at a time, Korthikanti et
al. 2022). The question it answers: does 65B fit one 48 GB GPU?

Split out of lora.py by concept: what storing the base costs, bit by bit, where lora.py
trains and measures the adapters. It imports lora.py (its target layers); lora.py imports
it at the call.
"""
import math

import lora
from nf4 import NF4_DQ_BITS, NF4Weight
from plumbing import UserError, fmt_bytes, fmt_count, print0


def nf4_bits_report(model, block=64, dq_block=256, targets=lora.ALL_LINEARS):
    """Quantize the target weights both ways and count the stored bits."""
    linears = lora.target_linears(model, targets)
    # 4-bit codes + per block one absmax: 8 bits (itself quantized, with one fp32 constant
    # per dq_block absmaxes) or 32 bits (fp32)
    ways = ((True, 4 + 8 / block + 32 / (block * dq_block), "4 + 8/64 + 32/(64·256)"),
            (False, 4 + 32 / block, "4 + 32/64"))
    for dq, formula, label in ways:
        qs = [NF4Weight(m.weight, block, dq, dq_block) for _, m in linears]
        n = sum(math.prod(q.shape) for q in qs)
        bits = 8 * sum(q.nbytes for q in qs) / n
        err = max((q.dequantize() - m.weight).abs().max().item()
                  for q, (_, m) in zip(qs, linears))
        print0(f"NF4 {'with' if dq else 'without'} double quantization: measured "
               f"{bits:.4f} bits/param over {fmt_count(n)} weights | formula {label} = "
               f"{formula:.4f} | max |W - deq(W)| {err:.2e}")


EST_SHAPES = {  # layers, d_model, kv dim, ffn hidden, vocab, heads
    "65B": (80, 8192, 8192, 22016, 32000, 64),   # LLaMA-65B
    "70B": (80, 8192, 1024, 28672, 32000, 64)}   # Llama-2-70B (GQA, 8 KV heads)


def estimate(args):
    key = args.estimate.upper()
    if key not in EST_SHAPES:
        raise UserError(f"--estimate knows {', '.join(EST_SHAPES)}, not {args.estimate!r}")
    L, d, kv, ffn, V, heads = EST_SHAPES[key]
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (d, ffn), (ffn, d)]  # wq..w3
    linear = L * sum(o * i for o, i in shapes)
    other = 2 * V * d + L * 2 * d + d              # embedding, head, norms: kept 16-bit
    r, s = args.est_rank, args.est_seq
    adapter = L * sum(r * (o + i) for o, i in shapes)
    # activations with activation checkpointing (QLoRA uses it): every block's input kept
    # (2·s·h bytes per layer, bf16) + one block recomputed at a time (Korthikanti et al.)
    act = 2 * s * d * L + s * d * (34 + 5 * heads * s / d)
    ad = adapter * (2 + 2 + 8)                      # bf16 weights + grads, fp32 Adam m, v
    print0(f"{key}: Ψ = {fmt_count(linear + other)} ({fmt_count(linear)} in linear layers), "
           f"LoRA r={r} on all 7 linear layers = {fmt_count(adapter)} trainable "
           f"({adapter / (linear + other):.2%}); batch 1 × {s} tokens, decimal GB")
    rows = [("full fine-tuning, mixed precision: 16 B/param", 16 * (linear + other), 0),
            ("LoRA, bf16 base: 2 B/param + adapters 12 B/param", 2 * (linear + other), ad),
            ("QLoRA, NF4 without double quant (4.5 bits)", linear * 4.5 / 8 + 2 * other, ad),
            ("QLoRA, NF4 + double quant (4.127 bits)", linear * NF4_DQ_BITS / 8 + 2 * other, ad)]
    print0(f"  {'':<50} {'base':>9} {'adapters':>9} {'act':>8} {'total':>9}  48 GB GPU?")
    for label, base, adapters_b in rows:
        total = base + adapters_b + act
        print0(f"  {label:<50} {fmt_bytes(base):>9} {fmt_bytes(adapters_b):>9} "
               f"{fmt_bytes(act):>8} {total / 1e9:6.2f} GB  {'fits' if total < 48e9 else 'no'}")


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nlora_estimate.py runs as `python lora.py --estimate 65B` (see its --help).")
