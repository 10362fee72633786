"""
scripts/lora_estimate.py -- QLoRA's memory arithmetic at the sizes its paper talks about:

    python -m scripts.lora_estimate 65B [--est-rank 64] [--est-seq 512]

The bits per parameter of the NF4 base are measured on the model's own weights against
the formula (4 + 8/64 + 32/(64·256) = 4.127 with double quantization, 4 + 32/64 = 4.5
without) by compression/nf4.py's nf4_bits_report at the end of every lora.py run; this
file applies the same memory arithmetic of lora.py's ledger for the
models the QLoRA paper talks about (LLaMA-65B, Llama-2-70B), which no CPU here can load.
Per parameter: full fine-tuning in mixed precision holds 16 B (weights, grads, Adam m and
v); LoRA on a bf16 base 2 B plus 12 B per adapter parameter; QLoRA's NF4 base 4.5 bits
without double quantization, 4.127 with it (nf4.NF4_DQ_BITS); activations with activation
checkpointing (every block's input kept, one block recomputed at a time, Korthikanti et
al. 2022). The question it answers: does 65B fit one 48 GB GPU?

An entry point in scripts/ (nothing imports it): arithmetic, no model.
"""
import sys

from compression.nf4 import NF4_DQ_BITS
from core.cli import command_line, fmt_bytes, fmt_count, knob
from core.errors import UserError
from core.runtime import print0, run_cli


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


# ----------------------------------------------------------------------------------------
# The command line: a row per knob (core/cli.py makes the flags and --help from it)

KNOBS = [
    knob("estimate", str, f"one of {', '.join(sorted(EST_SHAPES))}", metavar="MODEL",
         choices=sorted(EST_SHAPES)),
    knob("--est-rank", 64, "LoRA rank"),
    knob("--est-seq", 512, "tokens per step"),
]


def main(argv=None):
    p = command_line("QLoRA's memory arithmetic for the models its paper talks about: does "
                     "it fit one 48 GB GPU?", {None: KNOBS})
    # 65b, 70b: the model names in either case
    args = p.parse_args([a.upper() if a.lower() in ("65b", "70b") else a
                         for a in (sys.argv[1:] if argv is None else argv)])
    for name in ("est_rank", "est_seq"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    return estimate(args)


if __name__ == "__main__":
    run_cli(main)
