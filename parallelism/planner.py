"""
parallelism/planner.py -- the layout planner: which TP × CP × PP × DP for a model that does not fit
one GPU?

  python parallel.py plan --params 405B --layers 126 --hidden 16384 --seq 8192 --gpus 16384

Pure arithmetic, no process group. Every candidate (tp a power of two inside one node, pp
and cp powers of two, dp = gpus/(tp·cp·pp)) is priced for one GPU: bytes held, bytes
sent per optimizer step. Then the Ultra-Scale Playbook's three-step cheat sheet:
  1. fit a step in memory: TP inside a node first (NVLink carries its per-layer
     collectives), then PP across nodes (one point-to-point per stage boundary), CP when
     the sequence is so long that activations overflow. As a search: for cp = 1, 2, ...:
     for pp = 1, 2, ...: for tp = 1, 2, ... ≤ node: the first layout that fits wins;
  2. reach the global batch with DP: m = tokens / (seq · micro_batch · dp) microbatches
     per step (gradient accumulation). They are also the pipeline's microbatches, and
     1F1B fills only with m ≥ pp (bubble (pp−1)/(m+pp−1)): a layout with m < pp is
     rejected, so a short batch of long sequences pushes DP into CP;
  3. the layout.

Memory per GPU, mixed precision with Adam (2 + 2 + 12 B/param: Rajbhandari et al. 2020,
ZeRO), in decimal GB against --gpu-mem: an "80 GB" H100 has 80 GiB = 85.9 GB, the rest is
the room for what is not counted (logits, temporaries, CUDA/NCCL buffers). A GPU holds a
shard Ψ_s = Ψ/(tp·pp): stages balanced by parameters, as Llama 3's uneven split intends
(one layer less on the first and last stage, see stage_layers: pp need not divide L). ZeRO
shards over the n = dp·cp ranks holding the same shard (CP ranks share the weights and
average gradients with DP): weights 2Ψ_s (÷n at ZeRO-3), grads 2Ψ_s (÷n from ZeRO-2),
optimizer 12Ψ_s (÷n from 1). Default ZeRO-2: Llama 3's FSDP sharded optimizer states and
gradients but kept the weights whole between forward and backward; it sends what ZeRO-1
sends. Activations per layer and microbatch (Korthikanti et al. 2022, 16-bit; TP always
with sequence parallelism, so every term ÷t; CP keeps s/c of the tokens on each GPU): none
(s/c)·b·h/t·(34 + 5·a·s/h) the a·(s/c)·s attention scores are stored selective
(s/c)·b·h·34/t scores recomputed: what FlashAttention does, so Llama 3's "no activation
checkpointing" full 2·(s/c)·b·h/t only each layer's input is kept 1F1B (Narayanan et al.
2021): stage i runs pp−i warm-up forwards before its first backward, so it holds min(pp−i,
m) microbatches: stage 0 holds pp × L/pp = all L layers' worth. PP divides the weights,
never the activations: only CP (or TP) does.

Sent per GPU per step, bf16 (a ring all-gather/reduce-scatter of N bytes over n ranks
sends N·(n−1)/n from each), per layer and microbatch unless said:
  TP  2 all-gathers + 2 reduce-scatters of (s/c)·b·h·2 forward, the same backward (=
      Megatron's 4 all-reduces), 4 more for full recompute's second forward;
  CP  ring attention: local K and V, (s/c)·b·kv·2 each, c−1 hops forward; K, V and dK, dV
      round again backward;   PP  per microbatch, an activation forward and a gradient
      back, (s/c)·b·h·2/t (each TP rank sends its sequence-parallel slice);
  DP  per step, reduce-scatter grads + all-gather weights 2·2Ψ_s·(n−1)/n (DDP: the same
      as one all-reduce; ZeRO-3 gathers the weights again for backward: 3·).

Mixture of experts (DeepSeekMoE, DeepSeek-V3): the shape gives Ψ in all and the parameters
one token activates (top-k of the routed experts; param_counts, equal to model.py's own
counts for its presets); the routed experts are divided by pp·ep (not by TP: experts are
split by EP, TP slices the rest), and ZeRO shards them over the dp·cp/ep ranks holding the
same experts; EP  per MoE layer and microbatch, dispatch and combine, forward and
backward: 4·(s/c)·b·k·h·2·(ep−1)/ep. With experts the search tries TP last (V3 trains
without it). --state-bytes moves bytes between what ZeRO-1 shards and what it does not
(V3: 2,6,8). DeepSeek-V3 on 2,048 H800s (PP 16, EP 64, ZeRO-1, no TP): docs/planner.md.

Time and money (parallelism/cost_model.py), with --gpu, --price or --rank-by time: each
layout's bytes become collectives (layout_collectives: op, ranks, calls, payload, in
CommMeter's terms), priced α–β on NVLink inside a node and InfiniBand across; the FLOPs
per token 6Ψ + 12·L·h·s (+ recompute) run at --gemm-efficiency of the GPU's peak; what
this repo's code overlaps (and --hide) hides communication under compute; the bubble
stretches the pipelined part. -> step seconds, MFU, $ per step or per run (--tokens-total),
and --rank-by time picks the fastest layout that fits. --published prices Llama 3 405B
and DeepSeek-V3 from their data sheets next to the published MFU, GPU-hours and $.

Arithmetic only, no process group: a part of parallel.py (choosing a layout, not running
one); `python parallel.py plan` is its command line.
"""
import math
from dataclasses import dataclass

from core.cli import ArgumentParser, add_knobs, fmt_bytes, knob, require_at_least_one
from core.errors import UserError
from parallelism.cost_model import (GEMM_EFFICIENCY, StepWork, bubble_fraction,
                                    collective_seconds, gpu, link_of, predict_step,
                                    repo_overlap, ring_factors, run_cost,
                                    train_flops_per_token)

# How often each layer's TP and CP traffic happens per microbatch: full recomputation runs
# the forward a second time (with its collectives); selective recomputes only the
# attention scores, locally, and sends nothing more.
TP_PASSES = {"none": 2, "selective": 2, "full": 3}        # forward, backward, recompute
CP_LAPS = {"none": 3, "selective": 3, "full": 4}          # K/V forward, K/V + dK/dV backward


