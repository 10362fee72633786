"""
scripts/cost_check.py -- the step-time model (parallelism/cost_model.py) fitted on THIS
machine and checked against this repo's own training runs:

    python -m scripts.cost_check calibrate        # ~45 s: α, β, FLOP/s, η -> JSON
    python -m scripts.cost_check table            # ~4 minutes: predicted vs measured

calibrate  launches real torchrun jobs (gloo, 2 and 4 ranks) that time every collective the
           repo calls, through core/meters.py's own wrappers, over a sweep of message sizes,
           and fits Hockney's t = steps·α + factor·n/β (cost_model.fit_link) per world
           size, or per (size, collective) where the residuals say gloo's collectives
           differ; it times the matmuls of the model's linears (forward and both backward
           products, fp32, one thread per process as torchrun gives each rank) with 1, 2
           and 4 processes at once -- on 2 cores, 4 ranks share them, and other jobs take
           their cut: one core's rate is what the sharing leaves over -- and a whole
           forward+backward of the models the table trains, whose FLOP/s over
           the matmul rate is η: the share a step's FLOPs keep once the non-matmul kernels
           (norms, softmax, RoPE, SiLU, cross-entropy) take their time, which 6Ψ counts as
           zero FLOPs; and the AdamW update, seconds per parameter held.
table      runs train.py --dp {ddp, zero1, zero2, zero3, fsdp} and parallel.py --tp, --cp,
           --pp (1F1B), --ep for a few steps at 2 and 4 ranks, reads each run's own step
           times and communication ledger from what it prints, and predicts its step:
           compute (FLOPs per rank ÷ one core's matmul rate × the share of a core each
           rank had ÷ η) + the AdamW update + every ledger row priced by the fitted α–β + the pipeline bubble, with
           cost_model.predict_step. Each row: measured (median, min-max), predicted, their
           ratio, and the terms, so a miss names the term that is wrong.

What it costs: five minutes of a quiet machine. What it cannot fully do: see through a
loaded one. The CPU other processes use during each job is measured (cpu_clock) and
taken out of the share of a core each rank gets, but only as an average over the job;
both commands print the load average's warning (core/runtime.py's TimingConditions).

An entry point in scripts/ (nothing imports it); it imports the topics' parts to build
their ledgers and the cost model to price them, and launches train.py and parallel.py as a
user would.
"""
import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from core.cli import (add_knobs, ArgumentParser, fmt_bytes, HelpFormatter, knob,
                      require_at_least_one)
from core.distributed import setup_runtime
from core.errors import UserError
from core.meters import comm
from core.runtime import run_cli, TimingConditions
from model import GPT, get_config
from parallelism import cost_model, pipeline
from reproduction.readers import number    # a printed "15.7 MB" read back as 15.7e6
from training import data_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("out", "cost", "calibration.json")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
# 4 KB ... 16 MB by factors of 4: the repo's messages span this range (a tp all-reduce of
# 8×64 activations is 393 KB, a DDP bucket 1 MB, the whole gradient 10-16 MB)
DEFAULT_SIZES = ",".join(str(4096 * 4 ** i) for i in range(7))
BATCH, SEQ = 8, 64          # every table run: 8 sequences of 64 tokens (see MODES)

# The models the table trains, by --size. "small" is the demo preset cut to 4 layers with
# 8 heads / 4 KV heads, so that --tp 4 (whole KV heads) and --pp 4 (whole layers) divide
# it; "moe" is the MoE preset as it is (4 layers, 8 experts, top-2). "tiny" is for tests.
MODELS = {"small": {"dense": dict(preset="small", n_layer=4, n_head=8, n_kv_head=4),
                    "moe": dict(preset="moe")},
          "tiny": {"dense": dict(preset="tiny"),
                   "moe": dict(preset="tiny", n_expert=4)}}


# ----------------------------------------------------------------------------------------
# 1. Measuring, inside one torchrun job (the hidden `_measure` subcommand, every rank)

