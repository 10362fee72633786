"""
scripts/serve_bench.py -- measuring the engine: the same seeded workload through sequential
generate(), static batching (static_batch_generate, the baseline, here) and serve.py's
engine (FCFS and SLO-aware), in one run, each system timed by the same clock; then what
the engine's paging, preemption and prefix caching did with it. An entry point in
scripts/ built on serve.py (nothing imports it); the workloads are serving/workloads.py:

    python -m scripts.serve_bench --clock cpu --repeats 3      # 64 requests at once, CPU time
    python -m scripts.serve_bench --no-baselines --policy fcfs --num-blocks 160   # forced
    preemption
    python -m scripts.serve_bench --shared-prefix 64 --prompt-len 16:64           # prefix caching
    python -m scripts.serve_bench --workload agent --pool-sizes 48,96 --tiers none,host,file
    python -m scripts.serve_bench --workload mixed --long-len 160:224 --long-frac 0.25

What it teaches -- which part of a serving win comes from where -- in five tables:
  0. the machine's two roofs (copy bandwidth, matmul FLOP/s) and the workload;
  1. throughput, TTFT / TPOT / ITL percentiles and goodput (requests meeting their SLOs
     per second) per system, then whether each system's greedy outputs equal sequential
     generate() token for token (they must: batching changes the schedule, not the math);
  2. work and memory: token positions computed vs needed (static batching's padding is
     the most continuous batching can win; preemption's recompute and prefix-cache hits
     show up here), KV slots wasted by paging vs static reservation vs a contiguous
     full-context cache;
  3. the decode roofline: bytes read and FLOPs of the median decode step, its arithmetic
     intensity against the machine's ridge point (memory- or compute-bound);
  4. the rows of the README's trade-off table.
Two more workloads, each a function other files reuse: `mixed_workload` (long and short
prompts: prefill-decode interference) and `AgentSessions` + `run_sessions` (multi-turn
conversations that re-send their history: prefix reuse decides the cost). `--workload
agent` runs every --pool-sizes x --tiers engine on the same sessions and tables where the
prompt tokens came from (pool hit, second-tier reload, recomputed), bytes moved, TTFT.

What it costs: every system runs the whole workload (--repeats times; the fastest run is
kept, the least disturbed by other jobs), so a bench takes a few times the engine's own
time. The wall clock on a shared machine measures the neighbours too; --clock cpu times
this process's CPU only, fair on a loaded box but blind to waiting (arrivals must then be
all at once). Ratios measured in the same run are the result, never absolute timings.
"""
import argparse
import bisect
import copy
import math
import random
import statistics
import time

import torch

import serve
from kvcache import PagedKVCache
from model import KVCache
from core.cli import command_line, fmt_bytes, knob
from core.errors import UserError
from core.runtime import load_average, Progress, run_cli, TimingConditions
from serve import POLICIES, SamplingParams, engine_from_args
from serving import multi_lora, structured
from serving.workloads import AgentSessions, BenchRequest, length_range, mixed_workload


# ----------------------------------------------------------------------------------------
# The workload

def make_workload(args, cfg, eos_id):
    """Seeded: prompt and output lengths uniform in their ranges, prompt tokens random
    (never <|endoftext|>; an optional shared prefix in front, e.g. a system prompt),
    arrivals all at t=0 (--rate inf) or Poisson at --rate requests/s."""
    rng = random.Random(args.seed)
    plo, phi = length_range(args.prompt_len, "prompt-len")
    olo, ohi = length_range(args.output_len, "output-len")
    vocab = [t for t in range(cfg.vocab_size) if t != eos_id]
    shared = [rng.choice(vocab) for _ in range(args.shared_prefix)]
    reqs, t = [], 0.0
    for _ in range(args.num_requests):
        plen = len(shared) + rng.randint(plo, phi)
        olen = min(rng.randint(olo, ohi), cfg.block_size - plen)
        if olen < 1:
            raise UserError(f"prompts of up to {plen} tokens leave no room for output in the "
                            f"context of {cfg.block_size}: lower --prompt-len/--shared-prefix")
        prompt = shared + [rng.choice(vocab) for _ in range(plen - len(shared))]
        if args.rate != math.inf:
            t += rng.expovariate(args.rate)
        reqs.append(BenchRequest(prompt, olen, t, rng.random() < args.interactive_frac))
    return reqs


# ----------------------------------------------------------------------------------------
# The three systems, each fed the workload's arrivals and timed by the same clock

# The bench's clock, passed to every runner: wall time (time.perf_counter), or this
# process's CPU time (time.process_time, --clock cpu): on a machine shared with other jobs
# the wall clock measures the neighbours too; CPU time measures our work as if the core
# were ours (arrivals must then be all at once: CPU time does not pass while we sleep).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def clock_conditions(args):
    """The judge of the clock's times (core.meters): the load and the repeats' spread for
    the wall clock; the spread only for CPU time, which the neighbours do not run up."""
    return TimingConditions(reader=load_average if args.clock == "wall" else lambda: None)


