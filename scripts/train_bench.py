"""
scripts/train_bench.py -- what each one-process technique costs, measured and by formula:
  - `python -m scripts.train_bench`: the same model and tokens per step under fp32, selective and
    full activation checkpointing, gradient accumulation, bf16 autocast, bf16 / fp16 with
    fp32 master weights (under torchrun: every --dp mode, hand ZeRO-3 next to FSDP2); the
    model state per rank, the activation bytes, the step time and the bytes sent of each,
    as ratios against the first row of the same run;
  - `python -m scripts.train_bench --estimate --params 7B --gpus 64`: the model-state formulas (16
  B/param
    for fp32 or mixed precision with Adam, ZeRO-1/2/3's shares at N ranks) and Korthikanti
    et al.'s activation formula for any size, where no measurement fits on this machine.

An entry point in scripts/ (nothing imports it): measuring the techniques, not running the loop. It
imports train.py for the loop's pieces and flags; train.py does not know it exists.
"""
import argparse

from training import data_parallel, fp8
from core.cli import add_knobs, fmt_bytes, fmt_count, given, knob
from core.distributed import setup_runtime
from core.errors import UserError
from core.meters import comm, StepTimer
from core.runtime import print0, Progress, run_cli, seed_everything, TimingConditions
from model import GPT, get_config
import train
from train import activation_formula, build, micro_batches, state_rows, train_step


def estimate(args):
    """--estimate: the model-state bytes of --params parameters (per rank on --gpus ranks
    under each ZeRO stage) and the activation bytes of --est-shape, from the formulas.
    The letters are the formulas' (Ψ parameters, N ranks, L layers, h width, a heads,
    s sequence, b batch), so each printed line reads as its formula."""
    n = parse_count(args.params)
    N = args.gpus
    if N < 1:
        raise UserError("--gpus must be at least 1")
    L, h, a, s, b = (int(v) for v in args.est_shape.split(","))
    # fp8 (training/fp8.py): the matmuls read 1-byte copies, but the fp32 masters, their
    # gradients and Adam stay: model state as fp32's; the copies live through the backward
    scales = fp8.matmul_bytes("fp8-block", (128, 128), (128, 128), 128).weight - 1
    rows = [("fp32: params 4 + grads 4 + Adam 8", 16),
            ("mixed: bf16 params 2 + grads 2 + fp32 master 4 + Adam 8", 16),
            ("mixed, fp32 gradient accumulation buffer (+4)", 20),
            ("fp8 linears: fp32 master 4 + grads 4 + Adam 8", 16),
            ("  + their fp8 weight copies, forward to backward (1 B)", 1),
            ("  + V3's scales, 4 B per 128x128 block", scales),
            ("inference only, bf16 weights", 2)]
    print(f"model state for Ψ = {fmt_count(n)} parameters (decimal units):")
    for label, per in rows:
        print(f"  {label:<58} {per:>7.4g} B/param  {fmt_bytes(per * n):>10}")
    print(f"per rank with N = {N} data-parallel ranks, mixed precision (K = 12: master + Adam):")
    zero_rows = [("DDP        (2+2+K)Ψ", 16),
                 ("ZeRO-1     2Ψ+2Ψ+KΨ/N", 4 + 12 / N),
                 ("ZeRO-2     2Ψ+(2+K)Ψ/N", 2 + 14 / N),
                 ("ZeRO-3     (2+2+K)Ψ/N", 16 / N)]
    for label, per in zero_rows:
        print(f"  {label:<58} {per:7.2f} B/param  {fmt_bytes(per * n):>10}")
    print(f"  sent per step and rank: DDP/ZeRO-1/ZeRO-2 2Ψ = {fmt_bytes(2 * 2 * n)}, "
          f"ZeRO-3 3Ψ = {fmt_bytes(3 * 2 * n)} (bf16 values)")
    act = activation_formula(s, b, h, a, L)
    print(f"activations (Korthikanti et al. 2022, 16-bit), L={L} h={h} heads={a} seq={s} "
          f"batch={b}:")
    print(f"  no recompute   s·b·h·(34 + 5·a·s/h)·L        {fmt_bytes(act):>10}")
    print(f"  selective      s·b·h·34·L (scores recomputed)  "
          f"{fmt_bytes(s * b * h * 34 * L):>10}")
    print(f"  full recompute 2·s·b·h·L (block inputs only)   "
          f"{fmt_bytes(2 * s * b * h * L):>10}")
    # Of the 34·sbh, the linears' inputs are 14 (QKV 2, output projection 2, MLP in 2 and
    # its 4h hidden 8); saved in fp8 with a 4 B scale per 1×128 tile: 1 + 4/128 B each
    tile = fp8.matmul_bytes("fp8-block", (128, 128), (128, 128), 128).activation
    saved = 34 - 14 + 14 * tile / 2
    print(f"  fp8 linear inputs (V3) s·b·h·({saved:.1f} + 5·a·s/h)·L  "
          f"{fmt_bytes(act * (saved + 5 * a * s / h) / (34 + 5 * a * s / h)):>10}")


