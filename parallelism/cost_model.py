"""
parallelism/cost_model.py -- the step-time and dollar model: seconds, MFU, GPU-hours and $ from
a handful of machine constants, each one either fitted on the machine (scripts/cost_check.py
times this repo's own collectives and matmuls) or read off a data sheet.

  communication  the α–β model (Hockney 1994: t = α + n/β per message) with the textbook ring
                 factors (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007), fitted by
                 least squares from timings;
  compute        FLOPs per token 6Ψ + 12·L·h·s (Kaplan et al. 2020; PaLM's MFU definition,
                 Chowdhery et al. 2022, appendix B), + one forward when activations are
                 recomputed, over an achieved fraction of the matmul peak;
  pipeline       the bubble (p−1)/(m+p−1) (GPipe, 1F1B), ÷ v interleaved, DualPipe's;
  overlap        which communication runs under compute: what THIS repo's code overlaps
                 (repo_overlap) or what a published system says it overlaps;
  serving        the decode roofline: a step reads every weight and the context's K/V and
                 does 2 FLOPs per weight per token: time = max(bytes / HBM, FLOPs / peak);
                 tokens/s per GPU and $ per million output tokens at a GPU price.

What the model leaves out, and so what a gap to a measured or published figure means:
non-matmul kernels (norms, softmax, the optimizer step) and the matmuls' shape-dependent
efficiency (one fraction of peak for all), the MoE routing and permutation, load imbalance,
stragglers, failures and restarts, checkpointing, and link contention between dimensions.

Arithmetic only: no process group, no torch. parallelism/planner.py prices its layouts with
it (`python parallel.py plan --gpu H100`, and `--published` for Llama 3 405B and
DeepSeek-V3); `python -m parallelism.cost_model` prints the GPUs and the serving table.
"""
import sys
from dataclasses import dataclass, replace

import numpy as np

from core.cli import command_line, fmt_bytes, knob
from core.errors import UserError


# ----------------------------------------------------------------------------------------
# Communication: α–β per collective

# (latency steps, bandwidth factor) of each collective over p ranks, ring algorithms. The
# factor multiplies the PAYLOAD AS core/meters.py's CommMeter records it (the buffer handed
# to the collective), so a measured ledger row prices directly:
#   all_reduce      2(p−1) steps; reduce-scatter then all-gather: 2(p−1)/p · n
#   reduce_scatter  (p−1) steps; each rank sends (p−1)/p of the n-byte input
#   all_gather      (p−1) steps; textbook (p−1)/p · n of the OUTPUT n = p · payload, so
#                   (p−1) · payload (CommMeter records the input shard)
#   all_to_all      (p−1) steps (pairwise exchange); (p−1)/p of the input leaves the rank
#   broadcast       pipelined ring (what NCCL runs): the message cut in chunks flows down a
#                   chain, (p−1) hops of latency and n/β of bandwidth once the pipe is full
#                   (Chan et al. 2007 §5; a binomial tree would be log2(p)·(α + n/β))
#   send            one message: α + n/β;   recv: 0 -- the matching send prices the pair
def ring_factors(op, p):
    """(latency steps, bandwidth factor per payload byte) of one call of `op` over p ranks."""
    if p < 1:
        raise UserError(f"a {op} needs at least 1 rank, got {p}")
    table = {"all_reduce": (2 * (p - 1), 2 * (p - 1) / p),
             "reduce_scatter": (p - 1, (p - 1) / p),
             "all_gather": (p - 1, p - 1),
             "all_to_all": (p - 1, (p - 1) / p),
             "broadcast": (p - 1, 1.0 if p > 1 else 0.0),
             "send": (1, 1.0), "recv": (0, 0.0)}
    if op not in table:
        raise UserError(f"unknown collective {op!r}: choose one of {', '.join(table)}")
    return table[op]


@dataclass(frozen=True)
class Link:
    """Hockney's two constants of one link: α seconds per message (start-up), β bytes per
    second (one direction: what a ring uses; NVLink's data-sheet 900 GB/s is both
    directions together, 450 GB/s each)."""
    alpha: float
    beta: float


def collective_seconds(op, nbytes, p, link):
    """One call of `op` over p ranks with nbytes of payload (CommMeter's): steps·α +
    factor·nbytes/β."""
    steps, factor = ring_factors(op, p)
    return steps * link.alpha + factor * nbytes / link.beta