def _wait_until(t, clock):
    delay = t - clock()
    if delay > 0:
        time.sleep(delay)


def run_sequential(model, reqs, clock=time.perf_counter):
    """The reference: model.generate() one request at a time, in arrival order. A forward
    hook timestamps every forward pass: pass i of generate() yields output token i."""
    stamps = []
    hook = model.register_forward_hook(lambda *_: stamps.append(clock()))
    t0, recs = clock(), []
    try:
        for r in reqs:
            _wait_until(t0 + r.arrival, clock)
            stamps.clear()
            out = model.generate(r.prompt, r.out_len, temperature=0)
            recs.append(dict(out=out, times=stamps[:len(out)], finish=stamps[len(out) - 1]))
    finally:
        hook.remove()
    return t0, recs


@torch.no_grad()
def static_batch_generate(model, prompts, max_new_tokens, on_step=None):
    """Greedy decoding of a batch of prompts of different lengths with the contiguous
    model.KVCache: prompts left-padded to the longest, pad keys masked out, each row with
    its own RoPE positions (so every row computes exactly what generate() would), all rows
    decoded for max_new_tokens steps. -> (B, max_new_tokens) list of lists."""
    dev = model.output.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    idx = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], device=dev)
    col = torch.arange(P, device=dev)
    positions = (col[None] - pad[:, None]).clamp(min=0)
    valid = col[None] >= pad[:, None]                                   # (B, P) real keys
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)
    cache = KVCache(model.config, B, P + max_new_tokens, device=dev,
                    dtype=model.output.weight.dtype)
    logits, _ = model(idx, positions=positions, mask=mask[:, None], cache=cache)
    out = []
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        if on_step:
            on_step()
        if step == max_new_tokens - 1:
            break
        valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
        logits, _ = model(nxt[:, None], positions=(P + step - pad)[:, None],
                          mask=valid[:, None, None, :], cache=cache)
    return torch.stack(out, 1).tolist()


def run_static(model, reqs, batch_size, clock=time.perf_counter):
    """Static batching: batches of batch_size in arrival order; a batch starts when its
    last request has arrived, is padded to its longest prompt, decodes until its longest
    output is done, and only then frees its slots for the next batch."""
    t0, recs = clock(), []
    reserved = used = computed = 0
    for i in range(0, len(reqs), batch_size):
        group = reqs[i:i + batch_size]
        _wait_until(t0 + max(r.arrival for r in group), clock)
        stamps = []
        n_max = max(r.out_len for r in group)
        outs = static_batch_generate(model, [r.prompt for r in group], n_max,
                                     on_step=lambda: stamps.append(clock()))
        end = clock()
        reserved += len(group) * (max(len(r.prompt) for r in group) + n_max)
        computed += len(group) * (max(len(r.prompt) for r in group) + n_max - 1)
        used += sum(len(r.prompt) + r.out_len for r in group)
        recs += [dict(out=o[:r.out_len], times=stamps[:r.out_len], finish=end)
                 for r, o in zip(group, outs)]
    return t0, recs, (used, reserved, computed)


def run_engine(model, enc, reqs, args, policy, clock=time.perf_counter):
    """The engine with arrivals injected as they happen (in-process, no HTTP)."""
    eng = engine_from_args(model, enc, args, policy, clock=clock)
    t0, pending, seqs = clock(), list(reqs), []
    while pending or eng.has_work():
        while pending and t0 + pending[0].arrival <= clock():
            r = pending.pop(0)
            seqs.append(eng.add_request(r.prompt, SamplingParams(
                max_tokens=r.out_len, temperature=0, ignore_eos=True,
                priority=0 if r.interactive else 1,
                ttft_slo=args.slo_ttft if r.interactive else args.slo_ttft_batch),
                arrival=t0 + r.arrival))
        if eng.has_work():
            eng.step()
        elif pending:
            _wait_until(t0 + pending[0].arrival, clock)
    recs = [dict(out=s.output_ids, times=s.token_times, finish=s.finish_time) for s in seqs]
    return t0, recs, eng


def run_sessions(eng, workload, clock=time.perf_counter):
    """Drive an engine through a turn-based workload (AgentSessions' interface): arrivals
    injected as they happen; when a turn finishes, its session's next turn is scheduled.
    -> (t0, [(request, its finished Sequence)] in finishing order)."""
    t0, done = clock(), []
    pending = sorted(workload.first_turns(), key=lambda r: r.arrival)
    active = {}                                   # sequence id -> its request
    while pending or eng.has_work():
        while pending and t0 + pending[0].arrival <= clock():
            r = pending.pop(0)
            seq = eng.add_request(r.prompt, SamplingParams(
                max_tokens=r.out_len, temperature=0, ignore_eos=True), arrival=t0 + r.arrival)
            active[seq.id] = r
        if not eng.has_work():
            _wait_until(t0 + pending[0].arrival, clock)
            continue
        for seq in eng.step():
            if seq.status != serve.FINISHED:
                continue
            r = active.pop(seq.id)
            done.append((r, seq))
            nxt = workload.next_turn(r, seq.output_ids, seq.finish_time - t0)
            if nxt is not None:
                bisect.insort(pending, nxt, key=lambda q: q.arrival)
    return t0, done