def parse_quantity(text, flag, binary=False):
    """'405B', '8.03B', '405e9' -> an int. binary: K, M, G = 2^10, 2^20, 2^30 (token counts:
    Llama 3's "16M tokens" per step is 16·2^20)."""
    # parameters and run lengths are decimal (405B, 15.6T tokens); batch sizes binary
    units = {"K": 2**10, "M": 2**20, "G": 2**30} if binary else \
        {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    t = str(text).strip().upper()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise UserError(f"{flag}: cannot read a count from {text!r} (try 405B, 8.03B, 405e9"
                        f"{', 16M' if binary else ''})") from None
    if not 1 <= value < math.inf:
        raise UserError(f"{flag} must be at least 1, got {text!r}")
    return int(round(value))


def check_plan_args(args):
    """Fill the defaults that depend on other flags, reject what cannot be planned;
    -> (Ψ used, Ψ counted from the shape)."""
    # Llama's conventions fill what the shape leaves out: heads of 128, 8 KV heads (GQA),
    # a SwiGLU 8h/3 wide rounded up to a multiple of 256
    if args.heads is None and args.hidden % 128:
        raise UserError(f"--hidden {args.hidden} is not a multiple of 128: pass --heads")
    args.heads = args.hidden // 128 if args.heads is None else args.heads
    if args.kv_heads is None:
        args.kv_heads = 8 if args.heads % 8 == 0 else args.heads
    if args.ffn is None:
        args.ffn = 256 * math.ceil(8 * args.hidden // 3 / 256)
    require_at_least_one(args, ("layers", "hidden", "heads", "kv_heads", "vocab", "ffn", "seq",
                                "gpus", "gpus_per_node", "micro_batch"))
    if not args.gpu_mem > 0:
        raise UserError(f"--gpu-mem must be positive (GB), got {args.gpu_mem}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UserError(f"--heads {args.heads} must divide --hidden {args.hidden}, and "
                        f"--kv-heads {args.kv_heads} must divide --heads")
    # TP stays inside a node and a group is on NVLink only if its node is whole
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not a whole number of nodes of "
                        f"--gpus-per-node {args.gpus_per_node}")
    # token counts per step are binary (16M = 2048 sequences of 8192: Llama 3's batch)
    args.tokens = parse_quantity(args.global_batch_tokens, "--global-batch-tokens", True)
    if args.tokens < args.seq * args.micro_batch:
        raise UserError(f"--global-batch-tokens {args.tokens:,} is less than one microbatch "
                        f"(--seq {args.seq} × --micro-batch {args.micro_batch})")
    check_moe_args(args)
    shape = param_counts(args)["total"]
    return (parse_quantity(args.params, "--params") if args.params else shape), shape


def check_moe_args(args):
    """The mixture-of-experts flags, and --state-bytes read into three numbers."""
    args.expert_ffn = args.expert_ffn or args.ffn
    try:
        text = args.state_bytes if isinstance(args.state_bytes, str) else \
            ",".join(map(str, args.state_bytes))          # planned twice: already parsed
        args.state_bytes = tuple(float(b) for b in text.split(","))
    except ValueError:
        args.state_bytes = ()
    if len(args.state_bytes) != 3 or min(args.state_bytes) <= 0:
        raise UserError("--state-bytes takes three positive numbers: weights,grads,optimizer")
    if args.experts and not 1 <= args.top_k <= args.experts:
        raise UserError(f"--top-k {args.top_k} must be in 1..--experts {args.experts}")
    # each EP rank holds E/ep whole experts: ep must divide them (and EP needs experts)
    if args.ep < 1 or (args.experts or 1) % args.ep or (args.ep > 1 and not args.experts):
        raise UserError(f"--ep {args.ep} must divide --experts {args.experts} (and needs them)")
    if not 0 <= args.dense_layers <= args.layers:
        raise UserError(f"--dense-layers must be in 0..--layers {args.layers}")


def attention_params(args):
    """One layer's attention weights (+ its norms). GQA: wq, wo h·h, wk, wv h·kv. MLA
    (DeepSeek-V2 §2.1, core/mla.py's names): wq (or wq_a, q_norm, wq_b) to H·(d_nope + d_R),
    wkv_a h → d_c + d_R, kv_norm, wkv_b d_c → H·(d_nope + d_v), wo H·d_v → h."""
    h, H = args.hidden, args.heads
    if not args.kv_lora_rank:
        kv = args.kv_heads * h // H
        return 2 * h * h + 2 * h * kv
    qk = H * (args.qk_nope_dim + args.qk_rope_dim)
    q = h * qk if not args.q_lora_rank else \
        h * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * qk
    kv = h * (args.kv_lora_rank + args.qk_rope_dim) + args.kv_lora_rank + \
        args.kv_lora_rank * H * (args.qk_nope_dim + args.v_head_dim)
    return q + kv + H * args.v_head_dim * h


def param_counts(args):
    """From the shape: 'total' (memory), 'active' (what one token's forward touches: top-k
    of the routed experts), 'routed' (the routed experts' weights: what EP divides).
    A layer: attention + 2 norms (h each) + a SwiGLU 3·h·ffn, or, as a MoE layer, a router
    (E·h), E routed experts 3·h·f_e and the shared experts 3·h·(n_s·f_e) (one SwiGLU of
    n_s·f_e, moe.MoE). Plus the untied embedding and head (2·V·h) and the final norm.
    Not counted: DeepSeek-V3's MTP module (14B on top of its 671B)."""
    h = args.hidden
    # DeepSeek-V3 keeps its first --dense-layers layers dense (a plain SwiGLU of --ffn)
    moe_layers = args.layers - args.dense_layers if args.experts else 0
    expert = 3 * h * args.expert_ffn
    per_layer = attention_params(args) + 2 * h
    dense = (args.layers - moe_layers) * 3 * h * args.ffn
    moe = moe_layers * (args.experts * h + args.shared_experts * expert)
    routed = moe_layers * args.experts * expert
    total = args.layers * per_layer + dense + moe + routed + 2 * args.vocab * h + h
    # a token runs k of the E routed experts: the other E − k are memory, not FLOPs
    active = total - moe_layers * (args.experts - args.top_k) * expert
    return dict(total=total, active=active, routed=routed, moe_layers=moe_layers)


def stage_layers(layers, pp):
    """Layers on each pipeline stage. Llama 3 took one layer off the first and the last
    stage to make room for the embedding and the output head. Generalised: L + 2 slots
    split as evenly as possible, at most ceil((L+2)/pp) per stage (the larger shares on the
    later stages, which hold fewer microbatches); the embedding takes the first slot, the
    head the last. 126 layers on 16 stages: 7, 8 × 14, 7."""
    base, extra = divmod(layers + 2, pp)
    # the `extra` larger shares go last: late stages hold fewer microbatches in 1F1B
    slots = [base + (i >= pp - extra) for i in range(pp)]
    slots[0] -= 1                   # the embedding's slot and the head's
    slots[-1] -= 1
    return slots


def activation_bytes_per_layer(args, tp, cp):
    """One layer, one microbatch, one GPU: the Korthikanti rows above."""
    # sequence parallelism divides every term by t; CP keeps s/c of the tokens; the
    # 5·a·s/h term is the a·(s/c)·s attention scores, gone once they are recomputed
    local = args.seq // cp * args.micro_batch * args.hidden / tp
    if args.recompute == "none":
        return local * (34 + 5 * args.heads * args.seq / args.hidden)
    return local * (34 if args.recompute == "selective" else 2)


@dataclass
class PlannedLayout:
    tp: int
    cp: int
    pp: int
    dp: int
    m: int              # microbatches per step and pipeline (gradient accumulation)
    weights: float      # bytes held per GPU
    grads: float
    optimizer: float
    acts: float         # on the busiest stage: `busiest` = (stage, layers, microbatches)
    busiest: tuple
    sent: dict          # bytes sent per GPU per step: TP, CP, PP, DP, EP
    status: str         # fits | over (memory) | m < pp | batch < dp (m = 0)
    ep: int = 1         # expert parallelism, inside the dp·cp ranks

    total = property(lambda self: self.weights + self.grads + self.optimizer + self.acts)
    bubble = property(lambda self: (self.pp - 1) / max(self.m + self.pp - 1, 1))
    name = property(lambda self: f"TP {self.tp} × CP {self.cp} × PP {self.pp} × DP {self.dp}"
                    + (f" (EP {self.ep})" if self.ep > 1 else ""))


def held_bytes(args, dense, routed, n, n_e):
    """(weights, grads, optimizer) bytes of a GPU holding `dense` + `routed` parameters,
    ZeRO over the n ranks holding the same dense shard and the n_e = n/ep holding the
    same experts."""
    wb, gb, ob = args.state_bytes
    # stage k shards the optimizer (k ≥ 1), the gradients (k ≥ 2), the weights (k = 3)
    def sharded(stage, count):
        return count if args.zero < stage else dense / n + routed / n_e
    return (wb * sharded(3, dense + routed), gb * sharded(2, dense + routed),
            ob * sharded(1, dense + routed))


@dataclass(frozen=True)
class Collective:
    """One kind of collective a layout issues, per GPU and optimizer step, in CommMeter's
    terms (core/meters.py): op, ranks in the group, calls, payload bytes per call; `dim` is
    the parallelism it serves, `scope` the link it crosses (nvlink inside a node, ib
    across). Bytes sent = calls · factor · payload with cost_model.ring_factors' factor."""
    dim: str
    op: str
    ranks: int
    calls: float
    payload: float
    scope: str

    wire = property(lambda self: self.calls * ring_factors(self.op, self.ranks)[1] * self.payload)


def layout_collectives(args, psi, tp, cp, pp, dp, m, ep=1):
    """The collectives behind the header's "sent per GPU per step" rows, per GPU and step.
    TP: per layer pass, 2 all-gathers of the (s/c)·b·h/t sequence-parallel slice and 2
    reduce-scatters of the whole (s/c)·b·h (Megatron-SP), TP_PASSES passes. CP: each lap a
    ring of c−1 K+V sends. PP: an activation forward and a gradient back per microbatch.
    DP: once per step, reduce-scatter the gradients and all-gather the weights (ZeRO-3: the
    weights twice; DDP: one all-reduce of the gradients), one call per layer unit, dense
    over the n = dp·cp ranks and experts over n/ep. EP: dispatch + combine, forward and
    backward, per MoE layer pass. Groups of ranks are laid out TP fastest, then CP, PP, DP
    (EP inside DP): a group stays on NVLink when all its ranks fit in one node."""
    counts = param_counts(args)
    routed = psi * counts["routed"] / counts["total"]
    shard, n = (psi - routed) / (tp * pp), dp * cp
    expert_shard, n_e = routed / (pp * ep), dp * cp // ep
    layers = max(stage_layers(args.layers, pp))             # the busiest stage sets the pace
    tokens = args.seq // cp * args.micro_batch             # on this GPU, per microbatch
    act = tokens * args.hidden * 2                          # one bf16 activation (s/c)·b·h
    kv_local = max(args.kv_heads // tp, 1) * args.hidden // args.heads
    passes, node = layers * m, args.gpus_per_node
    def scope(inner, size):        # ranks `inner` apart, `size` of them: inside one node?
        return "nvlink" if inner * size <= node else "ib"
    wb, gb, _ = args.state_bytes
    # TP: CommMeter records an all-gather's input (the 1/t slice) and a reduce-scatter's
    # input (the whole activation); the ring factors (t−1) and (t−1)/t make both send
    # (t−1)/t of one activation: Megatron's 4 all-reduces per layer, as 8 halves.
    rows = [Collective("TP", "all_gather", tp, 2 * TP_PASSES[args.recompute] * passes,
                       act / tp, "nvlink"),
            Collective("TP", "reduce_scatter", tp, 2 * TP_PASSES[args.recompute] * passes,
                       act, "nvlink"),
            # CP: a lap passes the local K and V (kv heads only) c−1 hops round the ring
            Collective("CP", "send", cp, CP_LAPS[args.recompute] * (cp - 1) * passes,
                       2 * tokens * kv_local * 2, scope(tp, cp)),
            # PP: each TP rank sends its sequence-parallel slice of the boundary activation
            Collective("PP", "send", pp, 2 * m * (pp > 1), act / tp, scope(tp * cp, pp)),
            # EP (GShard; DeepSeek-V3 §3.2.2): every token's k copies dispatched to their
            # experts and combined back, forward and backward: 4 all-to-alls of tokens·k·h
            # bf16 per MoE layer pass, (ep−1)/ep of it leaving the GPU under uniform routing
            # (V3 dispatches in FP8: 3/4 of it; see PUBLISHED)
            Collective("EP", "all_to_all", ep, 4 * passes * counts["moe_layers"] / args.layers,
                       tokens * args.top_k * args.hidden * 2, scope(tp * cp, ep))]
    # DP: one unit (layer) at a time, as training/data_parallel.py shards and syncs them;
    # the gradient reduce-scatter in the gradient bytes, the weight all-gather in the weight
    # bytes (the input shard: 1/n of the unit), once per step (accumulated gradients)
    for ranks, held in ((n, shard / layers), (n_e, expert_shard / layers)):   # per unit
        where = scope(tp * pp, ranks)
        if not held:                                        # a dense model has no experts
            continue
        if args.zero == 0:
            rows.append(Collective("DP", "all_reduce", ranks, layers, gb * held, where))
            continue
        rows.append(Collective("DP", "reduce_scatter", ranks, layers, gb * held, where))
        rows.append(Collective("DP", "all_gather", ranks, layers * (1 + (args.zero == 3)),
                               wb * held / ranks, where))
    return rows


def evaluate_layout(args, psi, tp, cp, pp, ep=1):
    """One candidate, priced for its busiest GPU: bytes held, bytes sent, and whether it
    fits (status). dp takes what the other degrees leave; m is gradient accumulation."""
    dp = args.gpus // (tp * cp * pp)
    m = args.tokens // (args.seq * args.micro_batch * dp)   # rounded down: whole sequences
    counts = param_counts(args)
    routed = psi * counts["routed"] / counts["total"]   # the experts' share of Ψ
    shard, n = (psi - routed) / (tp * pp), dp * cp       # TP slices the dense part only
    expert_shard, n_e = routed / (pp * ep), dp * cp // ep
    weights, grads, optimizer = held_bytes(args, shard, expert_shard, n, n_e)
    layers = stage_layers(args.layers, pp)
    # 1F1B: stage i keeps min(pp − i, m) microbatches' activations alive; the stage with
    # the most layers × microbatches is the one that must fit
    worth, stage = max((k * min(pp - i, m), i) for i, k in enumerate(layers))
    acts = worth * activation_bytes_per_layer(args, tp, cp)
    sent = dict.fromkeys(("TP", "CP", "PP", "DP", "EP"), 0.0)    # bytes leaving this GPU:
    for c in layout_collectives(args, psi, tp, cp, pp, dp, m, ep):  # the collectives' wire
        sent[c.dim] += c.wire
    total = weights + grads + optimizer + acts
    # the verdicts in the order a layout fails them: no sequence to run, no memory, a
    # pipeline that cannot fill (fewer microbatches than stages)
    status = ("batch < dp" if m < 1 else "over" if total > args.gpu_mem * 1e9
              else "m < pp" if m < pp else "fits")
    return PlannedLayout(tp, cp, pp, dp, m, weights, grads, optimizer, acts,
                         (stage, layers[stage], min(pp - stage, m)), sent, status, ep)


def powers_of_two(limit):
    """1, 2, 4, ... ≤ limit: the degrees tried (collectives and heads split evenly)."""
    return [2**k for k in range(int(math.log2(limit)) + 1)]


def plan_layouts(args):
    """-> (Ψ, Ψ from the shape, every candidate in the cheat sheet's order, the first that
    fits or None). The order IS step 1: least CP, then least PP, then least TP."""
    psi, shape = check_plan_args(args)
    # TP must split the heads (and the KV heads, or replicate them) and stay in a node;
    # zigzag CP cuts the sequence into 2c equal chunks
    tps = [t for t in powers_of_two(min(args.gpus_per_node, args.gpus))
           if args.gpus_per_node % t == 0 and args.heads % t == 0
           and (args.kv_heads % t == 0 or t % args.kv_heads == 0)]
    cps = [c for c in powers_of_two(args.seq) if c == 1 or args.seq % (2 * c) == 0]  # zigzag
    pps = powers_of_two(args.layers)
    # the order of the search is the cheat sheet: the first layout that fits is the pick
    if args.experts:     # MoE: TP last (DeepSeek-V3 trains without it: the experts are not
        order = [(cp, pp, tp) for cp in cps for tp in tps for pp in pps]  # split by TP)
    else:
        order = [(cp, pp, tp) for cp in cps for pp in pps for tp in tps]
    # whole replicas only, and EP groups inside the data ranks that share a weight shard
    rows = [evaluate_layout(args, psi, tp, cp, pp, args.ep) for cp, pp, tp in order
            if args.gpus % (tp * cp * pp) == 0
            and (args.gpus // (tp * pp)) % args.ep == 0]
    return psi, shape, rows, next((r for r in rows if r.status == "fits"), None)


def why_not(r):
    """Why the cheat sheet passed over row r, in a few words."""
    if r.status == "over":
        return f"needs {fmt_bytes(r.total)}"
    if r.status == "m < pp":
        return f"fits ({fmt_bytes(r.total)}) but m = {r.m} < pp = {r.pp} (bubble {r.bubble:.0%})"
    if r.status == "fits":                  # --rank-by time: it fits, it is only slower
        return f"fits too ({fmt_bytes(r.total)})"
    return f"has more replicas ({r.dp}) than sequences per step"


def _gb(x):
    """GB in a 6-wide column: one decimal below 100 GB, none above (the 4398 GB of TP)."""
    return f"{x / 1e9:.1f}" if x < 99.95e9 else f"{x / 1e9:.0f}"


def _zero_label(args):
    """What --zero shards, in the words of the ZeRO paper's stages."""
    return ["DDP over dp·cp: nothing sharded", "ZeRO-1 over dp·cp: optimizer sharded",
            "ZeRO-2 over dp·cp: optimizer + grads sharded, weights whole (Llama 3's FSDP)",
            "ZeRO-3 over dp·cp: weights, grads and optimizer sharded"][args.zero]


def _assumptions(args, psi, shape):
    """The plan's first lines: the shape, the batch, and every assumption the bytes rest on
    (a reader should be able to redo the table from them)."""
    act = {"none": "(s/c)·b·h/t·(34+5as/h)", "selective": "(s/c)·b·h·34/t",
           "full": "2·(s/c)·b·h/t"}[args.recompute]
    wb, gb, ob = args.state_bytes
    heads = f"MLA d_c {args.kv_lora_rank}" if args.kv_lora_rank else f"{args.kv_heads} KV"
    moe = []
    if args.experts:
        c = param_counts(args)
        moe = [f"  MoE in {c['moe_layers']} layers: {args.experts} routed experts "
               f"{args.expert_ffn} wide + {args.shared_experts} shared, top-{args.top_k}: "
               f"{c['active'] / 1e9:.1f}B active per token; routed {c['routed'] / 1e9:.1f}B "
               f"÷ (pp·ep), the rest ÷ (tp·pp)"]
    return [f"plan: Ψ = {psi / 1e9:.1f}B (the shape gives {shape / 1e9:.1f}B), {args.layers} "
            f"layers, h {args.hidden}, {args.heads} heads ({heads}), ffn {args.ffn}",
            f"  seq {args.seq} × micro-batch {args.micro_batch}, {args.tokens:,} tokens per "
            f"step, {args.gpus} × {args.gpu_mem:g} GB GPUs, {args.gpus_per_node} per node",
            *moe,
            f"assumptions: {wb + gb + ob:g} B/param (" + ("bf16 weights 2, grads 2, fp32 master "
            "+ Adam 12" if args.state_bytes == (2, 2, 12) else f"weights {wb:g}, grads {gb:g}, "
            f"optimizer {ob:g}") + "); TP + sequence parallel;",
            f"  {_zero_label(args)};",
            f"  activations {args.recompute}: {act} per layer and microbatch (Korthikanti 2022);",
            "  1F1B: stage i holds min(pp−i, m) microbatches; L+2 slots per pipeline (Llama 3: "
            "embedding and",
            "  head one each); weight shards Ψ/(tp·pp); not counted: logits, temporaries, "
            "CUDA/NCCL buffers",
            "  (room for them: an 80 GB H100 has 80 GiB = 85.9 GB)"]


def _shown(rows, best):
    """No fit: the least memory, to say how far off it is. A fit: its neighbours with less
    TP, PP or CP, the choice, and the next layouts that fit."""
    if best is None:
        return sorted((r for r in rows if r.m >= 1), key=lambda r: r.total)[:8]
    # halving a degree (PP and CP by 4 too) shows what the pick could not do without
    t, c, p = best.tp, best.cp, best.pp
    less = {(t // 2, c, p), (t, c, p // 2), (t, c, p // 4), (t, c // 2, p), (t, c // 4, p)}
    return [r for r in rows if (r.tp, r.cp, r.pp) in less] + \
        [r for r in rows[rows.index(best):] if r.status == "fits"][:8]


def _candidates(shown, best, timing=None, order="the cheat sheet's order"):
    """The table of candidates; timing = (title, cells(row)) adds time and money."""
    dims = ["TP", "CP", "PP", "DP"] + ["EP"] * any(r.ep > 1 for r in shown)
    # without a GPU the table is the memory planner's, column for column (docs/planner.md)
    title, cells = timing or ("", None)
    out = [f"candidates, in {order} (GB held | GB sent per step, per GPU):",
           f"  {'tp':>3}{'cp':>4}{'pp':>4}{'dp':>6}{'m':>6}{'weights':>8}{'grads':>6}"
           f"{'optim':>6}{'acts':>6}{'total':>7} |" + "".join(f"{d:>6}" for d in dims)
           + " | bubble" + title]
    for r in shown:
        held = "".join(f"{_gb(x):>{w}}" for x, w in ((r.weights, 8), (r.grads, 6),
                                                      (r.optimizer, 6), (r.acts, 6),
                                                      (r.total, 7)))
        sent = "".join(f"{_gb(r.sent[k]):>6}" for k in dims)
        out.append(f"{'->' if r is best else '  '}{r.tp:>3}{r.cp:>4}{r.pp:>4}{r.dp:>6}{r.m:>6}"
                   f"{held} |{sent} | {r.bubble:>5.0%}" + (f" |{cells(r)}" if timing else "")
                   + f"  {r.status}")
    return out


def _nothing_fits(args, rows, shown):
    """No layout fits: the closest one, and the knobs that would move memory or batch."""
    # a layout that fits but cannot fill its pipeline is saved by a larger batch
    short = any(r.status in ("m < pp", "batch < dp") for r in rows)
    return [f"  nothing fits {args.gpu_mem:g} GB with m ≥ pp; closest: {shown[0].name} "
            f"{why_not(shown[0])}",
            "  try more GPUs" + ", --recompute full" * (args.recompute != "full")
            + ", a higher --zero" * (args.zero < 3 < args.gpus) + ", a shorter --seq"
            + ", more --global-batch-tokens (m ≥ pp)" * short,
            "step 3 - layout: none"]


def _step1_fit(args, psi, rows, b):
    """Why this layout: what it holds, how its stages split, why less of each is not enough."""
    out = [f"  -> {b.name} holds {fmt_bytes(b.total)} ≤ {args.gpu_mem:g} GB: weights "
           f"{fmt_bytes(b.weights)}, grads {fmt_bytes(b.grads)},",
           f"     optimizer {fmt_bytes(b.optimizer)}, activations {fmt_bytes(b.acts)}"]
    if b.pp > 1:
        split = stage_layers(args.layers, b.pp)
        slots = args.layers + 2
        listed = ", ".join(map(str, split)) if b.pp <= 4 else \
            f"{split[0]}, {split[1]}, ..., {split[-2]}, {split[-1]}"
        out.append(f"  {args.layers} layers + embedding + head = {slots} slots over {b.pp} "
                   f"stages, at most ceil({slots}/{b.pp}) = {math.ceil(slots / b.pp)}:")
        out.append(f"     layers {listed}; stage {b.busiest[0]} holds the most: "
                   f"{b.busiest[1]} layers × {b.busiest[2]} microbatches in flight")
    # one degree less of each: why the search did not stop there (it tries less first)
    index = {(r.tp, r.cp, r.pp): r for r in rows}
    for what, less in (("TP", (b.tp // 2, b.cp, b.pp)), ("PP", (b.tp, b.cp, b.pp // 2)),
                       ("CP", (b.tp, b.cp // 2, b.pp))):
        if less in index:
            r = index[less]
            out.append(f"  less {what}: {r.name} {why_not(r)}" + " (PP splits weights, not "
                       "activations)" * (what == "PP" and r.status == "over"))
    if b.ep > 1:
        r = evaluate_layout(args, psi, b.tp, b.cp, b.pp, b.ep // 2)
        out.append(f"  less EP: {r.name} holds {fmt_bytes(r.total)} (experts ÷ {r.ep}; "
                   f"all-to-all {fmt_bytes(r.sent['EP'])} instead of {fmt_bytes(b.sent['EP'])})")
    ddp = sum(args.state_bytes) * psi + b.acts
    if b.tp == b.pp == b.cp == 1 and args.zero and ddp > args.gpu_mem * 1e9:
        out.append(f"  no model parallelism: {_zero_label(args).split(':')[0]} is enough (DDP "
                   f"would need {fmt_bytes(ddp)})")
    return out


def _step2_batch(args, b):
    """DP replicas, microbatches per step, the bubble they leave, the traffic per GPU."""
    used = b.m * args.seq * args.micro_batch * b.dp
    out = ["step 2 - reach the global batch with DP:",
           f"  dp = {args.gpus}/({b.tp}·{b.cp}·{b.pp}) = {b.dp} replicas, each runs m "
           f"microbatches per step (gradient accumulation):",
           f"  m = {args.tokens:,} tokens / ({args.seq} seq × {args.micro_batch} × {b.dp} "
           f"dp) = {b.m}" + f" (rounded down: {used:,} tokens)" * (used != args.tokens)]
    # more microbatches per pipeline shrink the bubble: a bigger batch, or fewer replicas
    if b.pp > 1:
        out.append(f"  1F1B bubble (pp−1)/(m+pp−1) = {b.pp - 1}/{b.m + b.pp - 1} = "
                   f"{b.bubble:.0%}; interleaving v stages per GPU divides it by about v")
    # the bytes, not yet the seconds: --gpu prices them (predict_layout)
    s = {k: fmt_bytes(v) for k, v in b.sent.items()}
    out.append(f"  sent per GPU and step: TP {s['TP']}{' (NVLink)' * (b.tp > 1)}, CP "
               f"{s['CP']}, PP {s['PP']}, DP {s['DP']} "
               f"({'all-reduce' if args.zero == 0 else 'RS + AG'} over {b.dp * b.cp})"
               + f", EP {s['EP']} (all-to-all over {b.ep})" * (b.ep > 1))
    return out


# ----------------------------------------------------------------------------------------
# Time and money (parallelism/cost_model.py): each layout's step in seconds, MFU and $

def cost_gpu(args):
    """The GPU the layouts are timed on, or None when no cost flag asks for time (then the
    plan prints exactly what it printed before the cost model: memory and bytes only)."""
    if not 0 < args.gemm_efficiency <= 1 or args.virtual_stages < 1:
        raise UserError(f"--gemm-efficiency must be in (0, 1] and --virtual-stages ≥ 1, got "
                        f"{args.gemm_efficiency}, {args.virtual_stages}")
    bad = set(hidden_dims(args)) - {"TP", "CP", "PP", "DP", "EP"}
    if bad:
        raise UserError(f"--hide takes TP, CP, PP, DP, EP separated by commas, got {args.hide!r}")
    # a price, a run length or a ranking by time all need seconds: they imply a GPU
    asked = args.price is not None or args.tokens_total or args.rank_by == "time"
    if args.gpu is None and not asked:
        return None
    return gpu(args.gpu or "H100", args.price)


def hidden_dims(args):
    """--hide DP,pp -> ["DP", "PP"]: the dimensions a user says run under compute."""
    return [d.strip().upper() for d in args.hide.split(",") if d.strip()]


def attention_width(args):
    """The d of attention's 12·L·d·s: the heads' width, h for GQA; MLA: the mean of the
    query-key and value widths, H·(d_nope + d_R + d_v)/2."""
    if not args.kv_lora_rank:
        return args.hidden
    return args.heads * (args.qk_nope_dim + args.qk_rope_dim + args.v_head_dim) / 2


def flops_per_token(args, psi, recompute):
    """cost_model.train_flops_per_token for the shape: Ψ = the parameters one token touches
    (MoE: the active ones), less the embedding (a lookup: model.py's flops_per_token)."""
    counts = param_counts(args)
    active = psi * counts["active"] / counts["total"] - args.vocab * args.hidden
    return train_flops_per_token(active, args.layers, args.hidden, args.seq, recompute,
                                 attention_width(args))


def predict_layout(args, psi, r, g, a2a_scale=1.0, compute_share=1.0):
    """Layout r's optimizer step on GPU g: its collectives priced α–β on NVLink or
    InfiniBand, hidden as this repo's code hides them (cost_model.repo_overlap) plus the
    --hide dimensions, the bubble of --schedule. a2a_scale: the share of the EP bytes that
    cross InfiniBand; compute_share: the share of the GPU left to matmuls (DeepSeek-V3
    gives 20 of 132 SMs to communication). -> cost_model.StepPrediction."""
    # Seconds per dimension, each collective alone on its link: the dimensions do not slow
    # each other down here (TP on NVLink and DP on IB mostly use different links anyway)
    comm = dict.fromkeys(("TP", "CP", "PP", "DP", "EP"), 0.0)
    for c in layout_collectives(args, psi, r.tp, r.cp, r.pp, r.dp, r.m, r.ep):
        seconds = c.calls * collective_seconds(c.op, c.payload, c.ranks, link_of(g, c.scope))
        comm[c.dim] += seconds * (a2a_scale if c.dim == "EP" else 1.0)
    model = flops_per_token(args, psi, "none")
    # ring attention computes a block while the next travels: its cover is attention's share
    attention = train_flops_per_token(0, args.layers, args.hidden, args.seq, "none",
                                      attention_width(args)) / model
    # --zero 0 is DDP (its buckets overlap the last backward); ZeRO-1..3 block (repo_overlap)
    hidden = repo_overlap("ddp" if args.zero == 0 else f"zero{args.zero}", r.m, attention)
    hidden.update(dict.fromkeys(hidden_dims(args), 1.0))
    # every GPU does 1/gpus of the step's FLOPs: TP, CP and PP split a replica's work evenly,
    # DP and EP split the tokens (uniform routing; the planner balances stages by parameters)
    tokens = r.m * args.seq * args.micro_batch * r.dp       # per step, all GPUs
    work = StepWork(tokens * model / args.gpus,
                    tokens * flops_per_token(args, psi, args.recompute) / args.gpus,
                    bubble_fraction(r.pp, r.m, args.schedule, args.virtual_stages), comm, hidden)
    return predict_step(work, g, args.gemm_efficiency * compute_share)


def _time_columns(args, g, costs):
    """The candidates table's time and money, appended to its rows: step s, MFU, $ per
    step, or $ for the whole run with --tokens-total (a layout with a larger dp and so a
    smaller m rounds the batch down differently: its steps are counted from its own
    tokens per step)."""
    run = parse_quantity(args.tokens_total, "--tokens-total") if args.tokens_total else None
    def cells(r):            # a layout without a microbatch to run was not timed: blank
        p = costs.get((r.tp, r.cp, r.pp, r.ep))
        if p is None:
            return " " * 28
        # every GPU of the job is paid for the whole step, idle in the bubble or not
        dollars = p.step * args.gpus * g.price_per_hour / 3600
        if run:                                 # × steps: the run's tokens / tokens per step
            dollars *= run / (r.m * args.seq * args.micro_batch * r.dp)
        money = f"{dollars / 1e6:>10.2f}M" if run else f"{dollars:>11,.0f}"
        return f"{p.step:>9.2f}{p.mfu:>8.1%}{money}"
    title = f" |{'step s':>9}{'MFU':>8}{'$ per run' if run else '$ / step':>11}"
    return title, cells


def _cost_lines(args, g, pick, p, best, costs):
    """What the time of the picked layout is made of, and what the run costs."""
    exposed = ", ".join(f"{d} {s:.2f} s" for d, s in p.exposed.items() if s >= 0.005) or "none"
    tokens = pick.m * args.seq * args.micro_batch * pick.dp
    hide = ",".join(hidden_dims(args)) or "none"
    out = [f"time on {g.name} (parallelism/cost_model.py: matmuls at {args.gemm_efficiency:g} of "
           f"{g.peak_flops / 1e12:.0f} TFLOP/s, α–β links, --hide {hide}, {args.schedule}"
           f"{f' v={args.virtual_stages}' * (args.virtual_stages > 1)}):",
           f"  compute {p.compute:.2f} s + exposed communication ({exposed}), ÷ (1 − bubble "
           f"{p.bubble:.0%}) = step "
           f"{p.step:.2f} s: MFU {p.mfu:.1%}, {p.flops_per_s / 1e12:.0f} TFLOP/s per GPU",
           f"  ${g.price_per_hour:.2f}/GPU-hour × {args.gpus} GPUs: "
           f"${p.step * args.gpus * g.price_per_hour / 3600:,.2f} per step of {tokens:,} tokens"]
    if args.tokens_total:
        total = parse_quantity(args.tokens_total, "--tokens-total")
        c = run_cost(p.step, args.gpus, tokens, total, g.price_per_hour)
        out.append(f"  {total / 1e12:g}T tokens: {c.steps:,.0f} steps, {c.gpu_hours / 1e6:.2f}M "
                   f"GPU-hours, ${c.dollars / 1e6:.2f}M, {c.steps * p.step / 86400:.0f} days")
    # --rank-by time: how much the cheat sheet's memory-first pick leaves on the table
    if best is not None and best is not pick:
        b = costs[(best.tp, best.cp, best.pp, best.ep)]
        out.append(f"  the cheat sheet's pick {best.name}: step {b.step:.2f} s; fastest that "
                   f"fits: {pick.name}, {b.step / p.step:.2f}× faster")
    return out


def plan(args):
    """The cheat sheet's three steps for args (see the header), as text; with a GPU, each
    layout's time and money too, and with --rank-by time the fastest layout that fits."""
    if args.published:
        return "\n".join(published_table())
    psi, shape, rows, best = plan_layouts(args)
    g = cost_gpu(args)
    # every layout with a microbatch to run is timed (those that do not fit too: the table
    # shows what memory costs in seconds); keyed by its degrees
    costs = {(r.tp, r.cp, r.pp, r.ep): predict_layout(args, psi, r, g)
             for r in rows if g and r.m >= 1}
    pick, shown = best, _shown(rows, best)
    if g and args.rank_by == "time":          # the fastest that fits, not the first
        fits = sorted((r for r in rows if r.status == "fits"),
                      key=lambda r: costs[(r.tp, r.cp, r.pp, r.ep)].step)
        pick, shown = (fits[0] if fits else None), (fits[:10] or shown)
    by_time = "order of predicted step time, the layouts that fit"
    out = _assumptions(args, psi, shape) + _candidates(
        shown, pick, _time_columns(args, g, costs) if g else None,
        by_time if g and args.rank_by == "time" else "the cheat sheet's order")
    out.append("step 1 - fit: " + ("PP first, TP last (MoE: TP would not split the "
                                   "experts), then CP" if args.experts else
                                   "TP inside a node first, then PP across nodes, then CP"))
    per = sum(args.state_bytes)
    out.append(f"  one replica holds {per:g} B/param × Ψ = {fmt_bytes(per * psi)}; one layer's "
               f"activations at tp 1, cp 1: {fmt_bytes(activation_bytes_per_layer(args, 1, 1))}")
    if pick is None:
        return "\n".join(out + _nothing_fits(args, rows, shown))
    out += _step1_fit(args, psi, rows, pick) + _step2_batch(args, pick)
    if g:
        out += _cost_lines(args, g, pick, costs[(pick.tp, pick.cp, pick.pp, pick.ep)], best,
                           costs)
    out.append(f"step 3 - layout: {pick.name}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------
# `python parallel.py plan`'s knobs, a row each (core/cli.py makes the flags). Its parser
# uses argparse's plain formatter: each help states its default itself.
PLAN_KNOBS = [
    knob("--params", None, "parameter count Ψ: 405B, 8.03B, 405e9 (default: from the shape)"),
    knob("--layers", 32, "layers (default 32: the Playbook's 7B)"),
    knob("--hidden", 4096, "hidden size h (default 4096)"),
    knob("--heads", int, "attention heads (default hidden/128)"),
    knob("--kv-heads", int, "key/value heads (default 8 as in Llama 3, or --heads if 8 does "
         "not divide them)"),
    knob("--vocab", 128256, "vocabulary (default 128256, Llama 3)"),
    knob("--ffn", int, "SwiGLU width (default 8h/3 rounded up to 256, Llama's rule)"),
    knob("--seq", 4096, "tokens per sequence (default 4096)"),
    knob("--gpus", 8, "GPUs in all (default 8)"),
    knob("--gpu-mem", 80.0, "GB (decimal) per GPU (default 80)"),
    knob("--gpus-per-node", 8, "NVLink island, TP's limit (default 8)"),
    knob("--global-batch-tokens", "16M", "tokens per optimizer step, K/M/G binary (default "
         "16M = 16·2^20, Llama 3's)"),
    knob("--micro-batch", 1, "sequences per microbatch (default 1)"),
    knob("--recompute", "selective", "activation recomputation (default selective)",
         choices=("none", "selective", "full")),
    knob("--zero", 2, "ZeRO stage over dp·cp (default 2, Llama 3's FSDP; 0 = DDP)",
         choices=(0, 1, 2, 3)),
    knob("--state-bytes", "2,2,12", "bytes per parameter of weights, gradients, optimizer "
         "(default 2,2,12: bf16, bf16, fp32 master + Adam; DeepSeek-V3: 2,4,8 = fp32 "
         "gradients, bf16 Adam moments)"),
]

MOE_PLAN_KNOBS = [
    knob("--experts", 0, "routed experts per MoE layer (default 0: dense)"),
    knob("--shared-experts", 0, "always-on experts (default 0)"),
    knob("--top-k", 8, "routed experts per token (default 8)"),
    knob("--expert-ffn", int, "SwiGLU width of one expert (default --ffn)"),
    knob("--dense-layers", 0, "leading layers with a dense MLP of --ffn (default 0; "
         "DeepSeek-V3: 3)"),
    knob("--ep", 1, "expert parallelism inside the dp·cp ranks (default 1); with experts the "
         "search tries TP last"),
    knob("--kv-lora-rank", 0, "MLA latent d_c (default 0: GQA)"),
    knob("--q-lora-rank", 0, "MLA query latent (default 0)"),
    knob("--qk-rope-dim", 64, "MLA rope part d_R (default 64)"),
    knob("--qk-nope-dim", 128, "MLA position-free part of a query/key head (default 128)"),
    knob("--v-head-dim", 128, "MLA value head (default 128)"),
]


# The cost model's knobs. None of them changes the memory plan; without --gpu, --price,
# --tokens-total or --rank-by time the output is the memory planner's alone. The overlap
# knobs (--hide, --schedule, --virtual-stages) describe a system this repo does not run:
# Llama 3's FSDP and interleaved pipeline, DeepSeek-V3's DualPipe.
COST_PLAN_KNOBS = [
    knob("--gpu", str, "time each layout on this GPU's data sheet: H100, H800, H200, A100 "
         "(not given: memory only, or H100 when --price, --tokens-total or --rank-by time "
         "ask for time)"),
    knob("--price", float, "$ per GPU-hour (not given: the GPU table's $2, DeepSeek-V3's)"),
    knob("--tokens-total", str, "tokens of the whole run (15.6T, 14.8e12): steps, GPU-hours, "
         "days and $ (not given: per step)"),
    knob("--rank-by", "memory", "memory: the cheat sheet's order and pick; time: the layouts "
         "that fit, fastest first, the fastest picked (default memory)",
         choices=("memory", "time")),
    knob("--gemm-efficiency", GEMM_EFFICIENCY, "achieved fraction of the matmul peak "
         f"(default {GEMM_EFFICIENCY}: an assumption, not fitted)"),
    knob("--schedule", "1f1b", "pipeline schedule of the bubble (default 1f1b, = GPipe's)",
         choices=("1f1b", "dualpipe")),
    knob("--virtual-stages", 1, "interleaved 1F1B, stages per GPU v: bubble ÷ about v "
         "(default 1)"),
    knob("--hide", "", "dimensions whose communication runs under compute, beyond what this "
         "repo's code overlaps: DP,PP (FSDP prefetch, async P2P) or EP,PP (DualPipe) "
         "(default none)"),
    knob("--published", False, "print only Llama 3 405B and DeepSeek-V3 predicted from "
         "data-sheet constants next to their published MFU, GPU-hours and $ (default off)"),
]


def add_plan_arguments(parser):
    """The plan's flags on `parser`: the shape and memory, MoE, then time and money."""
    add_knobs(parser, PLAN_KNOBS)
    add_knobs(parser, MOE_PLAN_KNOBS, "mixture of experts (DeepSeekMoE) and latent attention")
    add_knobs(parser, COST_PLAN_KNOBS, "time and money (parallelism/cost_model.py)")


# ----------------------------------------------------------------------------------------
# Two published training runs, predicted from their hardware's data sheets. Each is priced
# twice: with the overlap its paper reports, and as this repo's code would run it.

# The shapes as docs/planner.md plans them, plus the GPU and (V3) the DualPipe schedule
LLAMA3_405B = ("--params 405B --layers 126 --hidden 16384 --heads 128 --kv-heads 8 --ffn "
               "53248 --vocab 128256 --gpu-mem 80 --seq 8192 --gpus 16384 --gpu H100")
DEEPSEEK_V3 = ("--layers 61 --hidden 7168 --heads 128 --vocab 129280 --ffn 18432 --experts 256 "
               "--shared-experts 1 --top-k 8 --expert-ffn 2048 --dense-layers 3 --kv-lora-rank "
               "512 --q-lora-rank 1536 --qk-rope-dim 64 --qk-nope-dim 128 --v-head-dim 128 "
               "--seq 4096 --gpu-mem 80 --gpus 2048 --global-batch-tokens 62914560 "
               "--state-bytes 2,6,8 --zero 1 --ep 64 --gpu H800 --schedule dualpipe")


@dataclass(frozen=True)
class PublishedRun:
    """A published training run: its shape and layout as planner flags, what its paper
    reports, and the flags and factors of the overlap the paper says it achieved."""
    name: str
    argv: str               # the shape and layout as `parallel.py plan` flags
    layout: tuple           # (tp, cp, pp, ep) as published
    tokens_total: float
    mfu: object             # published MFU, or None
    gpu_hours: float
    dollars: object         # published $, or None
    paper: str              # the flags of the paper's overlap
    a2a_scale: float = 1.0  # as published: the share of the EP bytes on InfiniBand
    compute_share: float = 1.0   # as published: the share of the SMs left to matmuls


PUBLISHED = [
    # Llama 3 paper, Table 4 (TP 8, CP 1, PP 16, DP 128 at 8K, 16M tokens per step, 41% BF16
    # MFU) and §3.1 (15.6T tokens); Llama 3.1 model card: 30.84M H100 GPU-hours for the 405B
    # (all of pre-training: the 128K stage, restarts and downtime included). Overlap: FSDP's
    # gathers and reduce-scatters and PP's point-to-point run under compute; TP's do not.
    PublishedRun("Llama 3 405B", LLAMA3_405B, (8, 1, 16, 1), 15.6e12, 0.41, 30.84e6, None,
                 "--hide DP,PP"),
    # DeepSeek-V3 report: §3.2 (PP 16, EP 64 over 8 nodes, ZeRO-1 DP, no TP, DualPipe),
    # §4.2 (15,360 sequences of 4,096 tokens per step), Table 1 (2.664M H800 GPU-hours of
    # pre-training on 14.8T tokens = $5.328M at $2; 2.788M, $5.576M in all). DualPipe hides
    # the all-to-all and PP's sends (§3.2.1) on 20 of the H800's 132 SMs (§3.2.2); a token
    # reaches at most 4 nodes, each once over IB (§2.1.2: 4 of its 8 expert copies), and
    # is dispatched in FP8 (§3.3: 3/4 of the bf16 bytes over the four passes).
    PublishedRun("DeepSeek-V3", DEEPSEEK_V3, (1, 1, 16, 64), 14.8e12, None, 2.664e6, 5.328e6,
                 "--hide EP,PP", a2a_scale=4 / 8 * 3 / 4, compute_share=112 / 132),
]


@dataclass
class PublishedRow:
    """One published run, predicted one way ("as published": the paper's overlap, its
    a2a_scale and compute_share; "this repo's": only what this repo's code overlaps)."""
    run: PublishedRun
    how: str                # "as published" or "this repo's"
    layout: PlannedLayout
    predicted: object       # cost_model.StepPrediction
    cost: object            # cost_model.RunCost at the GPU table's price
    flops_per_token: float  # model FLOPs (MFU's)
    gpu: object             # cost_model.Gpu
    interleaved: object     # the StepPrediction at v = 2 stages per GPU, or None


def _predict_published(parser, run, extra, scale, share):
    """One published run under `extra` flags -> (args, Ψ, its layout, GPU, prediction)."""
    args = parser.parse_args(f"{run.argv} {extra}".split())
    psi = check_plan_args(args)[0]
    # the published layout itself, not the planner's pick (the same: test_parallel_plan.py)
    r = evaluate_layout(args, psi, *run.layout)
    g = cost_gpu(args)
    return args, psi, r, g, predict_layout(args, psi, r, g, scale, share)


def published_runs():
    """Each published run predicted twice: with its paper's overlap, and with only what
    this repo's code overlaps (cost_model.repo_overlap). -> [PublishedRow]."""
    parser = ArgumentParser()
    add_plan_arguments(parser)
    rows = []
    for run in PUBLISHED:
        for how, extra, scale, share in (("as published", run.paper, run.a2a_scale,
                                          run.compute_share), ("this repo's", "", 1.0, 1.0)):
            args, psi, r, g, p = _predict_published(parser, run, extra, scale, share)
            # what interleaving would buy a 1F1B pipeline: Llama 3 interleaves, v unstated
            v2 = _predict_published(parser, run, f"{extra} --virtual-stages 2", scale,
                                    share)[-1] if args.schedule == "1f1b" and r.pp > 1 \
                and how == "as published" else None
            tokens = r.m * args.seq * args.micro_batch * r.dp
            rows.append(PublishedRow(run, how, r, p, run_cost(
                p.step, args.gpus, tokens, run.tokens_total, g.price_per_hour),
                flops_per_token(args, psi, "none"), g, v2))
    return rows


def _ratio(pred, pub, fmt):
    """Predicted, published and predicted/published, or dashes where nothing is published
    (Llama 3 states no $; DeepSeek-V3 no MFU: its notes line gives the MFU its hours imply)."""
    if pub is None:
        return f"{fmt(pred)}{'—':>7}{'—':>6}"
    return f"{fmt(pred)}{fmt(pub)}{pred / pub:>6.2f}"


def published_table():
    """`parallel.py plan --published`: the prediction beside the published figures."""
    rows = published_runs()
    # the constants are the data sheets' and the papers'; the one free parameter, the
    # matmul efficiency, is the module's labelled default, the same for both runs
    out = [f"published runs predicted from data sheets (parallelism/cost_model.py): matmuls at "
           f"{GEMM_EFFICIENCY:g} of peak (assumed, not fitted),",
           "α–β links (NVLink half its two-way figure, IB 50 GB/s per GPU), $2 per GPU-hour",
           f"  {'run':<14}{'overlap':<13}{'step s':>7}{'bubble':>7}{'exposed':>8} |"
           f"{'MFU':>6}{'pub':>7}{'ratio':>6} |{'GPU-h':>7}{'pub':>7}{'ratio':>6} |"
           f"{'$':>7}{'pub':>7}{'ratio':>6}"]
    for row in rows:            # MFU at the GPU's peak; GPU-hours and $ for the whole run
        p, c = row.predicted, row.cost
        out.append(f"  {row.run.name if row.how == 'as published' else '':<14}{row.how:<13}"
                   f"{p.step:>7.2f}{p.bubble:>7.0%}{sum(p.exposed.values()):>7.2f}s |"
                   + _ratio(p.mfu, row.run.mfu, lambda x: f"{x:>7.0%}")
                   + " |" + _ratio(c.gpu_hours, row.run.gpu_hours,
                                   lambda x: f"{x / 1e6:>6.2f}M")
                   + " |" + _ratio(c.dollars, row.run.dollars, lambda x: f"{x / 1e6:>5.2f}M"
                                   .rjust(7)))
    return out + _published_notes(rows)


def _published_notes(rows):
    """Where each prediction's time goes, and what the published figures imply."""
    out = []
    for row in rows:
        # only the exposed communication costs time: the rest ran under compute
        p, r, run = row.predicted, row.layout, row.run
        exposed = ", ".join(f"{d} {v:.2f}" for d, v in p.exposed.items() if v >= 0.005)
        if row.how == "as published":
            # MFU the published GPU-hours imply, at our FLOP count: every hour of the run
            # (downtime included) counted as if it trained at one steady rate
            implied = run.tokens_total * row.flops_per_token / (
                run.gpu_hours * 3600 * row.gpu.peak_flops)
            out += [f"{run.name}: {r.name}, m = {r.m}, {row.flops_per_token / 1e9:.0f} GFLOP "
                    f"per token; its published GPU-hours imply {implied:.0%} MFU at that count",
                    f"  {row.how} ({run.paper}): compute {p.compute:.2f} s, exposed "
                    f"{exposed or 'nothing'} s"]
        else:
            out.append(f"  {row.how} (nothing hidden but DDP's buckets and ring attention): "
                       f"exposed {exposed or 'nothing'} s")
        if row.interleaved:
            v2 = row.interleaved
            out.append(f"  interleaved 1F1B at v = 2 (the paper's v is not published): bubble "
                       f"{v2.bubble:.0%}, step {v2.step:.2f} s, MFU {v2.mfu:.0%}")
    return out + [
        "the gap: a prediction above the published MFU (below its GPU-hours) is time the model "
        "does not count:",
        "  non-matmul kernels, small expert GEMMs, routing, imbalance, restarts and downtime "
        "(in the GPU-hours);",
        "  one below is overlap or speed it does not credit (interleaving, matmuls above "
        f"{GEMM_EFFICIENCY:g} of peak)."]


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nplanner.py is a library: the layout planner runs as `python parallel.py plan --help`.")
