"""
reproduce.py -- one command regenerates the trade-off table from the commands themselves.

Every figure in docs/tradeoffs.md is a number one of this repo's commands prints. This
script runs those commands -- the README's, in the README's order, at the README's sizes,
on the models the earlier commands make (the demo model first, then the draft model) --
reads each figure out of what the command printed, and writes the table with the date, the
machine and the commit it was measured on. A row whose command failed, or whose figure the
output no longer contains, says so in its cells: nothing is carried over from an old run.

    python reproduce.py                    # README sizes: docs/tradeoffs.md (about an hour
                                           #   on 2 CPU cores; progress lines as it goes)
    python reproduce.py --quick            # the same commands at tiny sizes (~2 min): every
                                           #   command still runs and every cell still fills
    python reproduce.py --only train_bench,lora --out /tmp/t.md   # some runs (others: "not run")
    python reproduce.py --list             # the runs, their commands, the rows each feeds

How it is built, for a reader who wants to add a row:
  - a RUN is one command line (as the README writes it) plus its --quick twin and the
    FIGURES read from its output: each a regex whose first group is the figure as printed,
    or `cell(row label, column)` for the aligned tables most commands print;
  - a ROW is the technique's name and three cells (what it saves, what it adds, what it
    costs) written as templates: "{dp.zero2_state}/rank" is run `dp`'s figure `zero2_state`.
    Prose that is not measured stays prose; every number comes from a {placeholder}.

Costs: the full run is every topic's headline command back to back (the longest: the demo,
quantize.py compare, rl.py compare, spec_decode.py bench); it writes under --workdir (its
out/ folder is the commands' out/), never over the reader's out/ckpt.pt. Times in the table
are wall times on the machine named in its first line: compare ratios, not seconds.
"""
import concurrent.futures
import dataclasses
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from core.plumbing import ArgumentParser, HelpFormatter, UserError, fmt_duration, run_cli

ROOT = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(ROOT, "docs", "tradeoffs.md")
QUICK_TABLE = os.path.join(ROOT, "out", "tradeoffs-quick.md")    # never over the measured one
MISSING = "**?**"              # a figure the output did not contain: shown, never invented


# ----------------------------------------------------------------------------------------
# Reading figures out of what a command printed

def cell(label, column, after=None):
    """The `column`-th cell (0 = the first after the label) of the table line that starts
    with `label` -- cells are separated by two or more spaces, as our tables print them.
    `after`: search only below the first line containing this text (a second table)."""
    def read(output):
        if after is not None:
            at = output.find(after)
            if at < 0:
                return None
            output = output[at:]
        for line in output.splitlines():
            if line.strip().startswith(label):
                rest = line.strip()[len(label):].strip()
                cells = re.split(r"\s{2,}", rest)
                return cells[column] if column < len(cells) else None
        return None
    return read


def md_cell(first_cells, column):
    """Cell `column` (0 = the first) of the Markdown table row that begins with
    `first_cells` (e.g. "| rtn | int4 g32 |"): the first such row."""
    def read(output):
        for line in output.splitlines():
            if line.startswith(first_cells):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                return cells[column] if column < len(cells) else None
        return None
    return read


def grab(pattern):
    """The first group of the regex's first match (re.S off: one line at a time)."""
    def read(output):
        m = re.search(pattern, output)
        return m.group(1) if m else None
    return read


def last(pattern):
    """The first group of the regex's LAST match: the final value of a logged series."""
    def read(output):
        found = re.findall(pattern, output)
        return found[-1] if found else None
    return read


def ratio(read_a, read_b, fmt="{:.2f}"):
    """a / b of two figures printed with units (KB, MB, ms): the same unit on both sides."""
    def read(output):
        a, b = read_a(output), read_b(output)
        if a is None or b is None:
            return None
        return fmt.format(number(a) / number(b))
    return read


def number(text):
    """12.5 MB -> 12.5e6, 1,536 -> 1536, 63% -> 63: a printed figure as a float."""
    m = re.match(r"\s*([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*([KMGT]?)B?", text)
    if not m:
        raise ValueError(f"not a figure: {text!r}")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1).replace(",", "")) * scale


# ----------------------------------------------------------------------------------------
# The runs, in the README's order

@dataclasses.dataclass
class Run:
    name: str
    command: str               # as the README (or the topic's page) writes it
    quick: str                 # the same command at tiny sizes, for --quick
    figures: dict              # figure name -> reader(output) -> str or None
    needs: tuple = ()          # runs whose files (checkpoints) this one reads


TRAIN_BENCH_ROWS = {"base": "baseline fp32", "selective": "selective checkpointing",
                    "full": "full checkpointing", "accum": "grad accumulation ×4",
                    "autocast": "autocast bf16", "bf16": "bf16 + fp32 master",
                    "fp16": "fp16 + master + loss scaling"}
DP_ROWS = {"ddp": "--dp ddp", "zero1": "--dp zero1", "zero2": "--dp zero2",
           "zero3": "--dp zero3", "fsdp": "--dp fsdp"}
LORA_ROWS = ("full", "lora", "loraplus", "qlora", "vera", "dora")
TINY = "--preset tiny --seq-len 32"


def table_figures(rows, columns):
    """{f"{key}_{col}": cell(label, i)} for every row label and named column."""
    return {f"{key}_{col}": cell(label, i) for key, label in rows.items()
            for col, i in columns.items()}