# ----------------------------------------------------------------------------------------
# Measuring: percentiles, goodput, the machine's roofs

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else math.nan


def summarize(t0, recs, reqs, args):
    """Throughput, TTFT / TPOT / ITL percentiles and goodput (requests meeting all their
    SLOs per second of the run), each request timed from its arrival."""
    ttft, tpot, itl, good = [], [], [], 0
    for r, rec in zip(reqs, recs):
        t = rec["times"]
        ttft.append(t[0] - (t0 + r.arrival))
        tp = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
        tpot.append(tp)
        itl += [b - a for a, b in zip(t, t[1:])]
        good += ttft[-1] <= (args.slo_ttft if r.interactive else args.slo_ttft_batch) \
            and tp <= args.slo_tpot
    wall = max(rec["finish"] for rec in recs) - t0
    return dict(wall=wall, tok_s=sum(len(rec["out"]) for rec in recs) / wall, ttft=ttft,
                tpot=tpot, itl=itl, good=good, goodput=good / wall,
                ttft_interactive=[x for x, r in zip(ttft, reqs) if r.interactive])


def measure_machine(device):
    """Copy bandwidth (read + write bytes / s of a 64 MB tensor copy) and dense matmul
    FLOP/s, best of 3: the two roofs of the roofline."""
    x, a = torch.randn(16 << 20, device=device), torch.randn(1024, 1024, device=device)
    y = torch.empty_like(x)                      # float(...) waits for the device
    copy = min(_timed(lambda: float(y.copy_(x)[0])) for _ in range(3))
    mm = min(_timed(lambda: float((a @ a)[0, 0])) for _ in range(3))
    return 2 * x.numel() * 4 / copy, 2 * 1024 ** 3 / mm


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ----------------------------------------------------------------------------------------
# The tables

def print_setup(args, model, reqs):
    """Table 0: the machine's two roofs and the workload. -> (bandwidth, FLOP/s)."""
    dev = model.output.weight.device
    bw, flops = measure_machine(dev)
    print(f"clock: {args.clock}; machine: {dev}, {torch.get_num_threads()} thread(s): copy "
          f"bandwidth {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.1f} GFLOP/s (best of 3)")
    n_int = sum(r.interactive for r in reqs)
    if args.workload == "mixed":
        print(f"mixed load: {len(reqs) - n_int} long prompts ({args.long_len} tokens, the batch "
              f"class) among {n_int} short ones ({args.prompt_len})")
    print(f"workload: {len(reqs)} requests, prompt {args.prompt_len} (+{args.shared_prefix} "
          f"shared) tokens, mean {statistics.mean(len(r.prompt) for r in reqs):.0f}; output "
          f"{args.output_len}, mean {statistics.mean(r.out_len for r in reqs):.0f}; arrivals "
          f"{'all at once' if args.rate == math.inf else f'Poisson {args.rate}/s'}; seed "
          f"{args.seed}")
    print(f"SLOs: {n_int} interactive (priority 0) TTFT <= {args.slo_ttft} s, "
          f"{len(reqs) - n_int} batch TTFT <= {args.slo_ttft_batch} s; all TPOT <= "
          f"{args.slo_tpot * 1e3:.0f} ms")
    return bw, flops


def run_systems(args, model, enc, reqs, clock):
    """Every system on the same workload, each --repeats times, the fastest run kept (the
    least disturbed by other jobs). -> rows [(name, summary)], outputs and extras by key."""
    rows, outs, extra = [], {}, {}
    policies = [args.policy] if args.policy else POLICIES
    # one line as each system starts: the sequential baseline alone takes minutes at the
    # default sizes, and the tables come only once every system has run
    progress = Progress("serve bench", (0 if args.no_baselines else 2) + len(policies),
                        every=0)

    def measure(name, key, run):
        progress.update(len(rows), now_on=name)
        best, walls = None, []
        for _ in range(args.repeats):
            t0, recs, *rest = run()
            s = summarize(t0, recs, reqs, args)
            walls.append(s["wall"])
            if best is None or s["wall"] < best[0]["wall"]:
                best = s, recs, rest
        # every repeat's wall time next to the best run's figures: their spread is judged
        rows.append((name, {**best[0], "walls": walls}))
        outs[key] = [rec["out"] for rec in best[1]]
        extra[key] = best[2][0] if best[2] else None

    if not args.no_baselines:
        measure("sequential generate()", "sequential", lambda: run_sequential(model, reqs, clock))
        measure(f"static batching B={args.static_batch}", "static",
                lambda: run_static(model, reqs, args.static_batch, clock))
    for policy in policies:
        measure(f"engine ({policy})", policy,
                lambda: run_engine(model, enc, reqs, args, policy, clock))
    return rows, outs, extra