def payload_tensors(op, nbytes, p):
    """(input, output) of one `op` call on buffers of about nbytes, fp32, divisible by p.
    Its PAYLOAD, as CommMeter records it and cost_model.ring_factors prices it, is the
    input: for an all-gather the shard, nbytes/p (its output is the nbytes)."""
    # n elements, a multiple of p: the shards of a reduce-scatter and an all-gather are
    # then equal, as ZeRO's padded flat buffers make them (training/data_parallel.py)
    n = max(p, nbytes // 4 // p * p)
    if op == "all_gather":            # the sweep's size is the largest buffer: the output
        return torch.ones(n // p), torch.empty(n)
    if op == "reduce_scatter":
        return torch.ones(n), torch.empty(n // p)
    # all-reduce and broadcast work in place; the all-to-all and the receive need a
    # buffer of their own, as large as what is sent
    return torch.ones(n), torch.empty(n)


def call(op, x, out, rank):
    """One collective through core/meters.py's wrappers: the very calls train.py and
    parallel.py make. send: rank 0 -> rank 1 by batch_isend_irecv, as pipeline.py and
    ring_attention.py send (the other ranks wait at the next barrier)."""
    # The meter's bookkeeping (a dict update per call) is timed too, on purpose: the
    # training steps pay it on every call, and it is part of what α stands for here.
    collective = {"all_reduce": lambda: comm.all_reduce(x),
                  "reduce_scatter": lambda: comm.reduce_scatter_tensor(out, x),
                  "all_gather": lambda: comm.all_gather_into_tensor(out, x),
                  "all_to_all": lambda: comm.all_to_all_single(out, x),
                  "broadcast": lambda: comm.broadcast(x, src=0)}.get(op)
    if collective is not None:
        collective()
    elif rank in (0, 1):
        peer = 1 - rank
        kind = dist.isend if rank == 0 else dist.irecv
        for work in comm.batch_isend_irecv([dist.P2POp(kind, x if rank == 0 else out, peer)]):
            work.wait()


def time_call(op, x, out, rank):
    """Seconds of one call as the slowest rank saw it: all ranks leave a barrier, each
    times its call, and the max over ranks is kept (one more all-reduce, not timed). The
    barrier's own skew between ranks (tens of µs) lands in α."""
    # The max, not rank 0's clock: a collective is over when its last rank is done. The
    # barrier and the max's all-reduce are plain torch.distributed: the meter skips them.
    dist.barrier()
    t0 = time.perf_counter()
    call(op, x, out, rank)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def sweep(sizes, repeats, rank, p):
    """Every (op, size) timed `repeats` times after one warm-up call. The repeats go round
    the whole grid, not one cell at a time, so a burst of load from elsewhere lands on many
    cells once rather than on one cell every time; the median of each cell is kept.
    -> [(op, payload bytes, p, seconds)]."""
    cells = []
    for nbytes in sizes:
        for op in OPS:
            # buffers allocated once and kept: an allocation in the call would be timed
            x, out = payload_tensors(op, nbytes, p)
            # warm-up: gloo's first call on a size sets up its pairs and buffers
            call(op, x, out, rank)
            cells.append((op, x.numel() * 4, x, out, []))
    for _ in range(repeats):
        for op, _, x, out, seen in cells:
            seen.append(time_call(op, x, out, rank))
    return [(op, n, p, statistics.median(seen)) for op, n, _, _, seen in cells]


def matmul_rate(mats, sets=3):
    """FLOP/s of this process running the model's matmuls (`mats`: an X, W, dY per Linear,
    X with as many rows as a forward has tokens): per Linear the forward X·W and the
    backward's dX = dY·Wᵀ and dW = Xᵀ·dY, 2·M·K·N FLOPs each (the 6Ψ of training: per
    weight 2 forward + 4 backward). Every process of the job runs it at the same time:
    with more processes than cores, this is the per-rank rate a training step gets."""
    # The three products of each Linear, in the order a step runs them: forward, then
    # backward's input gradient and weight gradient (which reads X again: cache misses
    # a real step pays too). Results dropped: only the time counts.
    t0 = time.perf_counter()
    for _ in range(sets):
        for x, w, dy in mats:
            x @ w
            dy @ w.T
            x.T @ dy
    flops = sets * sum(6 * x.shape[0] * w.shape[0] * w.shape[1] for x, w, _ in mats)
    return flops / (time.perf_counter() - t0)


def adamw_seconds_per_param(cfg, repeats=3):
    """Seconds per parameter of what the optimizer side of a step does to every parameter
    a rank holds: global-norm clipping (clip_grad_norm_) and AdamW's update (torch's, the
    one train.py and parallel.py use). Elementwise, memory-bound: 6Ψ counts none of it."""
    # The model's own tensor shapes: AdamW's foreach kernels work tensor by tensor, so a
    # few large tensors and many small ones cost differently per parameter.
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(cfg, seed=None).parameters()]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    seen = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if i:                                     # the first builds Adam's state
            seen.append(time.perf_counter() - t0)
    return statistics.median(seen) / sum(p.numel() for p in params)


BATCHES = (1, 2, 4, 8)       # sequences per forward: the table's runs go down to 1 (pp 4)


def compute_rates(cfg, rounds=3):
    """The matmul rate at BATCH×SEQ rows and the whole model's forward+backward on b×SEQ
    tokens for each b of BATCHES -- the rows every matmul of that forward has: a pipeline
    microbatch or a context-parallel shard has fewer than a whole batch, and the per-call
    work that does not shrink with the rows (dispatch, the autograd graph, Python) weighs
    more. The two alternate, round after round, and η (model FLOP/s ÷ matmul FLOP/s) is
    taken within each round: a machine whose load drifts moves both alike. Medians over
    the rounds. -> {"matmul", "flops_per_token", "seconds": {tokens}, "eta": {tokens}}."""
    model = GPT(cfg, seed=0)

    def forward_backward(x):       # seconds of one step's compute; gradients dropped after
        t0 = time.perf_counter()
        model(x, x)[1].backward()
        seconds = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return seconds
    fpt = cost_model.train_flops_per_token(       # active matmul weights; MoE: top-k
        model.num_params(non_embedding=True, active=True), cfg.n_layer, cfg.n_embd, SEQ)
    # (in, out) of every Linear one token's forward meets in a block, and the head: the
    # repo's matmul shapes at this model (wq wk wv wo, w1 w3 w2 -- one expert's when the
    # FFN is a mixture -- and the output head), with a whole batch's rows
    d, kv, f = cfg.n_embd, cfg.n_kv_head * (cfg.n_embd // cfg.n_head), cfg.ffn_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d), (d, cfg.vocab_size)]
    mats = [(torch.randn(BATCH * SEQ, k), torch.randn(k, n), torch.randn(BATCH * SEQ, n))
            for k, n in shapes]
    inputs = {b * SEQ: torch.randint(0, cfg.vocab_size, (b, SEQ)) for b in BATCHES}
    matmul_rate(mats, 1)                          # warm-up: allocator, kernel choice
    for x in inputs.values():
        forward_backward(x)
    seen = {"matmul": [], **{t: [] for t in inputs}}
    for _ in range(rounds):
        seen["matmul"].append(matmul_rate(mats))
        for t, x in inputs.items():
            seen[t].append(forward_backward(x))
    eta = {str(t): statistics.median(fpt * t / s / r for s, r in zip(seen[t], seen["matmul"]))
           for t in inputs}
    return {"matmul": statistics.median(seen["matmul"]), "flops_per_token": fpt,
            "seconds": {str(t): statistics.median(seen[t]) for t in inputs}, "eta": eta}


def measure(args):
    """`_measure`, on every rank of one job (or alone): the compute rates with all of the
    job's processes busy at once, then (2 ranks or more) the collective sweep. Rank 0
    writes what every rank saw to --out as JSON."""
    torch.set_num_threads(1)     # one thread per rank: what torchrun gives each process
    # setup_runtime: the process group every script joins (gloo on CPU), with its hang
    # detection; alone (no torchrun), a world of one and no group
    with setup_runtime("cpu") as rt:
        sync = dist.barrier if rt.distributed else (lambda: None)
        result = {"p": rt.world_size, "model": {}}
        for name, settings in MODELS[args.size].items():
            sync()                  # every rank computes at once: the cores are shared
            result["model"][name] = compute_rates(get_config(**settings))
        sync()
        result["adamw"] = adamw_seconds_per_param(get_config(**MODELS[args.size]["dense"]))
        # Compute first, collectives after: the sweep's large buffers would otherwise
        # crowd the caches and the memory bandwidth the matmuls are timed with.
        mine = [result]
        if rt.distributed:
            mine = [None] * rt.world_size
            dist.all_gather_object(mine, result)          # bookkeeping, outside the meter
            result["samples"] = sweep(args.sizes, args.repeats, rt.rank, rt.world_size)
        if rt.rank == 0:
            with open(args.out, "w") as f:
                json.dump({"ranks": mine, "samples": result.get("samples", [])}, f)


# ----------------------------------------------------------------------------------------
# 2. calibrate: the jobs, the fits, the JSON

def cpu_clock():
    """(wall seconds, CPU seconds the whole machine has been busy -- None off Linux --,
    CPU seconds of this process and of the children it has waited for: a torchrun job and
    every rank it ran). Two readings give what OTHER processes used in between."""
    try:                    # /proc/stat: user nice system idle iowait irq softirq steal ...
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = None
    ours = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    return time.perf_counter(), busy, ours


def others_between(start, end):
    """Cores the machine's other processes kept busy between two cpu_clock() readings (a
    virtual machine's steal time counts: a neighbour ran on our core)."""
    (t0, b0, o0), (t1, b1, o1) = start, end
    return 0.0 if b0 is None else max(0.0, (b1 - b0 - (o1 - o0)) / (t1 - t0))


def share(cal, busy, others):
    """Part of a core each of `busy` computing ranks gets on C cores while other processes
    USED `others` cores: shared fairly, d runnable others use d·C/(busy + d) = others, and
    each rank gets C/(busy + d) = (C − others)/busy, at most a whole core."""
    return min(1.0, max(cal["cores"] - others, 0.1) / busy)


def launch(nproc, argv, timeout=600):
    """`python -m scripts.cost_check ARGV` alone (nproc 1) or under torchrun with nproc
    ranks, as a user would start it: this interpreter, gloo on the loopback interface
    (a sandbox may offer gloo no other), one thread per process. -> its output; a
    failure is one line naming the job and its last line."""
    # OMP_NUM_THREADS=1 is torchrun's own default for several processes per node (it
    # warns and sets it); set here so a one-process run times one thread as well.
    # PYTHONPATH: the repo root, so `-m scripts.cost_check` resolves from any folder.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    lead = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={nproc}"]
    # A session of its own: a timeout kills torchrun AND the ranks it started.
    job = subprocess.Popen([sys.executable, *lead, *argv], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise UserError(f"timed out after {timeout} s: {' '.join(argv)} on {nproc} "
                        f"process(es)") from None
    # The printed lines are the interface (train.py and parallel.py write no JSON): the
    # step lines and the ledger are on stdout, rank 0's; torch's warnings go to stderr.
    if job.returncode:
        last = [x for x in (stdout + stderr).splitlines() if x.strip()][-1:] or ["(none)"]
        raise UserError(f"{' '.join(argv[:4])} on {nproc} process(es) failed (exit "
                        f"{job.returncode}): {last[0]}")
    return stdout


def measure_job(nproc, args, folder):
    """One `_measure` job on nproc processes -> the JSON rank 0 wrote. One process is
    this one (no process group, one thread: what the job would have been, less a start)."""
    out = os.path.join(folder, f"measure-{nproc}.json")
    argv = ["_measure", "--size", args.size, "--out", out,
            "--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats)]
    if nproc == 1:
        measure(parse_args(argv))
    else:
        launch(nproc, ["-m", "scripts.cost_check", *argv])
    with open(out) as f:
        return json.load(f)


def rates_of(job):
    """Per-rank figures of one job, averaged over its ranks (each ran the same work at the
    same time): per model the matmul FLOP/s and η at each token count; AdamW seconds per
    parameter."""
    # The mean: the ranks time-share the cores, and which one the scheduler favours
    # changes from call to call.
    ranks = job["ranks"]
    mean = lambda xs: sum(xs) / len(xs)
    models = {m: {"matmul": mean([r["model"][m]["matmul"] for r in ranks]),
                  "eta": {t: mean([r["model"][m]["eta"][t] for r in ranks])
                          for t in first["eta"]}}
              for m, first in ranks[0]["model"].items()}
    return {"model": models, "adamw": mean([r["adamw"] for r in ranks])}


def fit_links(samples):
    """Hockney's α and β fitted three ways (cost_model.fit_link, least squares on the
    relative error): one link for the whole machine, one per world size, and one per
    (world size, collective) -- gloo runs a different algorithm per collective, not all
    of them rings, and its per-op bandwidth tells which. -> {"machine": fit, "per_p":
    {p: fit}, "per_op": {p: {op: fit}}}, each fit {alpha, beta, residuals}."""
    def fit(rows):
        link, res = cost_model.fit_link([tuple(r) for r in rows])
        return {"alpha": link.alpha, "beta": link.beta, "residuals": [float(x) for x in res]}
    # One link for the machine assumes the ring factors explain the world size; per
    # world size it need not (4 processes on 2 cores: every ring step waits for a core,
    # so α grows); per collective it need not even explain the op (gloo's reduce-scatter
    # and all-gather are not bandwidth-optimal rings: their β comes out lower).
    fits = {"machine": fit(samples), "per_p": {}, "per_op": {}}
    for p in sorted({row[2] for row in samples}):
        rows = [row for row in samples if row[2] == p]
        fits["per_p"][str(p)] = fit(rows)
        fits["per_op"][str(p)] = {}
        for op in OPS:
            try:                  # a noisy op may fit α < 0: it keeps the per-p link
                fits["per_op"][str(p)][op] = fit([r for r in rows if r[0] == op])
            except UserError:
                continue
    return fits


def calibrate(args):
    """`calibrate`: one job per process count (1 alone: compute only; each of --ranks: the
    compute rates with that many processes sharing the cores, then the collectives), the
    fits, the printout, the JSON."""
    t0 = time.perf_counter()
    counts = sorted({1, *args.ranks})
    with TimingConditions() as conditions, tempfile.TemporaryDirectory() as folder:
        jobs, others = {}, {}
        for n in counts:
            print(f"measuring with {n} process{'es' if n > 1 else ''} ...", flush=True)
            start = cpu_clock()
            jobs[n] = measure_job(n, args, folder)
            others[str(n)] = others_between(start, cpu_clock())
    # Per process count (strings: JSON keys); 1 process measures the η the table uses.
    rates = {str(n): rates_of(job) for n, job in jobs.items()}
    # η: the model's whole forward+backward FLOP/s over the matmuls' alone, one process
    eta = {m: r["eta"] for m, r in rates["1"]["model"].items()}
    samples = [s for n in counts for s in jobs[n]["samples"]]
    cal = {"size": args.size, "batch": BATCH, "seq": SEQ, "cores": os.cpu_count(),
           "torch": torch.__version__, "load": conditions.loads, "rates": rates,
           "others": others, "eta": eta, "samples": samples, "fits": fit_links(samples),
           "seconds": time.perf_counter() - t0}
    # One core's rates: each job's per-rank rate ÷ the share of a core its ranks had
    # (its n ranks and the others measured beside them); the median over the jobs. That
    # the jobs agree on it is the check of the processor-sharing model itself.
    single = lambda get: statistics.median(get(r) / share(cal, int(n), others[n])
                                           for n, r in rates.items())
    cal["single"] = {**{m: single(lambda r: r["model"][m]["matmul"]) for m in eta},
                     "adamw": 1 / single(lambda r: 1 / r["adamw"])}
    cal["pricing"] = choose_pricing(cal["fits"])
    # with the load average's warning: others on the cores inflate every collective
    print("\n".join(calibration_lines(cal)))
    conditions.report(out=print)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
    print(f"saved {args.out} ({cal['seconds']:.0f} s); next: python -m scripts.cost_check "
          f"table" + ("" if args.out == DEFAULT_OUT else f" --calibration {args.out}"))
    return cal


def eta_at(cal, m, tokens):
    """η of model m at `tokens` rows per forward: interpolated in log(tokens) between the
    calibrated batch sizes (held at the ends)."""
    points = sorted((int(t), e) for t, e in cal["eta"][m].items())
    return float(np.interp(math.log(tokens), [math.log(t) for t, _ in points],
                           [e for _, e in points]))           # np.interp holds the ends


def abs_median(xs):
    """Median of |x|: the typical relative residual, robust to one noisy sample."""
    return statistics.median(abs(x) for x in xs) if xs else float("nan")


def choose_pricing(fits):
    """Which fit prices the table, by what the residuals support: the per-collective links
    when they cut the median relative residual of the per-world-size fit by more than a
    third (their extra constants then describe the machine, not the noise), else one link
    per world size. -> "per_op" or "per_p"."""
    res_p = [r for f in fits["per_p"].values() for r in f["residuals"]]
    res_op = [r for ops in fits["per_op"].values() for f in ops.values()
              for r in f["residuals"]]
    return "per_op" if abs_median(res_op) < abs_median(res_p) * 2 / 3 else "per_p"


def link_for(cal, op, p):
    """The Link that prices `op` over p ranks: the calibration's chosen fit at that world
    size (per collective when chosen and fitted)."""
    fits = cal["fits"]
    if str(p) not in fits["per_p"]:
        raise UserError(f"the calibration has no fit at {p} ranks (it has "
                        f"{', '.join(fits['per_p'])}): run `python -m scripts.cost_check "
                        f"calibrate --ranks {p}`")
    f = fits["per_p"][str(p)]
    if cal["pricing"] == "per_op" and op in fits["per_op"][str(p)]:
        f = fits["per_op"][str(p)][op]
    return cost_model.Link(f["alpha"], f["beta"])


def calibration_lines(cal):
    """The calibration as text: the compute rates, the three fits and every sample next
    to what the pricing fit says of it."""
    tokens, models = [str(b * cal["seq"]) for b in BATCHES], list(cal["eta"])
    out = [f"compute per rank (fp32, one thread per process, {cal['cores']} cores): the "
           f"matmuls' GFLOP/s at {cal['batch'] * cal['seq']} rows, η = the whole "
           f"forward+backward's FLOP/s (6Ψ + 12·L·d·s) on {', '.join(tokens)} tokens ÷ it",
           f"  {'procs':<6}{'others':>7}" + "".join(f"{m + ' matmul':>14}" + "".join(
               f"{'η@' + t:>7}" for t in tokens) for m in models) + f"{'AdamW':>13}"]
    for n, r in cal["rates"].items():
        out.append(f"  {n:<6}{cal['others'][n]:>7.1f}" + "".join(
            f"{r['model'][m]['matmul'] / 1e9:>14.1f}" + "".join(
                f"{r['model'][m]['eta'][t]:>7.2f}" for t in tokens) for m in models)
            + f"{r['adamw'] * 1e9:>8.2f} ns/Ψ")
    out.append("  others: cores kept busy by other processes during the job. One core, "
               "by processor sharing (each job's rate ÷ min(1, (cores − others)/procs)): "
               + ", ".join(f"{m} {cal['single'][m] / 1e9:.1f} GFLOP/s" for m in models)
               + f", AdamW {cal['single']['adamw'] * 1e9:.2f} ns/Ψ. The table uses η of "
               "1 process (2 and 4: a check)")
    fits = cal["fits"]
    fit_line = lambda label, f: (                 # α µs, β GB/s, median and worst |r|
        f"  {label:<22}{f['alpha'] * 1e6:>9.0f}{f['beta'] / 1e9:>9.2f}"
        f"{100 * abs_median(f['residuals']):>10.0f}%"
        f"{100 * max(abs(r) for r in f['residuals']):>9.0f}%")
    out += ["α–β fits (cost_model.fit_link; residual = fitted/measured − 1):",
            f"  {'fit':<22}{'α µs':>9}{'β GB/s':>9}{'median |r|':>11}{'max |r|':>10}",
            fit_line("one for the machine", fits["machine"])]
    out += [fit_line(f"N = {p}", f) for p, f in fits["per_p"].items()]
    out += [fit_line(f"N = {p} {op}", f) for p, ops in fits["per_op"].items()
            for op, f in ops.items()]
    chosen = "one link per (N, collective)" if cal["pricing"] == "per_op" else "one per N"
    out.append(f"pricing the table: {chosen} (per-collective links when they cut the "
               "median residual by a third); fitted/measured of each sample at sizes "
               + ", ".join(fmt_bytes(n) for n in sorted({s[1] for s in cal["samples"]
                                                         if s[0] == "all_reduce"})) + ":")
    for p in cal["fits"]["per_p"]:
        for op in OPS:
            rows = sorted((n, t) for o, n, q, t in cal["samples"] if o == op and str(q) == p)
            link = link_for(cal, op, int(p))
            out.append(f"  N = {p} {op:<15}" + "".join(
                f"{cost_model.collective_seconds(op, n, int(p), link) / t:>6.2f}" for n, t in rows))
    return out


# ----------------------------------------------------------------------------------------
# 3. table: the runs and what they print

WARMUP = 3      # steps not timed: the first builds Adam's state, the allocator warms up


@dataclass(frozen=True)
class Mode:
    script: str             # train.py or parallel.py
    model: str              # "dense" or "moe": a key of MODELS[--size]
    flags: tuple            # "{n}" stands for the world size


MODES = {**{dp: Mode("train.py", "dense", ("--dp", dp)) for dp in data_parallel.MODES},
         "tp": Mode("parallel.py", "dense", ("--tp", "{n}")),
         "cp": Mode("parallel.py", "dense", ("--cp", "{n}")),
         "pp": Mode("parallel.py", "dense", ("--pp", "{n}", "--schedule", "1f1b")),
         "ep": Mode("parallel.py", "moe", ("--ep", "{n}"))}


def run_argv(mode, n, size, steps):
    """The command line of one run, as a reader would type it after torchrun. train.py's
    batch is per rank (8×64 on every rank), parallel.py's is global (8×64 split by the
    layout). Nothing saved, sampled or evaluated but the one validation batch train.py
    runs after its last step (untimed); a log line every step."""
    m = MODES[mode]
    # {preset: small, n_layer: 4} -> --preset small --n-layer 4 (both scripts' flags)
    model = [f for k, v in MODELS[size][m.model].items()
             for f in (f"--{k.replace('_', '-')}", str(v))]
    argv = [os.path.join(ROOT, m.script), *(f.format(n=n) for f in m.flags), *model,
            "--batch-size", str(BATCH),
            "--seq-len", str(SEQ), "--steps", str(steps)]
    if m.script == "train.py":
        argv += ["--log-interval", "1", "--save-interval", "0", "--sample-tokens", "0",
                 "--eval-iters", "1", "--warmup-steps", "1"]
    return argv


SIZE = r"[\d.]+ [KMGT]?B"
# train.py:    step    4 | loss 8.0844 | lr 4.00e-04 | 5.2k tok/s | 786 ms | state ...
TRAIN_STEP = re.compile(r"^step\s+(\d+) \| loss \S+ \| lr \S+ \| \S+ tok/s \| (\d+) ms \|")
# its ledger:  0          15.7 MB     15.7 MB     31.5 MB     15.7 MB   (rank, ..., sent/step)
TRAIN_LEDGER = re.compile(rf"^  (\d+)\s+({SIZE})\s+({SIZE})\s+({SIZE})\s+({SIZE})$")
# parallel.py: step    3 | loss 8.1227 | grad norm 5.865 | lr 8.00e-04 | 2.6k tok/s | ...
PARALLEL_STEP = re.compile(r"^step\s+(\d+) \| loss \S+ \| grad norm \S+ \| lr \S+ \| "
                           r"([\d.]+)k tok/s \|.*?(?:per ep rank ([\d.]+))?$")
# its ledger:  tp     all_reduce         29     10.2 MB     10.2 MB      10.2 MB
PARALLEL_LEDGER = re.compile(rf"^  (\S+)\s+(\S+)\s+(\d+)\s+({SIZE})\s+(?:{SIZE}|-)"
                             rf"\s+({SIZE})$")
BUBBLE = re.compile(r"^mean bubble ([\d.]+)% measured vs ([\d.]+)% theory")


@dataclass
class Measured:
    """What one run printed: every step's seconds (warm-up included), rank 0's ledger per
    step [(op, group, calls, payload, wire)] (parallel.py) or each rank's bytes sent per
    step (train.py), the MoE per-ep-rank imbalance per step, the measured pipeline bubble."""
    seconds: list = field(default_factory=list)
    ledger: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    imbalance: list = field(default_factory=list)
    bubble: float = None
    others: float = 0.0     # cores other processes kept busy during the run (cpu_clock)


def parse_run(script, output):
    """Read a run's printed lines (its log lines and its ledger) -> Measured. train.py's
    lines carry the step's milliseconds; parallel.py's its tokens per second, of the
    global batch (BATCH×SEQ tokens), as X.Yk: seconds = tokens / (X.Y·1000)."""
    # parallel.py's tok/s has one decimal in thousands: at 2.5k, 2% of precision per
    # step. Its log line printing the step's milliseconds, as train.py's does
    # (`| {seconds * 1000:.0f} ms`), would make the parse exact.
    got, in_ledger = Measured(), False
    for line in output.splitlines():
        if script == "train.py":
            m = TRAIN_STEP.match(line)
            if m:
                got.seconds.append(int(m[2]) / 1e3)
            m = TRAIN_LEDGER.match(line)
            if m:
                got.sent.append(number(m[5]))
            continue
        m = PARALLEL_STEP.match(line)
        if m:
            got.seconds.append(BATCH * SEQ / (float(m[2]) * 1e3))
            if m[3]:
                got.imbalance.append(float(m[3]))
        in_ledger = in_ledger or line.startswith("ledger (")
        m = PARALLEL_LEDGER.match(line) if in_ledger else None
        if m:
            calls, payload, wire = int(m[3]), number(m[4]), number(m[5])
            got.ledger.append((m[2], m[1], calls, payload, wire))
        m = BUBBLE.match(line)
        if m:
            got.bubble = float(m[1]) / 100
    if not got.seconds:
        raise UserError(f"no step lines found in {script}'s output: has its log line "
                        f"changed? (scripts/cost_check.py parse_run reads it)")
    return got


# ----------------------------------------------------------------------------------------
# 4. table: what each mode computes and sends, by the code's own structure

def param_counts(cfg):
    """The model's parameters by role, from the model itself (meta tensors, no memory):
    dense[i] / experts[i] the matmul weights of layer i (router included in dense; all E
    experts), head (the output matrix and any extra heads), embedding, and the total."""
    # By name, as model.py calls them (Llama's names): layers.i.feed_forward.experts.j.*
    # are the routed experts; every other matrix of a layer, the router included, is
    # dense; outside the layers, a matrix is the head unless it is the embedding. Norm
    # gains (vectors) count in the total only: no matmul.
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    c = {"dense": [0] * cfg.n_layer, "experts": [0] * cfg.n_layer, "head": 0,
         "embedding": 0, "total": 0}
    for name, p in model.named_parameters():
        c["total"] += p.numel()
        if name.startswith("layers.") and p.dim() > 1:
            kind = "experts" if ".experts." in name else "dense"
            c[kind][int(name.split(".")[1])] += p.numel()
        elif name.startswith("tok_embeddings"):
            c["embedding"] += p.numel()
        elif p.dim() > 1:
            c["head"] += p.numel()
    return c


def flops_per_token(cfg, c, layers, head, expert_load=1.0):
    """Training FLOPs of one token through `layers` (and the head if asked): the active
    matmul weights (an MoE layer: top_k of its E experts, × expert_load for a rank that
    receives more than its share) into cost_model.train_flops_per_token."""
    # The embedding is a lookup (no FLOPs); norms are vectors (no matmul): both left out,
    # as 6Ψ leaves them (cost_model.dense_params' 'matmul' kind).
    active = sum(c["dense"][i] for i in layers)
    if cfg.n_expert:
        active += expert_load * cfg.expert_top_k / cfg.n_expert * sum(
            c["experts"][i] for i in layers)
    active += c["head"] if head else 0
    return cost_model.train_flops_per_token(active, len(layers), cfg.n_embd, SEQ)


@dataclass
class Work:
    """The busiest rank's share of one step."""
    flops: float            # hardware FLOPs of its forwards and backwards
    held: float             # parameters it clips and updates
    rows: int               # tokens per forward call: the matmuls' rows
    busy: float = 0.0       # ranks computing at once, on average: who shares the cores
    bubble: float = 0.0     # idle fraction of its pipeline
    theory: float = 0.0     # cost_model.bubble_fraction: the same with balanced stages
    idle: float = 0.0       # the ranks' mean idle fraction (pipeline.py measures it)


def rank_work(mode, n, cfg, measured):
    """What the busiest rank computes in one step of `mode` on n ranks -> Work."""
    c, L, tokens = param_counts(cfg), range(cfg.n_layer), BATCH * SEQ
    whole = flops_per_token(cfg, c, L, True)
    # held: what the optimizer steps on this rank -- all of it under ddp, a 1/n shard
    # under every ZeRO stage and FSDP (the update is where ZeRO-1 already saves time)
    if MODES[mode].script == "train.py":      # every rank: the whole model, its own batch
        return Work(whole * tokens, c["total"] / (1 if mode == "ddp" else n), tokens, n)
    if mode == "tp":    # Megatron: every matmul (head included) and attention split n ways
        return Work(whole * tokens / n, c["total"] / n, tokens, n)
    if mode == "cp":    # all weights, 1/n of each sequence (zigzag: balanced causal work)
        return Work(whole * tokens / n, c["total"], tokens // n, n)
    if mode == "ep":    # its share of the rows; experts: the busiest ep rank's rows
        load = statistics.mean(measured.imbalance[WARMUP:] or [1.0])
        held = c["total"] - sum(c["experts"]) * (1 - 1 / n)
        return Work(flops_per_token(cfg, c, L, True, load) * tokens / n, held, tokens // n,
                    n)
    # pp, 1F1B with M = 2n microbatches (parallel.py's default): stage s runs its layers
    # (the last also the head) on every microbatch. With stage times t_s the step's
    # critical path is Σ t_s (the first microbatch through every stage) + (M−1)·max t_s
    # (the rest through the slowest): balanced stages give (M+p−1)·t, the bubble
    # (p−1)/(M+p−1) of cost_model.bubble_fraction; an unbalanced one idles the others more.
    # Here the head (V×d, a third of the dense model's matmul weights) sits on the last
    # stage: that stage is the slowest, and the predicted bubble is below the balanced one.
    m = 2 * n
    stages = pipeline.split_layers(cfg.n_layer, n)
    per_mb = [flops_per_token(cfg, c, range(a, b), s == n - 1) * tokens / m
              for s, (a, b) in enumerate(stages)]
    path = sum(per_mb) + (m - 1) * max(per_mb)
    held = max(sum(c["dense"][a:b]) + (c["embedding"] if s == 0 else 0)
               + (c["head"] if s == n - 1 else 0) for s, (a, b) in enumerate(stages))
    # Stage s is busy m·t_s of the path: the faster stages idle most, and while they wait
    # they leave the cores to the busy ones -- Σ_s m·t_s / path ranks compute at once.
    busy = [m * t / path for t in per_mb]
    return Work(m * max(per_mb), held, tokens // m, sum(busy), 1 - max(busy),
                cost_model.bubble_fraction(n, m), 1 - sum(busy) / n)


def dp_ledger(mode, cfg, n):
    """train.py's collectives per step on rank 0, from the wrappers' own structure
    (training/data_parallel.py, built here on one process): train.py prints only the
    total it sent, not the rows. -> [(op, group, calls, payload, wire)]. fsdp: PyTorch's
    FSDP2 plan, which the meter cannot see: one group per block and the root (embedding,
    final norm, head); each gathered for forward and again for backward (reshard after
    forward), the root once (FSDP2 keeps the root's parameters through backward); one
    reduce-scatter each."""
    # Built on this process with world size n and rank 0: the constructors only lay out
    # buckets and shards (and register hooks that never fire here), no collective runs.
    model = GPT(cfg, seed=0)
    if mode == "ddp":
        ddp = data_parallel.DDP(model, n)                # --bucket-mb 1.0, its default
        grads = sum(p.numel() * 4 for b in ddp.buckets for p in b)
        return [("all_reduce", "world", len(ddp.buckets), grads, 2 * (n - 1) / n * grads)]
    if mode == "fsdp":
        groups = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
        groups.append(sum(p.numel() for p in model.parameters()) - sum(groups))
        gathers = [2] * len(model.layers) + [1]
    else:
        zero = data_parallel.ZeRO(model, int(mode[-1]), 0, n)
        groups = [u.shard_size * n for u in zero.units]
        gathers = [2 if mode == "zero3" else 1] * len(groups)
    # fp32 bytes; a reduce-scatter's payload is its whole input, an all-gather's its
    # shard (CommMeter's convention, which cost_model.ring_factors prices)
    full = sum(4 * math.ceil(g / n) * n for g in groups)
    shard = sum(k * 4 * math.ceil(g / n) for k, g in zip(gathers, groups))
    return [("reduce_scatter", "world", len(groups), full, (n - 1) / n * full),
            ("all_gather", "world", sum(gathers), shard, (n - 1) * shard),
            ("all_reduce", "world", 1, 4, 2 * (n - 1) / n * 4)]        # the global norm²


DIMENSION = {"tp": "TP", "cp": "CP", "pp": "PP", "ep": "EP"}


def price_ledger(rows, mode, n, cal):
    """Every ledger row priced with the calibration's link for its collective and world
    size (cost_model.comm_seconds, one row at a time since the link depends on the op):
    -> {dimension: seconds}, the data group's and the world's rows under "DP"."""
    dims = {}
    for op, group, calls, payload, wire in rows:
        # One dimension of size n: its group, the data group (dp·ep·cp ranks: n under cp
        # or ep) and the world hold n ranks; any other group one, and moves nothing.
        p = n if group in (mode, "world") or (group == "data" and mode in ("cp", "ep")) else 1
        if p < 2:
            continue
        # The link is the one fitted at the JOB's world size, whatever the group's: it
        # was timed with n processes sharing the cores, as the run shares them.
        seconds = cost_model.comm_seconds([(op, group, calls, payload, wire)],
                                          {group: link_for(cal, op, n)}, {group: p})
        dim = DIMENSION.get(group, "DP")
        dims[dim] = dims.get(dim, 0.0) + sum(seconds.values())
    return dims


# ----------------------------------------------------------------------------------------
# 5. table: the prediction next to the measurement

@dataclass
class Row:
    mode: str
    n: int
    measured: list          # seconds of each timed step
    compute: float          # forward+backward of the busiest rank (matmul rate, η)
    update: float           # clipping + AdamW over the parameters it holds
    comm: float             # every ledger row priced by α–β, none hidden (see predict)
    bubble: float           # the pipeline's idle time
    step: float             # predicted seconds per step
    note: str = ""

    @property
    def median(self):
        return statistics.median(self.measured)

    ratio = property(lambda self: self.step / self.median)      # predicted / measured


def predict(mode, n, measured, ledger, cal):
    """One row. cost_model.predict_step prices the busiest rank's FLOPs at one core's
    matmul rate times the share of a core each rank had (its computing ranks and the
    other processes measured during the run), at efficiency η (the model's
    forward+backward over its matmuls, one process), stretches it by the bubble and adds
    the communication. Nothing is hidden: DDP's bucket all-reduces and the ring
    attention's next K/V block are posted async (cost_model.repo_overlap says what the
    code overlaps), but gloo moves them with CPU threads, and with n ≥ the cores every
    core is already computing: the transfer waits for a core. The update (clipping +
    AdamW, memory-bound, not in 6Ψ) is added at its measured seconds per parameter."""
    # On 2 cores, 4 computing ranks each get half of one; a job of someone else's on
    # the machine takes its cut too -- the same machine term every rank of the run pays.
    m = MODES[mode]
    cfg = get_config(**MODELS[cal["size"]][m.model])
    w = rank_work(mode, n, cfg, measured)
    part = share(cal, w.busy, measured.others)      # of a core, per computing rank
    g = cost_model.Gpu(f"this CPU, {w.busy:.1f} busy ranks + {measured.others:.1f} others",
                       cal["single"][m.model] * part, 0.0, 0.0, 0.0, 1, 0.0)
    eta = min(1.0, eta_at(cal, m.model, w.rows))
    if mode == "tp":
        # Megatron splits the matmuls (and the attention, by heads) n ways, but the rest
        # of η's remainder -- norms, residual adds, the embedding, RoPE, the per-layer
        # bookkeeping -- runs on full-width activations on every tp rank. Time per FLOP
        # 1/η = 1 (matmul) + (1/η − 1) (the rest); with the FLOPs ÷ n and the rest not:
        # η_tp = 1 / (1 + n·(1/η − 1)). An assumption (softmax and SiLU do split), stated.
        eta = 1 / (1 + n * (1 / eta - 1))
    dims = price_ledger(ledger, mode, n, cal)
    pred = cost_model.predict_step(cost_model.StepWork(w.flops, w.flops, w.bubble, dims, {}),
                                   g, eta)
    update = w.held * cal["single"]["adamw"] / part
    comm_s = sum(pred.exposed.values())
    note = (f"{measured.others:.1f} cores busy elsewhere: {part:.2f} of a core per rank; "
            f"η {eta:.2f} at {w.rows} rows per forward")
    if mode == "pp":          # pipeline.py's "mean bubble": the ranks' mean idle share
        note += (f"; the slowest stage idles {100 * w.bubble:.0f}% (balanced stages: "
                 f"{100 * w.theory:.0f}%), {w.busy:.1f} ranks busy; the ranks' mean idle "
                 f"{100 * w.idle:.0f}% predicted" + (f", {100 * measured.bubble:.0f}% "
                 "measured" if measured.bubble is not None else ""))
    if mode == "ep" and measured.imbalance:
        load = statistics.mean(measured.imbalance[WARMUP:])
        note += f"; the busiest ep rank gets {load:.2f}× its share of expert rows"
    return Row(mode, n, measured.seconds[WARMUP:], pred.compute, update, comm_s,
               max(0.0, pred.step - pred.compute - comm_s), pred.step + update, note)


def run_mode(mode, n, args, cal):
    """Run one mode for real at n ranks; -> (Measured, the ledger it is priced from, a
    line checking that ledger against what the run's meter counted)."""
    # From the repo root's scripts, as `torchrun --standalone --nproc_per_node=n ...`,
    # in the caller's folder (nothing is written: no checkpoint, no sample, no plot).
    script, start = MODES[mode].script, cpu_clock()
    output = launch(n, run_argv(mode, n, cal["size"], args.steps))
    measured = parse_run(script, output)
    measured.others = others_between(start, cpu_clock())
    if len(measured.seconds) <= WARMUP:       # a run that stopped early: nothing to time
        raise UserError(f"{mode} at {n} ranks printed {len(measured.seconds)} step lines")
    if script == "parallel.py":
        return measured, measured.ledger, ""
    # train.py prints what it sent per step, in all, not by collective: the rows come
    # from the structure, and their wire bytes must equal what its meter counted. (A
    # `print0(comm.report())` in its final report would print the rows themselves.)
    cfg = get_config(**MODELS[cal["size"]]["dense"])
    rows = dp_ledger(mode, cfg, n)
    wire = sum(r[4] for r in rows)
    check = (f"sent/step by structure {fmt_bytes(wire)}, train.py's meter "
             f"{fmt_bytes(measured.sent[0]) if measured.sent else '?'}")
    check += " (FSDP2's own collectives are unmetered)" if mode == "fsdp" else ""
    return measured, rows, check


def diagnosis(row):
    """For a row off by more than 25%: the factor each term alone would need to close the
    gap, and the term that needs the smallest one named as the likeliest wrong (a term of
    a millisecond that would need ×50 is not where the time went)."""
    gap = row.median - row.step
    terms = dict(compute=row.compute, update=row.update, comm=row.comm, bubble=row.bubble)
    # only terms that exist and could absorb the gap (an over-prediction cannot be
    # closed by a term smaller than the excess)
    fixes = {k: (v + gap) / v for k, v in terms.items() if v > 1e-3 and v + gap > 0}
    if not fixes:
        return f"{row.mode} N={row.n}: no single term closes a {gap * 1e3:+.0f} ms gap"
    likeliest = min(fixes, key=lambda k: abs(math.log(fixes[k])))
    return (f"{row.mode} N={row.n}: {'under' if gap > 0 else 'over'}-predicted by "
            f"{abs(gap) * 1e3:.0f} ms = {likeliest} ×{fixes[likeliest]:.2f} (alone: "
            + ", ".join(f"{k} ×{f:.2f}" for k, f in fixes.items()) + ")")


def table_lines(rows):
    """The table: measured median (and the range of the timed steps), predicted, their
    ratio, and the predicted terms in seconds."""
    out = [f"{'mode':<7}{'N':>2}{'measured s/step':>17}{'(min-max)':>16}{'predicted':>11}"
           f"{'ratio':>7}{'compute':>9}{'update':>8}{'comm':>8}{'bubble':>8}"]
    for r in rows:
        out.append(f"{r.mode:<7}{r.n:>2}{r.median:>17.3f}"
                   f"{f'({min(r.measured):.3f}-{max(r.measured):.3f})':>16}{r.step:>11.3f}"
                   f"{r.ratio:>7.2f}{r.compute:>9.3f}{r.update:>8.3f}{r.comm:>8.3f}"
                   f"{r.bubble:>8.3f}")
    return out


def load_calibration(path):
    """The JSON `calibrate` wrote, or one line saying what to run instead."""
    if not os.path.exists(path):
        raise UserError(f"no calibration at {path}: run `python -m scripts.cost_check "
                        f"calibrate` first (or pass --calibration PATH)")
    try:
        with open(path) as f:
            cal = json.load(f)
        cal["fits"]["per_p"], cal["rates"], cal["eta"], cal["single"]   # what table() reads
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a calibration scripts/cost_check.py wrote "
                        f"({type(e).__name__}: {e}): calibrate again") from None
    return cal


def table(args):
    """`table`: every chosen mode at every chosen world size, run, parsed, predicted."""
    cal = load_calibration(args.calibration)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"unknown mode {', '.join(unknown) or '(none)'}: choose from "
                        f"{', '.join(MODES)}")
    if args.steps <= WARMUP:
        raise UserError(f"--steps must exceed the {WARMUP} warm-up steps, got {args.steps}")
    for n in args.ranks:
        link_for(cal, "all_reduce", n)            # a missing world size: said before any run
    t0, rows, checks = time.perf_counter(), [], []
    print(f"calibration {args.calibration} ({cal['size']} models); each run: {args.steps} "
          f"steps, the first {WARMUP} untimed", flush=True)
    # One run at a time: two at once would share the cores and time each other. The
    # load average before and after judges the machine (TimingConditions).
    with TimingConditions() as conditions:
        for mode in modes:
            for n in args.ranks:
                measured, ledger, check = run_mode(mode, n, args, cal)
                rows.append(predict(mode, n, measured, ledger, cal))
                r = rows[-1]
                checks.append(f"{mode} N={n}: " + "; ".join(x for x in (r.note, check) if x))
                print(f"  {mode} N={n}: measured {r.median:.3f} s, predicted {r.step:.3f} s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n".join(table_lines(rows) + checks))
    # the goal: every row within 25%; a row outside says which term would close it
    misses = [diagnosis(r) for r in rows if abs(r.ratio - 1) > 0.25]
    print(f"{len(rows) - len(misses)} of {len(rows)} rows within 25%" +
          ("" if not misses else ":\n  " + "\n  ".join(misses)))
    conditions.report({f"{r.mode} N={r.n}": r.measured for r in rows}, out=print)
    print(f"table: {time.perf_counter() - t0:.0f} s")
    return rows


# ----------------------------------------------------------------------------------------
# The command line

def int_list(text, what):
    """'2,4' -> [2, 4], or one line saying what was wrong."""
    try:                      # int("") raises too: an empty list is refused as well
        return [int(v) for v in str(text).split(",") if v.strip()] or [int("")]
    except ValueError:
        raise UserError(f"{what} takes integers separated by commas, got {text!r}") from None


# Each command's settings, stated once (core/cli.py's knob tables). `_measure`, the job
# `calibrate` starts on every rank, takes calibrate's: not a command for a reader.
CALIBRATE_KNOBS = [
    knob("--ranks", "2,4", "world sizes to time the collectives at"),
    knob("--sizes", DEFAULT_SIZES, "buffer bytes of the sweep, comma-separated (default 4 "
         "KB ... 16 MB by factors of 4; an all-gather's payload is its 1/N input)"),
    knob("--repeats", 7, "timed calls per (collective, size) after one warm-up; the "
         "median is kept"),
    knob("--out", DEFAULT_OUT, "where the JSON goes"),
    knob("--size", "small", "models whose compute is measured: the table's (small) or "
         "the tests' (tiny)", choices=sorted(MODELS))]
TABLE_KNOBS = [
    knob("--modes", ",".join(MODES), f"modes to run, comma-separated, from "
         f"{', '.join(MODES)}"),
    knob("--ranks", "2,4", "world sizes to run each mode at"),
    knob("--steps", 10, f"steps per run; the first {WARMUP} are warm-up, not timed"),
    knob("--calibration", DEFAULT_OUT, "the JSON `calibrate` wrote")]


def parse_args(argv):
    """The two commands and their flags (core/cli.py's ArgumentParser: a bad flag is one
    line), and the hidden `_measure`."""
    p = ArgumentParser(prog="python -m scripts.cost_check", formatter_class=HelpFormatter,
                       description="The step-time model (parallelism/cost_model.py) fitted "
                       "on this machine and checked against this repo's own runs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{calibrate,table}")
    for name, knobs, text in (
            ("calibrate", CALIBRATE_KNOBS, "time the collectives (2 and 4 ranks) and the "
             "matmuls (1, 2, 4 processes), fit α and β, save the constants as JSON (~45 s)"),
            ("table", TABLE_KNOBS, "run every mode at 2 and 4 ranks for a few steps; print "
             "predicted vs measured step time and the model's terms (~4 minutes)")):
        add_knobs(sub.add_parser(name, formatter_class=HelpFormatter, help=text,
                                 description=text), knobs)
    add_knobs(sub.add_parser("_measure"), CALIBRATE_KNOBS)
    args = p.parse_args(argv)
    args.ranks = int_list(args.ranks, "--ranks")
    if min(args.ranks) < 2:
        raise UserError(f"--ranks: world sizes of 2 or more, got {args.ranks}")
    if args.command != "table":
        args.sizes = int_list(args.sizes, "--sizes")
        require_at_least_one(args, ["repeats"])
    return args


def main(argv=None):
    """Dispatch; run_cli turns a UserError into one `error:` line and status 2."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "_measure":
        return measure(args)
    if args.command == "calibrate":
        return calibrate(args)
    return table(args)


if __name__ == "__main__":
    run_cli(main)