RUNS = [
    Run("demo", "python train.py",
        "python train.py --preset tiny --steps 30 --batch-size 4 --seq-len 32 "
        "--eval-interval 15 --eval-iters 2 --sample-tokens 0",
        {"val": last(r"step +\d+ \| val loss ([\d.]+)"),
         "steps": grab(r"trained (\d+) steps in"),
         "time": grab(r"trained \d+ steps in ([\d.]+ s)")}),
    Run("train_bench", "python -m scripts.train_bench",
        f"python -m scripts.train_bench {TINY} --bench-steps 2",
        {**table_figures(TRAIN_BENCH_ROWS, {"state": 0, "act": 1, "actx": 2, "timex": 4}),
         "preset": grab(r"bench: preset (\w+),"),
         "tokens": grab(r"bench: preset \w+, attention \w+, (\d+×\d+) tokens")}),
    Run("dp", "torchrun --standalone --nproc_per_node=2 -m scripts.train_bench",
        f"torchrun --standalone --nproc_per_node=2 -m scripts.train_bench {TINY} "
        "--bench-steps 2",
        {**table_figures(DP_ROWS, {"state": 0, "timex": 4, "sent": 5}),
         "zero3_fsdp": grab(r"hand zero3 / fsdp step time: ([\d.]+)")}),
    Run("tp", "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check",
        "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check --preset tiny "
        "--steps 2",
        {"state": grab(r"state ([\d.]+ [KMG]?B)/rank"),
         "sent": grab(r"sent ([\d.]+ [KMG]?B)/step"),
         "check": grab(r"(every gradient \(max \|diff\| [\d.e-]+\))"),
         "act": grab(r"activations of one microbatch, this rank's stages: ([\d.]+ [KMG]?B)"),
         "act_one": grab(r"one process, all \d+ sequences and layers: ([\d.]+ [KMG]?B)")}),
    Run("pipeline", "torchrun --standalone --nproc_per_node=4 -m parallelism.pipeline bench",
        "torchrun --standalone --nproc_per_node=2 -m parallelism.pipeline bench "
        "--microbatches 4 --steps 1 --seq-len 16 --microbatch-size 2 --n-embd 32 --n-layer 4",
        {f"{s}_{col}": cell(s, i) for s in ("gpipe", "1f1b", "zb", "dualpipev")
         for col, i in {"bubble": 4, "theory": 5, "p2p": 6}.items()}),
    Run("optim_bench", "python optim.py bench",
        "python optim.py bench --n-layer 1 --n-embd 32 --vocab-size 300 --bench-steps 2",
        {"ns_share": grab(r"Newton–Schulz: [\d.]+ [MGT]?FLOP per step = ([\d.]+%)"),
         "muon_ms": cell("Muon (hidden matrices)", 1), "adamw_ms": cell("AdamW", 1)}),
    Run("optim", "python optim.py compare",
        "python optim.py compare --vocab-size 300 --n-layer 1 --n-embd 32 --steps 12 "
        "--batch-size 4 --seq-len 32 --warmup-steps 2 --eval-interval 3 --eval-iters 2 "
        "--lrs 3e-3,1e-2 --muon-lrs 1e-2,3e-2",
        {"speedup": grab(r"AdamW/Muon = ([\d.]+×)"),
         "target": grab(r"(?m)^val loss ([\d.]+): AdamW needs")}),
    Run("lora", "python lora.py compare",
        "python lora.py compare --steps 3 --batch-size 8 --n-train 200 --eval-problems 16 "
        "--warmup 1 --log-interval 100",
        {**{f"{m}_{col}": cell(m, i, after="ledger (") for m in LORA_ROWS
            for col, i in {"trainable": 0, "state": 5, "statex": 6, "actx": 8,
                           "timex": 10, "exact": 11, "loss": 12}.items()},
         "nf4_bits": grab(r"NF4 with double quantization: measured ([\d.]+) bits"),
         "nf4_err": grab(r"NF4 with double quantization: .* max \|W - deq\(W\)\| ([\d.e-]+)")},
        needs=("demo",)),
    Run("mla", "python -m scripts.mla_bench",
        "python -m scripts.mla_bench --context 32 --new-tokens 4 --repeats 1",
        {"mla_bytes": cell("MLA", 2), "mha_bytes": cell("MHA", 2),
         "gqa_bytes": cell("GQA 2 kv heads", 2),
         "less": grab(r"MLA caches [\d.]+ [KMG]?B/token: ([\d.]+x) less than MHA"),
         "unabsorbed": ratio(cell("MLA unabsorbed", 0), cell("MLA absorbed", 0))}),
    Run("serve", "python -m scripts.serve_bench",
        "python -m scripts.serve_bench --num-requests 8 --prompt-len 8:16 --output-len 4:8",
        {"slots": grab(r"unfilled slots per running sequence: mean ([\d.]+)"),
         "contig": grab(r"reserving the full context \(\d+\) per request: (\d+%) wasted"),
         "static_waste": grab(r"static batching reserves .* = (\d+%) wasted"),
         "engine_speedup": cell("engine (fcfs)", 2), "static_speedup": cell("static batching", 2),
         "fcfs_goodput": cell("engine (fcfs)", 8), "slo_goodput": cell("engine (slo)", 8),
         "same": grab(r"greedy outputs of fcfs == sequential generate\(\): (\d+/\d+)")},
        needs=("demo",)),
    Run("agent", "python -m scripts.serve_bench --workload agent --kv-tier host "
        "--num-blocks 48",
        "python -m scripts.serve_bench --workload agent --kv-tier host --num-blocks 24 "
        "--sessions 4 --turns 3 --system-len 8 --message-len 4:8 --answer-len 4:8 "
        "--block-size 4",
        {f"{key}_{tier}": grab(rf"(?m)^ *\d+ {tier} +(?:\S+ +){{{skip}}}(\S+)")
         for tier in ("none", "host")
         for key, skip in {"prompt": 0, "hit": 1, "tier_hit": 2, "computed": 5,
                           "ttft": 10}.items()},
        needs=("demo",)),
    Run("router", "python kv_router.py bench",
        "python kv_router.py bench --sessions 4 --turns 2",
        {f"{policy}_{col}": cell(policy, i) for policy in ("cache_aware", "least_loaded",
                                                           "round_robin")
         for col, i in {"hit": 0, "one_cache": 1, "computed": 3}.items()}),
    Run("streaming", "python streaming.py measure --bos",
        "python streaming.py measure --bos --train-steps 2 --tokens 150 --sinks 2 --window 30",
        {"model": grab(r"model: ([^(,]+?)\s*[(,]"),
         "stream": grab(r"stream: (\d+ val tokens = [\d.]+x the context)"),
         "whole_bytes": grab(r"\| full KV cache \(model\.KVCache\) \|[^|]+\| ([^|]+?) \|"),
         "held": grab(r"\| sinks \d+ \+ window \d+ \| (\d+) \|"),
         "bytes": grab(r"\| sinks \d+ \+ window \d+ \| \d+ \| ([^|]+?) \|"),
         "rerotated": grab(r"\| sinks \d+ \+ window \d+ \| \d+ \|[^|]+\|[^|]+\| (\d+) \|"),
         "dense": grab(r"dense recompute \(\d+\): mean loss ([\d.]+)"),
         "window": grab(r"(?m)^window \(\d+\): mean loss ([\d.]+)"),
         "sinks": grab(r"sinks \d+ \+ window \d+: mean loss ([\d.]+)")}),
    Run("curate", "python curate.py stats",
        "python curate.py stats --max-bytes-per-domain 200000",
        {"rules": grab(r"all rules: remove (\d+ of \d+ documents, [\d.]+ [KMG]?B of "
                       r"[\d.]+ [KMG]?B)")}),
    Run("ppl", "python evaluate.py ppl", "python evaluate.py ppl --max-tokens 8192",
        {"ppl": cell("perplexity", 0), "bpb": cell("bits/byte", 0),
         "loss": cell("loss (nats)", 0)},
        needs=("demo",)),
    Run("task", "python evaluate.py task",
        "python evaluate.py task --task-preset tiny --sft-steps 2 --n-train 50 "
        "--eval-problems 40",
        {"gen": grab(r"task SFT \(\w+\) +([\d.]+%)"),
         "rank": grab(r"task SFT \(\w+\) +[\d.]+% \[[^]]*\] +([\d.]+%)"),
         "cached_s": grab(r"prompt KV cache reused ([\d.]+ s)"),
         "rerun_s": grab(r"prompt re-run per candidate ([\d.]+ s)")},
        needs=("demo",)),
    Run("calibration", "python -m scripts.calibration",
        "python -m scripts.calibration --task-preset tiny --sft-steps 2 --n-train 50 "
        "--eval-problems 40",
        {"T": grab(r"fitted T = ([\d.]+)"),
         "seq_before": grab(r"sequence prob +1\.000 +\S+ +\S+ +(\S+)"),
         "seq_after": last(r"sequence prob +[\d.]+ +\S+ +\S+ +(\S+)"),
         "first_before": grab(r"first-token prob +1\.000 +\S+ +\S+ +(\S+)"),
         "first_after": last(r"first-token prob +[\d.]+ +\S+ +\S+ +(\S+)")},
        needs=("demo",)),
    Run("disagg", "torchrun --standalone --nproc_per_node=2 disagg.py bench --rate 40 "
        "--num-requests 96",
        "torchrun --standalone --nproc_per_node=2 disagg.py bench --preset tiny "
        "--num-requests 8 --long-len 20:30",
        {"delayed": grab(r"disaggregated 1P \+ 1D .*?(\d+ of \d+) +\("),
         "delayed_colocated": grab(r"colocated x2 \(half each\) .*?(\d+ of \d+) +\("),
         "kv": grab(r"KV moved by disaggregation: ([\d.]+ [KMG]?B)"),
         "kv_formula": grab(r"KV moved by disaggregation: .*= the formula's (\d+ B)"),
         "kv_measured": grab(r"KV moved by disaggregation: [\d.]+ [KMG]?B \((\d+ B)"),
         "same": grab(r"greedy outputs identical in the three systems: (\d+/\d+)")}),
    Run("draft", "python train.py --preset draft --ckpt out/draft.pt --sample-tokens 0",
        "python train.py --preset tiny --n-layer 1 --ckpt out/draft.pt --steps 2 "
        "--batch-size 2 --seq-len 32 --sample-tokens 0",
        {"val": last(r"step +\d+ \| val loss ([\d.]+)|saved step (\d+)")}),
    Run("spec", "python spec_decode.py bench",
        "python spec_decode.py bench --train-steps 5 --max-new-tokens 8 --bench-prompts 1 "
        "--repeats 1",
        {**{f"{m}_speedup": grab(rf"(?m)^{m} +.*\| +\d+ +([\d.]+x)")
            for m in ("draft", "tree", "medusa", "eagle", "dflash", "mtp")},
         **{f"{m}_alpha_t1": grab(rf"(?m)^{m} +\S+ +\S+ +1 +\S+ \| +([\d.]+)")
            for m in ("draft", "medusa", "eagle", "dflash")},
         "drafters": grab(r"drafters: ([\d.]+ [KMG]?B)")},
        needs=("demo", "draft")),
    Run("quantize", "python quantize.py compare",
        "python quantize.py compare --qat-steps 2 --eval-batches 1 --prompts 1 "
        "--new-tokens 4 --repeats 1 --seq-len 32 --batch-size 2 --calib-batches 1",
        {f"{key}_{col}": md_cell(first, i)
         for key, first in {"fp32": "| fp32 | fp32 |", "int8": "| rtn | int8 per-row |",
                            "int4": "| rtn | int4 g32 |", "int3": "| rtn | int3 g32 |",
                            "gptq3": "| gptq | int3 g32 |", "awq3": "| awq | int3 g32 |",
                            "sq": "| smoothquant |", "mag24": "| magnitude | 2:4 50% |",
                            "wanda24": "| wanda | 2:4 50% |",
                            "mag50": "| magnitude | unstructured 50% |",
                            "wanda50": "| wanda | unstructured 50% |"}.items()
         for col, i in {"bits": 2, "bytes": 3, "dloss": 5, "top1": 7, "greedy": 8,
                        "decode": 10}.items()},
        needs=("demo",)),
    Run("rl", "python rl.py compare",
        "python rl.py compare --checkpoint none --preset tiny --teacher-preset tiny "
        "--digits 1 --ops +- --max-new 4 --steps 2 --group 4 --sft-steps 20 "
        "--teacher-sft-steps 20 --eval-samples 2 --eval-problems 20",
        {**{f"{algo}_{col}": cell(algo, i, after="ledger (") for algo in ("ppo", "grpo", "drgrpo", "distill",
                                                        "softkd", "seqkd")
            for col, i in {"state": 1, "vs_grpo": 7, "held_out": 10,
                           "zero_var": 15}.items()},
         "critic": grab(r"PPO's critic: \+([\d.]+k parameters \(\d+% of the policy's\))"),
         "critic_state": grab(r"PPO's critic: .*, \+([\d.]+ [KMG]?B) state")}),
]