def latency_table(rows, outs, reqs, args):
    """Table 1: throughput, TTFT / TPOT / ITL percentiles, goodput; then exactness."""
    base = rows[0][1]["tok_s"]
    print(f"\n{'system':<24}{'wall s':>7}{'out tok/s':>10}{'speedup':>8}  "
          f"{'TTFT p50/p90/p99 s':>18}  {'p90 inter':>10}  {'TPOT p50/p99 ms':>15}  "
          f"{'ITL p50/p99 ms':>14}  goodput req/s")
    for name, s in rows:
        q = {k: [pct(s[k], p) for p in (50, 90, 99)] for k in ("ttft", "tpot", "itl")}
        print(f"{name:<24}{s['wall']:>7.2f}{s['tok_s']:>10.0f}{s['tok_s'] / base:>7.1f}x  "
              f"{q['ttft'][0]:>6.2f}/{q['ttft'][1]:>5.2f}/{q['ttft'][2]:>5.2f}  "
              f"{pct(s['ttft_interactive'], 90):>10.2f}  {q['tpot'][0] * 1e3:>7.1f}/"
              f"{q['tpot'][2] * 1e3:>6.1f}  {q['itl'][0] * 1e3:>6.1f}/{q['itl'][2] * 1e3:>6.1f}"
              f"  {s['goodput']:>6.2f} ({s['good']}/{len(reqs)})")
    for name, o in outs.items():
        if name != "sequential" and "sequential" in outs and args.kv_dtype != "int8":
            same = sum(a == b for a, b in zip(o, outs["sequential"]))
            print(f"greedy outputs of {name} == sequential generate(): {same}/{len(reqs)}")


def kv_table(args, cfg, reqs, rows, eng, static):
    """Table 2: work done vs needed, and KV memory: paged vs static vs contiguous."""
    st, bs = eng.stats, args.block_size
    # positions that must run through the model: the prompt and every output token but
    # the last (sampled, never fed back)
    useful = sum(len(r.prompt) + r.out_len - 1 for r in reqs)
    print(f"\nwork (token positions run through the model): needed {useful}; engine "
          f"{st['computed_tokens']} (+ recomputed after preemption, - prefix-cache hits)",
          end="")
    if static:
        used, reserved, computed = static
        print(f"; static batching {computed} = {computed / useful:.2f}x needed (padding): "
              f"the most continuous batching can gain over it here; measured "
              f"{max(r[1]['tok_s'] for r in rows[2:]) / rows[1][1]['tok_s']:.2f}x")
    print(f"\nKV cache ({eng.cache.kv_dtype}, {eng.cache.bytes_per_token} B/token, block "
          f"{bs} tokens, pool {args.num_blocks} blocks = {fmt_bytes(eng.cache.nbytes)}):")
    print(f"  engine: peak {st['peak_blocks']} blocks in use; unfilled slots per running "
          f"sequence: mean {st['waste_sum'] / max(st['waste_samples'], 1):.1f}, max "
          f"{st['max_waste']} (< one block of {bs}: paging wastes less than a block)")
    if static:
        print(f"  static batching reserves B x (longest prompt + longest output): "
              f"{reserved} slots for {used} tokens = {1 - used / reserved:.0%} wasted")
    print(f"  a contiguous cache reserving the full context ({cfg.block_size}) per request: "
          f"{1 - useful / len(reqs) / cfg.block_size:.0%} wasted")
    print(f"  prefix cache: {st['cached_tokens']}/{st['prompt_tokens']} prompt tokens hit "
          f"({st['cached_tokens'] / max(st['prompt_tokens'], 1):.0%}); preemptions "
          f"{st['preemptions']}; steps {st['steps']}")