def parse_count(text):
    """7B, 124M, 1.5e9 -> an int."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    try:
        t = text.strip().upper()
        return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(float(t))
    except (ValueError, IndexError, KeyError):
        raise UserError(f"cannot read a parameter count from {text!r} (try 7B, 124M, 1.5e9)")


def bench(args, rt, conditions=None):
    """Same model, same tokens per step; what each technique does to model state (per
    rank), activations, step time and bytes sent. One process: the memory techniques vs
    fp32 (on CPU, bf16/fp16 matmuls are emulated and slow: read their memory columns, not
    their time). Under torchrun: every --dp mode, hand ZeRO-3 next to PyTorch's FSDP2.
    conditions: a core.runtime.TimingConditions (None: the machine's own) that ends the
    table with one warning line when the load or the steps' spread make the times doubtful."""
    conditions = conditions or TimingConditions()
    if rt.distributed:
        rows = [(f"--dp {mode}", {"dp": mode}) for mode in data_parallel.MODES]
    else:
        rows = [("baseline fp32", {}),
                ("selective checkpointing", {"checkpointing": "selective"}),
                ("full checkpointing", {"checkpointing": "full"}),
                ("grad accumulation ×4", {"grad_accum": 4, "batch_size": args.batch_size // 4}),
                ("autocast bf16", {"precision": "autocast-bf16"}),
                ("bf16 + fp32 master", {"precision": "bf16"}),
                ("fp16 + master + loss scaling", {"precision": "fp16"}),
                ("fp8 tensorwise", {"precision": "fp8"}),
                ("fp8 block (V3)", {"precision": "fp8-block", "fp8_block": fp8_block_for(args)})]
        if args.batch_size % 4:
            raise UserError("bench needs --batch-size divisible by 4 (for the accumulation row)")
    # one progress line per configuration: a full bench takes minutes and the table
    # comes only at the end (the estimate assumes the rows cost alike; they do not quite)
    progress = Progress("bench", len(rows), every=0)
    results, repeats = [], {}
    with conditions:                 # the load average as the first row starts, the last ends
        for i, (label, changes) in enumerate(rows):
            progress.update(i, now_on=label)
            times, state, act, sent, seq_len = bench_row(args, rt, changes)
            # the first step pays one-time costs: the best of the others, and their spread
            results.append((label, state, act, min(times[1:] or times), sent))
            repeats[label] = times[1:]
    base = results[0]
    print0(f"bench: preset {args.preset or 'small'}, attention {args.attn}, {args.batch_size}×"
           f"{seq_len} tokens/step/rank, {rt.world_size} rank(s), best of "
           f"{args.bench_steps} steps, device {rt.device}")
    print0(f"{'technique':<30} {'state/rank':>11} {'activations':>12} {'act ×':>6} "
           f"{'step ms':>8} {'time ×':>7} {'sent/step':>10}")
    for label, st, act, t, sent in results:
        print0(f"{label:<30} {fmt_bytes(st):>11} {fmt_bytes(act):>12} {act / base[2]:6.2f} "
               f"{t * 1000:8.0f} {t / base[3]:7.2f} {fmt_bytes(sent):>10}")
    if rt.distributed:
        t = {label: seconds for label, _, _, seconds, _ in results}
        print0(f"hand zero3 / fsdp step time: {t['--dp zero3'] / t['--dp fsdp']:.2f} "
               f"(fsdp's own collectives are not in 'sent')")
    # "selective checkpointing 0.58x" (faster than none) came from a loaded machine: say so
    conditions.report(repeats, out=print0)
    return results


def fp8_block_for(args):
    """--fp8-block, or the block train.py would pick (fp8.default_block: the demo's 64)."""
    if args.fp8_block is not None:
        return args.fp8_block
    cfg = get_config(args.preset or "small", **given(args, train.CONFIG_KNOBS))
    return fp8.default_block(GPT(cfg, seed=None))


def bench_row(args, rt, changes):
    """One configuration: the run built with `changes`, --bench-steps steps timed. ->
    (seconds of each step, model state per rank, activation bytes, bytes sent per step,
    the sequence length build() settled on)."""
    run_args = argparse.Namespace(**{**vars(args), **changes, "steps": args.bench_steps,
                                     "save_interval": 0, "sample_tokens": 0,
                                     "resume": False})
    seed_everything(run_args.seed)
    run = build(run_args, rt)
    times, act = [], 0
    for step in range(run_args.steps):
        batches = micro_batches(run.corpus, run_args, step, rt.device, rt.rank)
        wire = comm.total_wire
        with StepTimer(rt.device) as timer:
            _, act, _ = train_step(run, batches, run_args, rt.device)
        sent = comm.total_wire - wire
        ledger = state_rows(run)
        state = ledger["total"] - ledger["opt_scalars"]
        run.sync.zero_grad()
        times.append(timer.seconds)
    return times, state, act, sent, run_args.seq_len


# ----------------------------------------------------------------------------------------
# The command line: train.py's knobs (the loop's), and this file's own group

BENCH_KNOBS = [
    knob("--estimate", False, "print the memory formulas for --params parameters on --gpus "
         "ranks and exit"),
    knob("--params", "7B", "--estimate: parameter count (7B, 1.5e9)"),
    knob("--gpus", 64, "--estimate: data-parallel ranks"),
    knob("--est-shape", "32,4096,32,4096,1", "layers,hidden,heads,seq,batch for --estimate's "
         "activation rows"),
    knob("--bench-steps", 3, "steps per bench row"),
]


def parse_args(argv=None):
    p = train.build_parser("What each one-process technique costs, as ratios measured in "
                           "one run (under torchrun: every --dp mode too); --estimate: the "
                           "memory formulas at any size.")
    add_knobs(p, BENCH_KNOBS, "bench and estimate")
    # the configuration the README's trade-off rows state: 4 sequences of 256 tokens a
    # step (train.py's own default, 8, doubles every activation and every step time)
    p.set_defaults(batch_size=4)
    args = train.check_args(p.parse_args(argv))
    if args.attn is None:
        args.attn = "math"     # so the s² attention scores show up in the activation column
    return args


def main(argv=None, conditions=None):
    """conditions: bench's TimingConditions (a test passes a loaded or quiet machine)."""
    args = parse_args(argv)
    if args.estimate:
        return estimate(args)
    with setup_runtime(args.device, args.timeout) as rt:
        return bench(args, rt, conditions)


if __name__ == "__main__":
    run_cli(main)