# ----------------------------------------------------------------------------------------
# The rows: technique, what it saves, what it adds, what it costs

ROWS = [
    ("fp32 baseline (`{train_bench.cmd}`, {train_bench.preset}, {train_bench.tokens} tokens)",
     "—", "—",
     "model state {train_bench.base_state}; activations {train_bench.base_act}"),
    ("mixed precision: bf16 autocast / bf16 + fp32 master / fp16 + master + loss scaling",
     "model state **none** ({train_bench.autocast_state} / {train_bench.bf16_state} / "
     "{train_bench.fp16_state}); activations ×{train_bench.autocast_actx} / "
     "×{train_bench.bf16_actx} / ×{train_bench.fp16_actx} (norms, RoPE, softmax, loss stay fp32)",
     "casts; fp16: an inf/NaN check per step",
     "rounding error; fp16 skips steps on overflow; step time ×{train_bench.autocast_timex} / "
     "×{train_bench.bf16_timex} / ×{train_bench.fp16_timex} (CPU: emulated matmuls)"),
    ("selective activation checkpointing",
     "activations ×{train_bench.selective_actx} (the T² attention scores and the SwiGLU "
     "product are recomputed)",
     "+1 attention-core and SwiGLU forward per layer",
     "×{train_bench.selective_timex} step time"),
    ("full activation checkpointing",
     "activations ×{train_bench.full_actx} (block inputs only)",
     "+1 forward of every block",
     "×{train_bench.full_timex} step time (≈ +33% expected: one more forward)"),
    ("gradient accumulation ×4",
     "activations ×{train_bench.accum_actx}",
     "none (same math, tested equal)",
     "4 sequential micro-steps: ×{train_bench.accum_timex} step time"),
    ("DDP, N=2 (`{dp.cmd}`)",
     "none: {dp.ddp_state}/rank",
     "all-reduce 2Ψ(N−1)/N: {dp.ddp_sent} per step",
     "replicated state"),
    ("ZeRO-1, N=2",
     "optimizer state ÷N: {dp.zero1_state}/rank",
     "same bytes as DDP: {dp.zero1_sent} (reduce-scatter + all-gather)",
     "{dp.zero1_timex}× DDP's step time"),
    ("ZeRO-2, N=2",
     "+ gradients ÷N: {dp.zero2_state}/rank",
     "same bytes as DDP: {dp.zero2_sent}",
     "{dp.zero2_timex}× DDP's step time"),
    ("ZeRO-3, N=2",
     "+ parameters ÷N: {dp.zero3_state}/rank",
     "3Ψ(N−1)/N: {dp.zero3_sent} per step (+50%)",
     "all-gather on the critical path of every block: {dp.zero3_timex}× DDP's; "
     "hand ZeRO-3 / FSDP2 = {dp.zero3_fsdp}"),
    ("tensor parallelism, t=2 (`{tp.cmd}`)",
     "model state ÷2: {tp.state}/rank; activations {tp.act} vs {tp.act_one} in one process",
     "4 all-reduces of b·s·h per layer (+ embedding, head, the loss): {tp.sent} per step, "
     "on the critical path",
     "keep it inside a node; {tp.check} equal to one process"),
    ("pipeline, 1F1B (`{pipeline.cmd}`)",
     "weights, grads, Adam ÷P; activations: up to P microbatches in flight (GPipe: M)",
     "one activation and one gradient per microbatch per boundary: {pipeline.1f1b_p2p} "
     "sent per rank",
     "bubble: GPipe {pipeline.gpipe_bubble}, 1F1B {pipeline.1f1b_bubble} "
     "(theory {pipeline.1f1b_theory})"),
    ("zero-bubble ZB-H1 / DualPipeV",
     "— / DualPipeV: 2 half-stages per rank",
     "W's dW = dYᵀX matmuls run apart from dX (X, dY kept until then)",
     "bubble {pipeline.zb_bubble} / {pipeline.dualpipev_bubble} vs 1F1B's "
     "{pipeline.1f1b_bubble}"),
    ("SGD / momentum / RMSProp vs Adam (`{optim_bench.cmd}`)",
     "8 / 4 / 4 B/param less optimizer state",
     "elementwise only",
     "one lr for every coordinate (SGD, momentum), no bias correction (RMSProp)"),
    ("Muon hybrid (`{optim.cmd}`)",
     "momentum only on hidden matrices: 4 instead of 8 B/param there",
     "Newton–Schulz: {optim_bench.ns_share} of step FLOPs here (< 1% at scale); optimizer "
     "step {optim_bench.muon_ms} vs {optim_bench.adamw_ms} ms",
     "needs whole matrices (ZeRO must shard by matrix); {optim.speedup} fewer tokens than "
     "AdamW to val loss {optim.target}"),
    ("LoRA r=8, all linears (`{lora.cmd}`)",
     "model state {lora.full_state} → {lora.lora_state} ({lora.lora_statex}×); trainable "
     "{lora.full_trainable} → {lora.lora_trainable}",
     "2 thin matmuls per layer: ×{lora.lora_timex} full's step",
     "ΔW of rank ≤ 8: answer loss {lora.lora_loss} vs full {lora.full_loss} (exact match "
     "{lora.lora_exact} vs {lora.full_exact})"),
    ("LoRA+ λ=16", "as LoRA", "none",
     "one more hyper-parameter; answer loss {lora.loraplus_loss} vs LoRA's {lora.lora_loss}"),
    ("QLoRA (NF4 + double quant)",
     "block weights 32 → {lora.nf4_bits} bits/param; state {lora.qlora_statex}× full",
     "dequantize every weight in forward and backward: ×{lora.qlora_timex} full's step",
     "quantization error (max {lora.nf4_err}); answer loss {lora.qlora_loss}"),
    ("VeRA (shared r=64)",
     "trainable {lora.vera_trainable}",
     "elementwise scalings",
     "a random subspace: answer loss {lora.vera_loss}; activations ×{lora.vera_actx} full's"),
    ("DoRA",
     "as LoRA + one float per output row: trainable {lora.dora_trainable}",
     "W0 + sBA and its row norms every step: ×{lora.dora_timex} full's step",
     "activations ×{lora.dora_actx} full's; answer loss {lora.dora_loss}"),
    ("multi-head latent attention (`{mla.cmd}`)",
     "KV {mla.mla_bytes} B/token vs MHA's {mla.mha_bytes} ({mla.less} less), GQA with 2 KV "
     "heads {mla.gqa_bytes}; measured = the formula (d_c + d_R)·L·bytes",
     "absorbed decode: the query through W_UK, the output through W_UV",
     "MLA without absorption (the training path): {mla.unabsorbed}× the absorbed decode "
     "step, same outputs"),
    ("paged KV cache, block 16 (`{serve.cmd}`)",
     "waste < 1 block per sequence (mean {serve.slots} unfilled slots) vs {serve.contig} for "
     "a contiguous full-context reservation",
     "a K/V gather through the block table per layer per step",
     "block tables to keep; greedy outputs = sequential generate() {serve.same}"),
    ("continuous batching + chunked prefill",
     "no padding (static batching wastes {serve.static_waste} of its reservation)",
     "scheduling every step",
     "{serve.engine_speedup} sequential, static batching {serve.static_speedup} here"),
    ("SLO-aware scheduling",
     "—", "none measurable",
     "goodput {serve.fcfs_goodput} → {serve.slo_goodput} req/s; batch requests wait longer"),
    ("second KV tier, host memory (`{agent.cmd}`)",
     "prompt tokens computed {agent.computed_none} → {agent.computed_host} of "
     "{agent.prompt_none} ({agent.tier_hit_host} reloaded from the tier)",
     "a copy per evicted block out, and back on a hit",
     "host memory; TTFT p50/p99 {agent.ttft_none} → {agent.ttft_host} ms"),
    ("cache-aware routing (`{router.cmd}`, 4 replicas)",
     "prefix hit rate {router.cache_aware_hit} vs {router.round_robin_hit} round-robin, "
     "{router.least_loaded_hit} least-loaded (one shared cache: {router.cache_aware_one_cache})",
     "a hash chain per prompt, an index of every replica's blocks",
     "positions computed {router.cache_aware_computed} vs {router.round_robin_computed}; "
     "balance is a threshold to tune"),
    ("attention sinks + window (`{streaming.cmd}`, {streaming.model}, a stream of "
     "{streaming.stream})",
     "KV bounded at {streaming.held} tokens: {streaming.bytes} vs {streaming.whole_bytes} "
     "for the whole stream",
     "re-rotating the kept keys when the window slides: {streaming.rerotated} key vectors "
     "per token",
     "mean loss {streaming.sinks} (sinks + window) vs {streaming.window} (window only) and "
     "{streaming.dense} (dense recompute)"),
    ("prefill/decode disaggregation, 1 + 1 ranks (`{disagg.cmd}`)",
     "no decode step waits for a prefill ({disagg.delayed} decode tokens delayed vs "
     "{disagg.delayed_colocated} in two colocated engines)",
     "the prompt's KV point-to-point: {disagg.kv} ({disagg.kv_measured} = the formula's "
     "{disagg.kv_formula})",
     "a fixed prefill:decode split; outputs = one engine's {disagg.same}"),
    ("speculative sampling, draft model (`{spec.cmd}`)",
     "none; adds the drafter and its KV cache",
     "γ sequential drafter passes + one (γ+1)-token target pass per step",
     "{spec.draft_speedup} at T = 0 (α at T = 1: {spec.draft_alpha_t1}); a second model"),
    ("draft tree (width 3)", "none", "the tree's tokens in one verification",
     "FLOPs on dead branches; {spec.tree_speedup} at T = 0"),
    ("Medusa heads", "none; adds heads (the drafters: {spec.drafters} in all)",
     "one batched head matmul per step",
     "α falls with depth ({spec.medusa_alpha_t1} at T = 1); {spec.medusa_speedup} at T = 0"),
    ("EAGLE-style drafter", "none; adds a one-block drafter + a KV cache",
     "γ one-block passes per step",
     "sequential drafting; {spec.eagle_speedup} at T = 0 (α {spec.eagle_alpha_t1} at T = 1)"),
    ("DFlash-style block drafter", "none; adds a block drafter",
     "one pass per step whatever γ",
     "α {spec.dflash_alpha_t1} at T = 1: {spec.dflash_speedup} at T = 0"),
    ("RTN int8 per output row (`{quantize.cmd}`)",
     "linears 32 → {quantize.int8_bits} bits/weight; model {quantize.fp32_bytes} → "
     "{quantize.int8_bytes}",
     "a dequantization per matmul: decode ×{quantize.int8_decode}",
     "Δ loss {quantize.int8_dloss}, top-1 = fp32's {quantize.int8_top1}"),
    ("RTN int4 / int3, groups of 32",
     "{quantize.int4_bits} / {quantize.int3_bits} bits/weight; {quantize.int4_bytes} / "
     "{quantize.int3_bytes}",
     "unpack + dequantize per matmul: decode ×{quantize.int4_decode} / "
     "×{quantize.int3_decode}",
     "Δ loss {quantize.int4_dloss} / {quantize.int3_dloss}; top-1 {quantize.int4_top1} / "
     "{quantize.int3_top1}"),
    ("GPTQ int3 (the authors' block-start group fit)", "as RTN",
     "calibration forwards, a Hessian + Cholesky per layer",
     "Δ loss {quantize.gptq3_dloss} vs RTN's {quantize.int3_dloss}; top-1 "
     "{quantize.gptq3_top1}, greedy agreement {quantize.gptq3_greedy}"),
    ("AWQ int3 (llm-awq's module-output search)", "as RTN",
     "1 calibration forward + a 20-point α grid",
     "Δ loss {quantize.awq3_dloss}; top-1 {quantize.awq3_top1}"),
    ("SmoothQuant W8A8", "int8 weights, per-token int8 activations",
     "activation quantization per matmul: decode ×{quantize.sq_decode}",
     "Δ loss {quantize.sq_dloss}, greedy agreement {quantize.sq_greedy}"),
    ("pruning 50% unstructured / 2:4 (magnitude; Wanda)",
     "nothing as stored (dense here)", "Wanda: calibration forwards",
     "Δ loss {quantize.mag50_dloss} / {quantize.mag24_dloss} (magnitude), "
     "{quantize.wanda50_dloss} / {quantize.wanda24_dloss} (Wanda)"),
    ("PPO, critic + GAE (`{rl.cmd}`)",
     "– (+{rl.critic_state} critic state: {rl.critic})",
     "critic forward/backward: {rl.ppo_vs_grpo}× GRPO's step",
     "most knobs; held-out greedy {rl.ppo_held_out}"),
    ("GRPO", "the critic; keeps a frozen reference",
     "G samples per prompt, a reference forward per batch",
     "{rl.grpo_zero_var} of groups had equal rewards: sampled for nothing; held-out "
     "{rl.grpo_held_out}"),
    ("Dr. GRPO", "as GRPO", "as GRPO: {rl.drgrpo_vs_grpo}× its step",
     "advantage scale follows the reward scale (no std division); held-out "
     "{rl.drgrpo_held_out}"),
    ("on-policy distillation", "no reward model, no critic; a frozen teacher",
     "student sampling + a teacher forward on every sampled token: {rl.distill_vs_grpo}× "
     "GRPO's step",
     "noisy sampled-token signal; needs the teacher's tokenizer; held-out "
     "{rl.distill_held_out}"),
    ("soft-label / sequence-level KD", "no sampling / cheapest step",
     "teacher forward (full-vocabulary KL) / teacher generation: {rl.softkd_vs_grpo}× / "
     "{rl.seqkd_vs_grpo}× GRPO's step",
     "exposure bias; held-out {rl.softkd_held_out} / {rl.seqkd_held_out}"),
    ("bits/byte instead of perplexity (`{ppl.cmd}`)",
     "—", "one forward over the text; the bootstrap only resamples",
     "none: comparable across tokenizers (perplexity {ppl.ppl} = {ppl.bpb} bits/byte, "
     "loss {ppl.loss} nats/token here)"),
    ("log-likelihood ranking (`{task.cmd}`)",
     "the prompt's K/V computed once and copied to each candidate ({task.cached_s} vs "
     "{task.rerun_s})",
     "one teacher-forced pass per candidate, no sampling",
     "measures preference among given answers: {task.rank} vs {task.gen} generative exact "
     "match"),
    ("temperature scaling (`{calibration.cmd}`)",
     "—", "one scalar fitted on a dev split: T = {calibration.T}",
     "fixes one global scale: sequence ECE {calibration.seq_before} → "
     "{calibration.seq_after}, first-token ECE {calibration.first_before} → "
     "{calibration.first_after}; accuracy unchanged"),
    ("quality rules, Gopher/Codex/StarCoder (`{curate.cmd}`)",
     "removes {curate.rules}",
     "per-document features",
     "written for web prose, they drop clean code"),
]