def roofline_table(model, eng, rows, bw, flops):
    """Table 3, the decode roofline: a decode step reads every weight (the embedding table
    aside: B rows of it) and the context's K/V, and does 2 FLOPs per weight per token plus
    4·L·d per context token (QKᵀ and AV). Intensity = FLOPs / bytes; the machine's ridge
    point = peak FLOP/s / bandwidth: below it a step is memory-bound."""
    cfg = model.config
    n_w = model.num_params() - model.tok_embeddings.weight.numel()
    w_bytes = n_w * model.output.weight.element_size()
    kv_tok = eng.cache.bytes_per_token
    dec = [(s, n, c) for s, n, nd, c, ns in eng.step_log if nd == ns == n and n > 1]
    if not dec:
        return
    s, n, c = sorted(dec)[len(dec) // 2]            # the median decode step by time
    moved = w_bytes + c * kv_tok
    fl = 2 * n_w * n + 4 * cfg.n_layer * cfg.n_embd * c
    print(f"\ndecode roofline (median decode-only step: B={n}, {c} context tokens):")
    print(f"  bytes read {fmt_bytes(moved)} (weights {fmt_bytes(w_bytes)} + KV "
          f"{fmt_bytes(c * kv_tok)}) in {s * 1e3:.1f} ms = {moved / s / 1e9:.2f} GB/s = "
          f"{moved / s / bw:.0%} of the measured copy bandwidth")
    print(f"  intensity {fl / moved:.1f} FLOP/B (2NB / (N·w + B·ctx·s)), ridge point "
          f"{flops / bw:.1f} FLOP/B -> {'memory' if fl / moved < flops / bw else 'compute'}"
          f"-bound; achieved {fl / s / 1e9:.1f} of {flops / 1e9:.0f} GFLOP/s. (An H100: "
          f"989 TFLOP/s bf16 / 3.35 TB/s = ridge 295: memory-bound to B in the hundreds)")
    if rows[0][0] == "sequential generate()":
        print(f"  B=1 (sequential): {pct(rows[0][1]['itl'], 50) * 1e3:.1f} ms per token; "
              f"B={n}: {s * 1e3 / n:.2f} ms per token -- the weights are read once per step")


def ledger_rows(rows, eng, static, n_engines):
    """Table 4: the rows of the README's trade-off table."""
    base, st = rows[0][1]["tok_s"], eng.stats
    best = max(rows, key=lambda r: r[1]["tok_s"])
    print("\nledger rows:")
    print(f"  continuous batching + paged KV | KV waste < 1 block/seq (max {st['max_waste']} "
          f"slots) | block tables, a K/V gather per layer | {best[0]}: "
          f"{best[1]['tok_s'] / base:.1f}x the throughput of {rows[0][0]}")
    if static:
        used, reserved, _ = static
        print(f"  static batching | weight reads shared by B | {1 - used / reserved:.0%} of its "
              f"KV reservation and compute is padding | {rows[1][1]['tok_s'] / base:.1f}x "
              f"sequential")
    if n_engines == 2:
        f, s = rows[-2][1], rows[-1][1]
        print(f"  SLO-aware (priority, EDF) vs FCFS | goodput {s['goodput']:.2f} vs "
              f"{f['goodput']:.2f} req/s | interactive TTFT p90 "
              f"{pct(s['ttft_interactive'], 90):.2f} vs {pct(f['ttft_interactive'], 90):.2f} s"
              f" | batch requests wait longer")


def bench(args, model, enc, conditions=None):
    """Tables 0-4 on one workload, then one warning line when core.runtime.TimingConditions
    (None: the machine's own) finds the load or the repeats' spread too high to trust the
    times. -> (rows, outputs by system, engines by policy)."""
    conditions = conditions or clock_conditions(args)
    if args.clock == "cpu" and args.rate != math.inf:
        raise UserError("--clock cpu needs --rate inf (CPU time does not pass while waiting "
                        "for an arrival)")
    if args.workload == "mixed":
        reqs = mixed_workload(args.num_requests,
                              length_range(args.prompt_len, "prompt-len"),
                              length_range(args.long_len, "long-len"),
                              args.long_frac,
                              length_range(args.output_len, "output-len"),
                              args.rate, model.config, enc.eot_token, args.seed)
    else:
        reqs = make_workload(args, model.config, enc.eot_token)
    with conditions:                # the load as the roofs are measured, and as the last run ends
        bw, flops = print_setup(args, model, reqs)
        rows, outs, extra = run_systems(args, model, enc, reqs, CLOCKS[args.clock])
    engines = {p: extra[p] for p in ([args.policy] if args.policy else POLICIES)}
    eng, static = list(engines.values())[-1], extra.get("static")
    latency_table(rows, outs, reqs, args)
    kv_table(args, model.config, reqs, rows, eng, static)
    roofline_table(model, eng, rows, bw, flops)
    ledger_rows(rows, eng, static, len(engines))
    conditions.report({name: s["walls"] for name, s in rows})
    return rows, outs, engines


# ----------------------------------------------------------------------------------------
# The second KV tier on the multi-turn workload: pool sizes x tiers

def agent_workload(args, cfg, eos_id):
    return AgentSessions(cfg, eos_id, args.sessions, args.turns, args.system_len,
                         length_range(args.message_len, "message-len"),
                         length_range(args.answer_len, "answer-len"),
                         args.think_time, args.rate, args.seed)


def tier_run(model, enc, args, pool, tier, clock):
    """One engine (pool blocks, tier kind) through the agent sessions. -> a summary."""
    run_args = argparse.Namespace(**{**vars(args), "num_blocks": pool, "kv_tier": tier})
    eng = engine_from_args(model, enc, run_args, args.policy or "fcfs", clock=clock)
    t0, done = run_sessions(eng, agent_workload(args, model.config, enc.eot_token), clock)
    st, t = eng.stats, eng.alloc.tier
    ttft = [seq.token_times[0] - seq.arrival for _, seq in done]
    return dict(
        pool=pool, tier=tier, prompt=st["prompt_tokens"], reloaded=st["reloaded_tokens"],
        pool_hits=st["cached_tokens"] - st["reloaded_tokens"],
        history=sum(r.history for r, _ in done),
        # history an earlier turn computed, computed again: the cost a tier can remove
        recomputed=sum(max(0, r.history - seq.num_cached_tokens) for r, seq in done),
        computed=st["computed_tokens"], preemptions=st["preemptions"],
        bytes_in=t.bytes_in if t else 0, bytes_out=t.bytes_out if t else 0,
        drops=t.drops if t else 0, ttft=ttft, wall=max(seq.finish_time for _, seq in done) - t0,
        outputs={(r.session, r.turn): seq.output_ids for r, seq in done})


def tier_bench(args, model, enc):
    """Every pool size with every tier on the same sessions: where prompt tokens came
    from (pool hit, tier reload, computed), the history recomputed, bytes moved, TTFT;
    the outputs must be the same in every run (a reload is the same K/V as a recompute).
    -> the summaries."""
    if args.clock == "cpu" and (args.rate != math.inf or args.think_time > 0):
        raise UserError("--clock cpu needs --rate inf and --think-time 0 (CPU time does not "
                        "pass while waiting)")
    clock, cfg = CLOCKS[args.clock], model.config
    pools = _int_list(args.pool_sizes, "pool-sizes") if args.pool_sizes else [args.num_blocks]
    # not given: without the second tier and with --kv-tier's, side by side (the pool alone
    # is the row the tier is measured against)
    tiers = (args.tiers.split(",") if args.tiers else
             list(dict.fromkeys(["none", args.kv_tier])))
    if any(t not in serve.TIER_KINDS for t in tiers):
        raise UserError(f"--tiers takes a comma list of {', '.join(serve.TIER_KINDS)}, got "
                        f"{args.tiers!r}")
    print(f"agent sessions: {args.sessions} sessions x {args.turns} turns, system prompt "
          f"{args.system_len}, messages {args.message_len}, answers {args.answer_len} tokens, "
          f"think time {args.think_time} s; block {args.block_size} tokens, "
          f"{fmt_bytes(PagedKVCache(cfg, 1, args.block_size, kv_dtype=args.kv_dtype).nbytes)}"
          f" per block; tier {args.kv_tier_blocks} blocks; clock {args.clock}")
    print(f"\n{'pool':>5} {'tier':<5}{'prompt tok':>11}{'pool hit':>9}{'tier hit':>9}"
          f"{'history recomp.':>16}{'reloaded':>9}{'computed':>9}{'to tier':>9}{'from tier':>10}"
          f"{'TTFT p50/p99 ms':>17}{'wall s':>7}  same outputs")
    runs = []
    with clock_conditions(args) as conditions:     # one run per row: no spread to judge
        for pool in pools:
            for tier in tiers:
                r = tier_run(model, enc, args, pool, tier, clock)
                same = r["outputs"] == runs[0]["outputs"] if runs else True
                runs.append(r)
                print(f"{pool:>5} {tier:<5}{r['prompt']:>11}{r['pool_hits'] / r['prompt']:>9.0%}"
                      f"{r['reloaded'] / r['prompt']:>9.0%}{r['recomputed']:>8}/"
                      f"{r['history']:<7}{r['reloaded']:>9}{r['computed']:>9}"
                      f"{fmt_bytes(r['bytes_in']):>9}{fmt_bytes(r['bytes_out']):>10}"
                      f"{pct(r['ttft'], 50) * 1e3:>9.0f}/{pct(r['ttft'], 99) * 1e3:<7.0f}"
                      f"{r['wall']:>7.1f}  {same}")
    conditions.report()
    return runs


def _int_list(text, name):
    try:
        xs = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--{name} takes a comma list of integers, got {text!r}") from None
    if min(xs) < 1:
        raise UserError(f"--{name} must be >= 1")
    return xs


# ----------------------------------------------------------------------------------------
# The command line: `python -m scripts.serve_bench ...` (gpu_bench.py calls main with a list)

# ----------------------------------------------------------------------------------------
# What a request's extras cost the engine: structured output, and many LoRA adapters

def run_variant(model, enc, reqs, args, params_of, adapters=None, clock=time.perf_counter,
                prepare=None):
    """The workload submitted at once to a fresh engine, every request's SamplingParams from
    params_of(index, request), --repeats times; prepare(engine), untimed, first. -> (seconds
    of the fastest run, its output tokens, its engine)."""
    runs = []
    for _ in range(args.repeats):
        eng = engine_from_args(model, enc, args, args.policy or "fcfs", adapters, clock=clock)
        if prepare is not None:
            prepare(eng)
        t0 = clock()
        seqs = [eng.add_request(r.prompt, params_of(i, r)) for i, r in enumerate(reqs)]
        while eng.has_work():
            eng.step()
        runs.append((clock() - t0, sum(len(s.output_ids) for s in seqs), eng))
        if adapters is not None:       # the next engine attaches them again
            multi_lora.detach(model)
    return min(runs, key=lambda run: run[0])


def warm_up(model, enc, reqs, args, clock):
    """One untimed pass: the first engine run pays one-time costs (allocations, kernels)."""
    run_variant(model, enc, reqs[:4], argparse.Namespace(**{**vars(args), "repeats": 1}),
                lambda i, r: SamplingParams(max_tokens=r.out_len, temperature=0), clock=clock)


def structured_bench(args, model, enc, clock):
    """Free text vs every request under a JSON schema (serving/structured.py's demo): the
    engine's tok/s each, the mask cache's hit rate, and a mask computed fresh (a trie walk:
    a state first seen) against the median decode step."""
    reqs = make_workload(args, model.config, enc.eot_token)
    spec = {"type": "json_schema", "schema": structured.DEMO_SCHEMA}
    warm_up(model, enc, reqs, args, clock)
    rows, compile_s = {}, []

    def compile_once(eng):      # the vocabulary's trie and the schema's DFA, once per server
        t0 = time.perf_counter()
        eng._constraint(spec)
        compile_s.append(time.perf_counter() - t0)
    for label, extra in (("free text", {}), ("json_schema", {"structured": spec})):
        rows[label] = run_variant(model, enc, reqs, args, lambda i, r: SamplingParams(
            max_tokens=r.out_len, temperature=0.8, seed=i, **extra), clock=clock,
            prepare=compile_once if extra else None)
    (t_free, n_free, _), (t_json, n_json, eng) = rows["free text"], rows["json_schema"]
    c = eng._constraint(spec)
    states = list(c.cache)[:64]
    t0 = time.perf_counter()
    for state in states:
        c.trie_mask(state)
    per_state = (time.perf_counter() - t0) / max(len(states), 1)
    decode = statistics.median([t for t, _, n_dec, _, n in eng.step_log if n_dec == n] or [0])
    print(f"structured output: free text {n_free / t_free:.0f} tok/s, json_schema "
          f"{n_json / t_json:.0f} tok/s ({(n_json / t_json) / (n_free / t_free):.2f}x); mask "
          f"cache {c.hits / max(c.hits + c.misses, 1):.0%} hits over {c.hits + c.misses} "
          f"steps ({c.misses} states computed); a fresh mask {per_state * 1e3:.2f} ms vs a "
          f"decode step {decode * 1e3:.2f} ms; trie + schema built once per server in "
          f"{min(compile_s) * 1e3:.0f} ms (not in the tok/s)")


def adapters_bench(args, model, enc, clock):
    """The same workload on the base alone, with --adapters random LoRA adapters (rank
    --adapter-rank, every block linear) mixed round-robin with the base in every batch,
    and with one adapter merged into a copy of the weights: tok/s each, and the memory."""
    reqs = make_workload(args, model.config, enc.eot_token)
    batch = copy.deepcopy(model)
    # the files given with --lora, else --adapters random ones (the cost, not the quality)
    aset = serve.load_adapters(args, batch) or multi_lora.AdapterSet(batch, [
        multi_lora.random_adapter(model, f"a{k}", args.adapter_rank,
                                  ("wq", "wk", "wv", "wo", "w1", "w2", "w3"), seed=k)
        for k in range(args.adapters)])
    names = aset.names[1:]
    plain = lambda i, r: SamplingParams(max_tokens=r.out_len, temperature=0, ignore_eos=True)
    warm_up(model, enc, reqs, args, clock)
    mixed = lambda i, r: SamplingParams(max_tokens=r.out_len, temperature=0, ignore_eos=True,
                                        adapter=([None] + names)[i % (len(names) + 1)])
    t_base, n_base, _ = run_variant(model, enc, reqs, args, plain, clock=clock)
    t_mix, n_mix, _ = run_variant(batch, enc, reqs, args, mixed, aset, clock)
    merged = multi_lora.merged_copy(model, aset.adapters[0])
    t_merged, n_merged, _ = run_variant(merged, enc, reqs, args, plain, clock=clock)
    base = n_base / t_base
    ranks = "/".join(sorted({str(a.rank) for a in aset.adapters}))
    print(f"many LoRA adapters: base {base:.0f} tok/s; base + {len(names)} adapters (rank "
          f"{ranks}) mixed in every batch {n_mix / t_mix:.0f} tok/s "
          f"({n_mix / t_mix / base:.2f}x); one merged {n_merged / t_merged:.0f} tok/s "
          f"({n_merged / t_merged / base:.2f}x)")
    print("\n".join(aset.memory_report(model)))


BENCH_KNOBS = [
    knob("--num-requests", 64, "requests in the workload"),
    knob("--rate", math.inf, "Poisson arrivals per second (inf = all at once)"),
    knob("--prompt-len", "32:128", "uniform range LO:HI of prompt tokens"),
    knob("--output-len", "16:128", "uniform range LO:HI of output tokens"),
    knob("--shared-prefix", 0, "tokens every prompt starts with (a system prompt; prefix "
         "caching)"),
    knob("--interactive-frac", 0.25, "fraction of requests with the tight TTFT SLO and "
         "priority 0"),
    knob("--slo-ttft", 0.5, "interactive TTFT SLO, s"),
    knob("--slo-ttft-batch", 30.0, "batch TTFT SLO, s"),
    knob("--slo-tpot", 0.25, "TPOT SLO (all requests), s"),
    knob("--static-batch", 64, "static batching's batch size"),
    knob("--no-baselines", False, "skip sequential and static batching"),
    knob("--seed", 0, "workload seed"),
    knob("--workload", "uniform", "uniform: the flags above; mixed: short (--prompt-len) and "
         "long (--long-len) prompts; agent: multi-turn sessions, pool sizes x second tiers; "
         "structured: free text vs a JSON schema; adapters: base vs --adapters LoRA "
         "adapters in one batch vs merged",
         choices=["uniform", "mixed", "agent", "structured", "adapters"]),
    knob("--adapters", 4, "adapters: random LoRA adapters mixed with the base (unless --lora "
         "names files)"),
    knob("--adapter-rank", 8, "adapters: their rank"),
    knob("--long-len", "160:224", "mixed: long prompts' range LO:HI"),
    knob("--long-frac", 0.25, "mixed: share of long prompts"),
    knob("--repeats", 1, "run each system this many times, report the fastest run"),
    knob("--clock", "wall", "time with the wall clock, or with this process's CPU time (fair "
         "on a machine other jobs share; needs --rate inf)", choices=list(CLOCKS)),
]

AGENT_KNOBS = [
    knob("--sessions", 16, "conversations"),
    knob("--turns", 6, "turns per conversation"),
    knob("--system-len", 64, "shared system prompt tokens"),
    knob("--message-len", "16:48", "new message per turn, LO:HI"),
    knob("--answer-len", "16:32", "answer per turn, LO:HI"),
    knob("--think-time", 0.0, "seconds between an answer and the next turn"),
    knob("--pool-sizes", None, "comma list of --num-blocks to run; not given: --num-blocks"),
    knob("--tiers", None, "comma list of second tiers to run (none,host,file); not given: "
         "none and --kv-tier's"),
]


# the whole command line: serve.py's model and engine tables (the same engine as serving,
# built by serve.engine_from_args), then the workload's and the agent sessions'
KNOBS = {None: serve.MODEL_KNOBS,
         "engine": serve.engine_knobs("the engine's scheduling; not given: both, one after the "
                                      "other"),
         "bench": BENCH_KNOBS, "agent sessions (--workload agent)": AGENT_KNOBS}


def build_parser():
    return command_line("Benchmark the engine against sequential generate() and static "
                        "batching on one seeded workload.", KNOBS,
                        prog="python -m scripts.serve_bench")


def main(argv=None):
    """-> (rows, outputs, engines) of bench(), for callers in-process (scripts/gpu_bench.py)."""
    args = build_parser().parse_args(argv)
    if min(args.num_requests, args.static_batch, args.repeats) < 1 or args.rate <= 0:
        raise UserError("--num-requests, --static-batch, --repeats and --rate must be positive")
    if not 0 <= args.interactive_frac <= 1:
        raise UserError("--interactive-frac must be in [0, 1]")
    if not 0 <= args.long_frac <= 1:
        raise UserError("--long-frac must be in [0, 1]")
    if args.lora and args.workload != "adapters":
        raise UserError("--lora: only --workload adapters serves adapters in this bench")
    model, enc = serve.load_served_model(args)
    if args.workload == "agent":
        return tier_bench(args, model, enc)
    if args.workload in ("structured", "adapters"):
        bench_of = structured_bench if args.workload == "structured" else adapters_bench
        with clock_conditions(args) as conditions:
            bench_of(args, model, enc, CLOCKS[args.clock])
        conditions.report()
        return None
    return bench(args, model, enc)


if __name__ == "__main__":
    run_cli(main)