def fit_link(samples):
    """Fit α and β from timings: samples = [(op, nbytes, p, seconds), ...] (one link). Each
    is one linear equation t = steps·α + factor·n·(1/β); least squares on the RELATIVE
    error (each row ÷ its t), since the timings span orders of magnitude and plain least
    squares would let the largest messages decide α too. -> (Link, relative residuals:
    predicted/measured − 1 per sample)."""
    rows, times = [], []
    for op, nbytes, p, seconds in samples:
        if not seconds > 0:
            raise UserError(f"a timing must be positive seconds, got {seconds} ({op}, {nbytes} B)")
        steps, factor = ring_factors(op, p)
        rows.append((steps, factor * nbytes))
        times.append(seconds)
    a, t = np.array(rows, dtype=np.float64), np.array(times, dtype=np.float64)
    if len(samples) < 2 or np.linalg.matrix_rank(a / t[:, None]) < 2:
        raise UserError("the timings cannot separate α from β: time at least two message "
                        "sizes (and not only recv, which costs nothing on its own)")
    (alpha, inv_beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    if not inv_beta > 0:
        raise UserError(f"the fit gives a bandwidth β ≤ 0 (1/β = {inv_beta:.3g} s/B): the time "
                        "does not grow with the size; time larger messages")
    if alpha < 0:
        raise UserError(f"the fit gives a latency α < 0 ({alpha:.3g} s): time smaller messages "
                        "(or more repeats: the small ones are noisy)")
    link = Link(float(alpha), float(1 / inv_beta))
    return link, a @ np.array([alpha, inv_beta]) / t - 1


def comm_seconds(rows, links, sizes):
    """Price a CommMeter table (core/meters.py: rows of (op, group, calls, payload, wire)):
    links = {group: Link}, sizes = {group: ranks}. Per row: calls·steps·α + factor·payload/β
    (payload is the sum over the calls; the ring factors are linear in it). recv rows cost
    nothing: the send prices the pair. -> {(op, group): seconds}."""
    out = {}
    for op, group, calls, payload, _wire in rows:
        if group not in links or group not in sizes:
            raise UserError(f"no link or size given for group {group!r} ({op})")
        steps, factor = ring_factors(op, sizes[group])
        out[(op, group)] = (calls * steps * links[group].alpha
                            + factor * payload / links[group].beta)
    return out


# ----------------------------------------------------------------------------------------
# Compute: FLOPs per token, recomputation, the pipeline bubble

def dense_params(n_layer, n_embd, n_head, n_kv_head, ffn, vocab):
    """A Llama-shaped dense model (model.py's GPT, untied), by kind: 'matmul' (wq wk wv wo,
    w1 w2 w3 of every layer and the output head: the weights that multiply activations,
    the Ψ of 6Ψ), 'embedding' (a lookup: no FLOPs), 'norms' (2 per layer + the final)."""
    kv = n_kv_head * (n_embd // n_head)
    layer = 2 * n_embd * n_embd + 2 * n_embd * kv + 3 * n_embd * ffn
    return dict(matmul=n_layer * layer + vocab * n_embd, embedding=vocab * n_embd,
                norms=(2 * n_layer + 1) * n_embd)


RECOMPUTE = ("none", "selective", "full")


def train_flops_per_token(n_params, n_layer, n_embd, seq, recompute="none", attn_dim=None):
    """FLOPs one training token costs the hardware. n_params: the matmul parameters one
    token touches (MoE: the active ones; not the embedding lookup). Per weight 2 FLOPs
    forward and 4 backward (dX and dW): 6Ψ. Attention's QKᵀ and AV add 2·s·d each per layer
    forward, 12·L·d·s with backward (PaLM appendix B: causal masking not subtracted);
    attn_dim = d, the width of the heads (default n_embd; MLA: the mean of its query-key
    and value widths). Recomputation runs forward again: 'full' a whole forward (+2Ψ +
    4·L·d·s: 8Ψ instead of 6Ψ), 'selective' only the attention scores (+4·L·d·s;
    Korthikanti et al. 2022). MFU counts recompute='none' (PaLM: model FLOPs, not hardware
    FLOPs)."""
    if recompute not in RECOMPUTE:
        raise UserError(f"unknown recompute {recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    attn = 2 * n_layer * (attn_dim or n_embd) * seq    # one of attention's 2 matmuls, forward
    extra = {"none": 0, "selective": 2 * attn, "full": 2 * n_params + 2 * attn}[recompute]
    return 6 * n_params + 6 * attn + extra


def bubble_fraction(p, m, schedule="1f1b", virtual=1):
    """Idle fraction of a pipeline step with p stages and m microbatches.
    1F1B and GPipe (Huang et al. 2019; Narayanan et al. 2021): every stage idles p−1
    forward+backward slots of the m+p−1: (p−1)/(m+p−1). Interleaved 1F1B with v stages per
    GPU: each slot is 1/v as long, (p−1)/(v·m+p−1). DualPipe (DeepSeek-V3 §3.2.1, the DualPipe
    README): idle (p/2−1)(F&B + B − 3W) against m(F+B) of work, taken at F = W = 1, B = 2
    (the backward is twice the forward, half of it weight gradients) and F&B = F + B (no
    credit for the overlap itself, as parallelism/pipeline.py's theory_bubble)."""
    if p < 1 or m < 1 or virtual < 1:
        raise UserError(f"a pipeline needs p, m, v ≥ 1, got p={p}, m={m}, v={virtual}")
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (virtual * m + p - 1)
    if schedule == "dualpipe":
        idle = max(p / 2 - 1, 0) * ((1 + 2) + 2 - 3 * 1)
        return idle / (idle + m * (1 + 2))
    raise UserError(f"unknown schedule {schedule!r}: choose 1f1b, gpipe or dualpipe")


# ----------------------------------------------------------------------------------------
# GPUs: data-sheet constants

@dataclass(frozen=True)
class Gpu:
    """A GPU as the cost model sees it: two roofs (matmul FLOP/s, HBM bytes/s), two links,
    the node size, the price; scripts/cost_check.py builds one from this machine's rates."""
    name: str
    peak_flops: float       # dense bf16 tensor-core FLOP/s (no sparsity)
    hbm_bw: float           # bytes/s
    nvlink_bw: float        # bytes/s, the data sheet's: both directions together
    ib_bw: float            # bytes/s per GPU, one direction (InfiniBand NDR 400 Gb/s = 50 GB/s)
    gpus_per_node: int
    price_per_hour: float   # $ per GPU-hour
    memory: float = 80e9    # bytes of HBM (decimal)


# NVIDIA data sheets (H100 / H200 Tensor Core GPU, A100 80GB; H800 as H100 with NVLink cut
# to 400 GB/s, the figure DeepSeek-V3's report works with). The peaks equal core/meters.py's
# GPU_PEAK_BF16_FLOPS (tested), kept here so the arithmetic imports no torch. Price: the
# $2 per GPU-hour DeepSeek-V3 prices its H800s at (§1) for every GPU -- a stated default,
# not a quote: pass your own (--price).
GPUS = {
    "H100": Gpu("H100", 989e12, 3.35e12, 900e9, 50e9, 8, 2.0, 80e9),
    "H800": Gpu("H800", 989e12, 3.35e12, 400e9, 50e9, 8, 2.0, 80e9),
    "H200": Gpu("H200", 989e12, 4.8e12, 900e9, 50e9, 8, 2.0, 141e9),
    "A100": Gpu("A100", 312e12, 2.039e12, 600e9, 25e9, 8, 2.0, 80e9),   # IB HDR 200 Gb/s
}
# Per-message start-up latency: no data sheet gives it. A labelled assumption of the order
# NCCL shows (a few µs per ring step); on this machine scripts/cost_check.py fits it.
ALPHA = {"nvlink": 2e-6, "ib": 5e-6}
# The achieved fraction of the matmul peak: a large bf16 GEMM on an H100 runs at roughly
# 0.7-0.8 of the data-sheet peak in vendor and public cuBLAS benchmarks. 0.75 is a
# clearly-labelled assumption, the middle of that range, NOT fitted to any run below; on
# this machine it is measured (scripts/cost_check.py).
GEMM_EFFICIENCY = 0.75


def check_price(price):
    """A price per GPU-hour, or the one-line UserError every caller shares."""
    if not price > 0:
        raise UserError(f"a price must be positive $ per GPU-hour, got {price}")
    return price


def gpu(name, price=None):
    """The data sheet of GPU `name` (any case), at `price` $/GPU-hour if given."""
    key = str(name).upper()
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[key] if price is None else replace(GPUS[key], price_per_hour=check_price(price))


def link_of(g, scope):
    """The Link a group uses: 'nvlink' inside a node (half the data sheet's two-way figure),
    'ib' across nodes (the per-GPU InfiniBand rate)."""
    if scope == "nvlink":
        return Link(ALPHA["nvlink"], g.nvlink_bw / 2)
    return Link(ALPHA["ib"], g.ib_bw)


# ----------------------------------------------------------------------------------------
# One training step: compute + what communication stays exposed + the bubble

@dataclass
class StepWork:
    """One GPU's share of one optimizer step."""
    flops: float            # model FLOPs (recompute='none'): MFU's numerator
    hw_flops: float         # FLOPs it runs (with recompute)
    bubble: float           # idle fraction of the pipelined part (bubble_fraction)
    comm: dict              # dimension -> seconds alone on its link ("TP", "DP", ...)
    hidden: dict            # dimension -> fraction of the compute its communication runs
    #                         under (0: exposed; 1: as long as the whole compute)
    outside: tuple = ("DP",)    # dimensions paid once per step, after the pipeline drains


@dataclass
class StepPrediction:
    """Where one step's seconds go, and the MFU they give."""
    compute: float          # seconds of matmul work
    exposed: dict           # dimension -> seconds of communication not hidden
    bubble: float           # the pipeline's idle fraction (StepWork's)
    step: float             # seconds per optimizer step
    mfu: float              # model FLOPs / (step · peak)
    flops_per_s: float      # achieved model FLOP/s per GPU


def predict_step(work, g, efficiency=GEMM_EFFICIENCY):
    """Step seconds and MFU of `work` on GPU g running its matmuls at `efficiency` of peak.
    Communication runs under compute up to the compute it overlaps: exposed = max(0,
    comm − hidden·compute). Inside the pipeline (every dimension but `outside`) compute and
    exposed communication are stretched by the bubble, ÷ (1 − bubble): a stage idles that
    fraction of the step whatever it does when busy; DP's gradient exchange comes after."""
    if not 0 < efficiency <= 1:
        raise UserError(f"the matmul efficiency must be in (0, 1], got {efficiency}")
    compute = work.hw_flops / (g.peak_flops * efficiency)
    exposed = {d: max(0.0, s - work.hidden.get(d, 0.0) * compute) for d, s in work.comm.items()}
    inside = sum(s for d, s in exposed.items() if d not in work.outside)
    step = (compute + inside) / (1 - work.bubble) + sum(
        s for d, s in exposed.items() if d in work.outside)
    return StepPrediction(compute, exposed, work.bubble, step,
                          work.flops / (step * g.peak_flops), work.flops / step)


def repo_overlap(dp_mode, m, attention_share):
    """What this repo's code runs under compute, dimension by dimension -> StepWork.hidden:
    DP  ddp: training/data_parallel.py's DDP all-reduces each gradient bucket with
        async_op=True while backward goes on, but only on the last micro-step (set_sync):
        hidden under that micro-step's backward, 2/3 of 1/m of the compute.
        zero1-3: every reduce-scatter and all-gather is blocking and ZeRO-3 gathers a unit
        just in time (no prefetch): exposed. fsdp (PyTorch's fully_shard) prefetches the
        next unit's gather and reduce-scatters asynchronously: hidden under all of it.
    CP  parallelism/ring_attention.py posts the next K/V block before computing the current
        one: hidden under the attention's share of the compute.
    TP, PP, EP: blocking collectives inside autograd Functions (tensor_parallel.py), a
        receive waited for at its slot (pipeline.py's Exchange), a blocking all_to_all
        (parallel.py's MoE): exposed."""
    dp = {"ddp": 2 / 3 / m, "fsdp": 1.0}.get(dp_mode, 0.0)
    return {"DP": dp, "CP": attention_share, "TP": 0.0, "PP": 0.0, "EP": 0.0}


@dataclass
class RunCost:
    """A whole training run at a predicted step time."""
    steps: float
    gpu_hours: float
    dollars: float


def run_cost(step_seconds, gpus, tokens_per_step, tokens_total, price_per_hour):
    """Steps = tokens / tokens per step; GPU-hours = step · steps · GPUs / 3600; $ = GPU-hours
    · price."""
    if not tokens_total > 0:
        raise UserError(f"a run needs a positive number of tokens, got {tokens_total}")
    check_price(price_per_hour)
    steps = tokens_total / tokens_per_step
    hours = step_seconds * steps * gpus / 3600
    return RunCost(steps, hours, hours * price_per_hour)


# ----------------------------------------------------------------------------------------
# Serving: the decode roofline in dollars

@dataclass(frozen=True)
class ServeShape:
    """A dense Llama-shaped model as the decode roofline needs it."""
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab: int
    weight_bytes: float = 2     # bf16
    kv_bytes: float = 2         # bf16 cache


# Llama 2 7B (Touvron et al. 2023: 32 layers, 4096 wide, 32 heads, full MHA), Llama 3 70B
# (Llama 3 paper, Table 3: 80 layers, 8192 wide, 64 heads, 8 KV heads, ffn 28672, vocab
# 128256), and the demo model (model.py's "small" preset: tested equal), served in fp32
# as serve.py runs it on a CPU: 4 bytes per weight and per cached K/V value.
SERVE_SHAPES = {
    "7B": ServeShape("Llama-2 7B", 32, 4096, 32, 32, 11008, 32000),
    "70B": ServeShape("Llama-3 70B", 80, 8192, 64, 8, 28672, 128256),
    "demo": ServeShape("demo (small)", 6, 192, 6, 2, 512, 4096, weight_bytes=4, kv_bytes=4),
}


def shape_from_config(cfg, name="model"):
    """A ServeShape from a model.GPTConfig (dense; duck-typed: no torch import here)."""
    return ServeShape(name, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.ffn_dim,
                      cfg.vocab_size)


def kv_bytes_per_token(s):
    """K and V of every layer: 2 · L · kv heads · head dim · bytes (GQA stores only the KV heads)."""
    return 2 * s.n_layer * s.n_kv_head * (s.n_embd // s.n_head) * s.kv_bytes


@dataclass
class ServeRow:
    """One decode step's roofline and what it costs."""
    shape: str
    batch: int
    context: int
    tp: int                 # GPUs one replica spans (the least power of two it fits)
    bytes: float            # read per decode step, all GPUs of the replica
    flops: float            # per decode step
    step: float             # seconds
    bound: str              # "memory" or "compute"
    tok_s_per_gpu: float
    usd_per_mtok: float


def serving_cost(s, g, batch, context, usable=0.9):
    """One decode step of `batch` sequences with `context` tokens cached each, on the least
    TP degree (power of two ≤ a node) whose memory holds the weights and the KV cache in
    `usable` of it (the rest: activations, CUDA context, fragmentation). The roofline
    (Williams et al. 2009; scripts/serve_bench.py measures the same two roofs):
      bytes = weights (all but the embedding table, read once for the whole batch)
              + batch · context · KV bytes per token;
      FLOPs = 2 · weights · batch + 4 · L · d · context · batch (QKᵀ and AV);
      time  = max(bytes / (tp · HBM), FLOPs / (tp · peak)), the GPUs splitting both.
    tokens/s per GPU = batch / time / tp; $ per million output tokens = price / 3600 /
    (tokens/s per GPU) · 1e6. An upper bound: a real engine reaches a fraction of it."""
    if batch < 1 or context < 0:
        raise UserError(f"batch must be ≥ 1 and context ≥ 0, got {batch}, {context}")
    counts = dense_params(s.n_layer, s.n_embd, s.n_head, s.n_kv_head, s.ffn, s.vocab)
    weights = counts["matmul"] + counts["norms"]
    moved = weights * s.weight_bytes + batch * context * kv_bytes_per_token(s)
    tp = 1
    while moved > usable * tp * g.memory:
        tp *= 2
        if tp > g.gpus_per_node:
            raise UserError(f"{s.name} at batch {batch} × {context} tokens needs "
                            f"{fmt_bytes(moved)}: more than a node of {g.name}")
    flops = 2 * weights * batch + 4 * s.n_layer * s.n_embd * context * batch
    t_mem, t_flop = moved / (tp * g.hbm_bw), flops / (tp * g.peak_flops)
    step = max(t_mem, t_flop)
    per_gpu = batch / step / tp
    return ServeRow(s.name, batch, context, tp, moved, flops, step,
                    "memory" if t_mem >= t_flop else "compute", per_gpu,
                    g.price_per_hour / 3600 / per_gpu * 1e6)


def measured_gpu(flops, bandwidth, price, memory=16e9, name="this machine"):
    """A Gpu made of a machine's measured matmul FLOP/s and copy bandwidth (what
    scripts/serve_bench.py's roofline and scripts/cost_check.py measure): serving_cost on
    the demo model with its own numbers."""
    if not flops > 0 or not bandwidth > 0:
        raise UserError(f"measured FLOP/s and bandwidth must be positive, got {flops}, "
                        f"{bandwidth}")
    return Gpu(name, flops, bandwidth, bandwidth, bandwidth, 1, check_price(price), memory)


def serving_table(rows, g):
    """The rows as text, one line each."""
    out = [f"decode roofline on {g.name} ({g.hbm_bw / 1e9:,.0f} GB/s, "
           f"{g.peak_flops / 1e12:.3g} TFLOP/s) at ${g.price_per_hour:.2f}/GPU-hour:",
           f"  {'shape':<14}{'batch':>6}{'ctx':>6}{'tp':>4}{'read/step':>11}{'ms/step':>9}"
           f"  {'bound':<8}{'tok/s/GPU':>10}{'$/M tok':>9}"]
    for r in rows:
        out.append(f"  {r.shape:<14}{r.batch:>6}{r.context:>6}{r.tp:>4}{fmt_bytes(r.bytes):>11}"
                   f"{r.step * 1e3:>9.2f}  {r.bound:<8}{r.tok_s_per_gpu:>10,.0f}"
                   f"{r.usd_per_mtok:>9.3f}")
    return out


# ----------------------------------------------------------------------------------------
# `python -m parallelism.cost_model`: the constants and the serving table

KNOBS = [
    knob("--gpu", "H100", f"GPU of the serving table, one of {', '.join(GPUS)} (default H100)"),
    knob("--price", float, "$ per GPU-hour (not given: the GPU table's $2)"),
    knob("--batch", "1,16,64,256", "decode batch sizes, comma-separated (default 1,16,64,256)"),
    knob("--context", 2048, "tokens cached per sequence at the decode step (default 2048)"),
    knob("--demo-flops", float, "this machine's measured matmul FLOP/s, for the demo model's "
         "row (not given: no demo row; scripts/serve_bench.py prints it)"),
    knob("--demo-bandwidth", float, "this machine's measured copy bandwidth, bytes/s (not "
         "given: no demo row)"),
]


def gpu_lines():
    out = ["GPUs (data sheets; NVLink both directions, a ring uses half; IB per GPU):",
           f"  {'name':<6}{'bf16 TFLOP/s':>13}{'HBM TB/s':>9}{'NVLink GB/s':>12}{'IB GB/s':>8}"
           f"{'memory':>8}{'$/h':>6}"]
    for g in GPUS.values():
        out.append(f"  {g.name:<6}{g.peak_flops / 1e12:>13.0f}{g.hbm_bw / 1e12:>9.2f}"
                   f"{g.nvlink_bw / 1e9:>12.0f}{g.ib_bw / 1e9:>8.0f}{g.memory / 1e9:>6.0f}GB"
                   f"{g.price_per_hour:>6.2f}")
    out.append(f"assumed: α {ALPHA['nvlink'] * 1e6:g} µs NVLink, {ALPHA['ib'] * 1e6:g} µs IB "
               f"per ring step; matmuls at {GEMM_EFFICIENCY} of peak (labelled, not fitted)")
    return out


def main(argv=None):
    args = command_line("The step-time and dollar model's constants and the decode "
                        "roofline in dollars (published training runs: `python parallel.py "
                        "plan --published`).", {None: KNOBS},
                        prog="python -m parallelism.cost_model").parse_args(argv)
    g = gpu(args.gpu, args.price)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise UserError(f"--batch takes integers separated by commas, got {args.batch!r}") \
            from None
    rows = [serving_cost(SERVE_SHAPES[k], g, b, args.context) for k in ("7B", "70B")
            for b in batches]
    lines = gpu_lines() + [""] + serving_table(rows, g)
    # the demo model on this machine's own two roofs (its context capped at the 256-token
    # block of model.py's small preset), at the same price per hour
    if args.demo_flops is not None and args.demo_bandwidth is not None:
        here = measured_gpu(args.demo_flops, args.demo_bandwidth, g.price_per_hour)
        demo = [serving_cost(SERVE_SHAPES["demo"], here, b, min(args.context, 256))
                for b in batches]
        lines += [""] + serving_table(demo, here)
    print("\n".join(lines))


if __name__ == "__main__":
    try:                        # run_cli's one `error:` line (core/runtime.py), without torch
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