# ----------------------------------------------------------------------------------------
# Running them

def shell_words(command):
    """The README's words -> what this interpreter runs: `python` is sys.executable (a
    venv works), `torchrun` is `python -m torch.distributed.run`, `X.py` is the repo's."""
    out = []
    for word in command.split():
        if word == "python":
            word = sys.executable
        elif word == "torchrun":
            out += [sys.executable, "-m", "torch.distributed.run"]
            continue
        elif word.endswith(".py") and os.path.exists(os.path.join(ROOT, word)):
            word = os.path.join(ROOT, word)
        out.append(word)
    return out


def run_one(run, quick, workdir, timeout):
    """-> (status, output, seconds). The command runs in workdir (its out/ is there), the
    repo first on the import path (python -m scripts.X finds the repo's)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(shell_words(run.quick if quick else run.command),
                           cwd=workdir, env=env, capture_output=True, text=True,
                           timeout=timeout)
        status, output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        status, output = 124, f"timed out after {timeout} s\n{e.stdout or ''}"
    return status, output, time.perf_counter() - t0


def read_figures(run, output):
    """{name: figure as printed, or None where the output lacks it}."""
    got = {}
    for name, read in run.figures.items():
        try:
            got[name] = read(output)
        except (ValueError, IndexError):
            got[name] = None
    return got


def fill(template, results):
    """Replace {run.figure} by the figure; a missing one by MISSING. -> (text, missing)."""
    missing = []

    def one(m):
        run, figure = m.group(1), m.group(2)
        r = results.get(run)
        if figure == "cmd":              # the command as the README writes it
            return RUN_BY_NAME[run].command
        value = r["figures"].get(figure) if r else None
        if value is None:
            missing.append(f"{run}.{figure}" + ("" if r else " (not run)"))
            return MISSING
        return value
    text = re.sub(r"\{(\w+)\.(\w+)\}", one, template)
    return text, missing


RUN_BY_NAME = {r.name: r for r in RUNS}


def provenance(quick, seconds):
    """Date, machine and commit: what a reader needs to trust or distrust a row."""
    import torch        # only for its version: nothing here computes with it
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        commit = (commit + (" + uncommitted changes" if dirty else "")) or "no git"
    except OSError:
        commit = "no git"
    device = "CUDA " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (f"Measured by `python reproduce.py{' --quick' if quick else ''}` on "
            f"{datetime.date.today().isoformat()}: {platform.platform()}, "
            f"{os.cpu_count()} CPU cores, {device}, Python {platform.python_version()}, "
            f"torch {torch.__version__}; commit {commit}; {fmt_duration(seconds)} in all.")


def write_table(path, results, quick, seconds):
    """The Markdown page. -> [(row, missing figures)] for the rows with a gap."""
    gaps, lines = [], []
    for technique, *cells in ROWS:
        filled = [fill(t, results) for t in (technique, *cells)]
        missing = [m for _, ms in filled for m in ms]
        if missing:
            gaps.append((filled[0][0], missing))
        lines.append("| " + " | ".join(text.replace("|", "\\|") for text, _ in filled) + " |")
    with open(path, "w") as f:
        f.write("# The trade-off table\n\n"
                "Generated by `python reproduce.py` (do not edit by hand: rerun it). One row "
                "per technique: what it saves, what it adds, what it costs; every number is "
                "read from the output of the command named in the row. Memory and byte "
                "figures are exact; times are rough (read the ratios). The topic pages have "
                "the full tables. Back to the [README](../README.md).\n\n")
        f.write(provenance(quick, seconds) + "\n\n")
        f.write("| technique (command) | memory saved | communication / compute added | "
                "what it costs |\n|---|---|---|---|\n")
        f.write("\n".join(lines) + "\n")
        if gaps:
            f.write(f"\n{MISSING} marks a figure the command did not print this time "
                    "(its run failed or its output changed): " +
                    "; ".join(f"{row}: {', '.join(m)}" for row, m in gaps) + ".\n")
    return gaps


# ----------------------------------------------------------------------------------------
# The command line

def parse_args(argv=None):
    p = ArgumentParser(description="Run every topic's headline command (README sizes, or "
                       "tiny ones with --quick) and write the trade-off table from what "
                       "they print, with the date, machine and commit.",
                       formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: every command runs in seconds (a smoke test of the "
                   "table's wiring; its figures mean nothing)")
    p.add_argument("--only", default="", help="comma list of run names (--list shows "
                   "them); their rows fill, the rest say which runs were not run")
    p.add_argument("--out", default=None,
                   help=f"the table to write (default: {os.path.relpath(TABLE, ROOT)}; "
                   f"with --quick: {os.path.relpath(QUICK_TABLE, ROOT)}, so a smoke test "
                   "never overwrites the measured table)")
    p.add_argument("--workdir", default=None, help="where the commands run (their out/ "
                   "is WORKDIR/out); default: out/reproduce, or a temporary folder with "
                   "--quick (removed afterwards unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the --quick workdir")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds one command may take")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time (default: 1, so that timings are not contended; "
                   "2 with --quick, whose timings mean nothing)")
    p.add_argument("--list", action="store_true", help="print the runs and exit")
    return p.parse_args(argv)


def chosen_runs(only):
    if not only:
        return RUNS
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUN_BY_NAME]
    if unknown:
        raise UserError(f"--only: no run named {', '.join(unknown)} (runs: "
                        f"{', '.join(RUN_BY_NAME)})")
    wanted = set(names)
    for name in names:                       # what they need runs first
        wanted |= set(RUN_BY_NAME[name].needs)
    return [r for r in RUNS if r.name in wanted]


def run_all(runs, args, workdir, results, t0, after_each):
    """Every run, up to --jobs at a time, each once the runs it needs have finished; a line
    as each starts and ends (which run, elapsed, figures read, what is missing), and
    after_each() once its figures are in (the table is rewritten: an interrupted
    reproduction keeps what it measured)."""
    pending, running, done = list(runs), {}, 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        while pending or running:
            for run in [r for r in pending if all(n in results for n in r.needs
                                                   if n in RUN_BY_NAME)]:
                if len(running) == args.jobs:
                    break
                pending.remove(run)
                print(f"[{fmt_duration(time.perf_counter() - t0)}] start {run.name}: "
                      f"{run.quick if args.quick else run.command}", flush=True)
                running[pool.submit(run_one, run, args.quick, workdir, args.timeout)] = run
            finished, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                run = running.pop(future)
                done += 1
                report(run, *future.result(), results, f"{done}/{len(runs)}", t0)
                after_each()


def report(run, status, output, seconds, results, count, t0):
    """Read the figures of a finished run into results, and say how it went."""
    figures = read_figures(run, output)
    results[run.name] = {"status": status, "figures": figures, "seconds": seconds}
    failed = [n for n in run.needs if results.get(n, {}).get("status")]
    lost = [n for n, v in figures.items() if v is None]
    note = (f"exit {status}" + (f" (it needs {', '.join(failed)}, which failed)"
                                if failed else "") if status else
            f"{len(figures) - len(lost)}/{len(figures)} figures")
    print(f"[{fmt_duration(time.perf_counter() - t0)}] {count} {run.name}: {note} in "
          f"{fmt_duration(seconds)}" + (f"; missing: {', '.join(lost)}" if lost else ""),
          flush=True)
    if status:
        print("    " + "\n    ".join(output.strip().splitlines()[-8:]), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for r in RUNS:
            rows = sum(f"{{{r.name}." in "".join(row) for row in ROWS)
            print(f"{r.name:<12} {rows:>2} row(s)  {r.command}")
        return None
    runs = chosen_runs(args.only)
    args.jobs = args.jobs or (2 if args.quick else 1)
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    workdir = args.workdir or (tempfile.mkdtemp(prefix="nanoscale-reproduce-") if args.quick
                               else os.path.join(ROOT, "out", "reproduce"))
    os.makedirs(workdir, exist_ok=True)
    out = args.out or (QUICK_TABLE if args.quick else TABLE)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results, t0 = {}, time.perf_counter()
    try:
        def write():
            return write_table(out, results, args.quick, time.perf_counter() - t0)
        run_all(runs, args, workdir, results, t0, write)
        gaps = write()
    finally:
        if args.quick and not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {out}: {len(ROWS)} rows, {len(gaps)} with a missing figure "
          f"({fmt_duration(time.perf_counter() - t0)})")
    return {"results": results, "gaps": gaps, "out": out}


if __name__ == "__main__":
    run_cli(main)
