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

Arithmetic only, no process group: a part of parallel.py (choosing a layout, not running
one); `python parallel.py plan` is its command line.
"""
import math
from dataclasses import dataclass

from core.cli import add_knobs, fmt_bytes, knob, require_at_least_one
from core.errors import UserError

TP_PASSES = {"none": 2, "selective": 2, "full": 3}        # forward, backward, recompute
CP_LAPS = {"none": 3, "selective": 3, "full": 4}          # K/V forward, K/V + dK/dV backward


def parse_quantity(text, flag, binary=False):
    """'405B', '8.03B', '405e9' -> an int. binary: K, M, G = 2^10, 2^20, 2^30 (token counts:
    Llama 3's "16M tokens" per step is 16·2^20)."""
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
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not a whole number of nodes of "
                        f"--gpus-per-node {args.gpus_per_node}")
    args.tokens = parse_quantity(args.global_batch_tokens, "--global-batch-tokens", True)
    if args.tokens < args.seq * args.micro_batch:
        raise UserError(f"--global-batch-tokens {args.tokens:,} is less than one microbatch "
                        f"(--seq {args.seq} × --micro-batch {args.micro_batch})")
    check_moe_args(args)
    shape = param_counts(args)["total"]
    return (parse_quantity(args.params, "--params") if args.params else shape), shape


def check_moe_args(args):
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
    moe_layers = args.layers - args.dense_layers if args.experts else 0
    expert = 3 * h * args.expert_ffn
    per_layer = attention_params(args) + 2 * h
    dense = (args.layers - moe_layers) * 3 * h * args.ffn
    moe = moe_layers * (args.experts * h + args.shared_experts * expert)
    routed = moe_layers * args.experts * expert
    total = args.layers * per_layer + dense + moe + routed + 2 * args.vocab * h + h
    active = total - moe_layers * (args.experts - args.top_k) * expert
    return dict(total=total, active=active, routed=routed, moe_layers=moe_layers)


def stage_layers(layers, pp):
    """Layers on each pipeline stage. Llama 3 took one layer off the first and the last
    stage to make room for the embedding and the output head. Generalised: L + 2 slots
    split as evenly as possible, at most ceil((L+2)/pp) per stage (the larger shares on the
    later stages, which hold fewer microbatches); the embedding takes the first slot, the
    head the last. 126 layers on 16 stages: 7, 8 × 14, 7."""
    base, extra = divmod(layers + 2, pp)
    slots = [base + (i >= pp - extra) for i in range(pp)]
    slots[0] -= 1
    slots[-1] -= 1
    return slots


def activation_bytes_per_layer(args, tp, cp):
    """One layer, one microbatch, one GPU: the Korthikanti rows above."""
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
    def sharded(stage, count):
        return count if args.zero < stage else dense / n + routed / n_e
    return (wb * sharded(3, dense + routed), gb * sharded(2, dense + routed),
            ob * sharded(1, dense + routed))


def all_to_all_bytes(args, tokens, ep):
    """Expert parallelism, one MoE layer and microbatch, per GPU (GShard; DeepSeek-V3
    §3.2.2): every token's k copies are dispatched to their experts and combined back, each
    way (ep−1)/ep of them to other GPUs under uniform routing, forward and backward:
    4 · tokens · k · h · 2 bytes · (ep−1)/ep (bf16; V3 dispatches in FP8: 3/4 of it)."""
    return 4 * tokens * args.top_k * args.hidden * 2 * (ep - 1) / ep


def evaluate_layout(args, psi, tp, cp, pp, ep=1):
    dp = args.gpus // (tp * cp * pp)
    m = args.tokens // (args.seq * args.micro_batch * dp)
    counts = param_counts(args)
    routed = psi * counts["routed"] / counts["total"]   # the experts' share of Ψ
    shard, n = (psi - routed) / (tp * pp), dp * cp       # TP slices the dense part only
    expert_shard, n_e = routed / (pp * ep), dp * cp // ep
    weights, grads, optimizer = held_bytes(args, shard, expert_shard, n, n_e)
    layers = stage_layers(args.layers, pp)
    worth, stage = max((k * min(pp - i, m), i) for i, k in enumerate(layers))
    acts = worth * activation_bytes_per_layer(args, tp, cp)
    tokens = args.seq // cp * args.micro_batch              # on this GPU, per microbatch
    kv_local = max(args.kv_heads // tp, 1) * args.hidden // args.heads
    passes = max(layers) * m                                # layer passes per step
    wb, gb, _ = args.state_bytes
    dp_bytes = gb + wb * (2 if args.zero == 3 else 1)        # RS grads + AG weights (×2)
    sent = {"TP": TP_PASSES[args.recompute] * 4 * (tp - 1) / tp * tokens * args.hidden * 2
            * passes,
            "CP": CP_LAPS[args.recompute] * (cp - 1) * 2 * tokens * kv_local * 2 * passes,
            "PP": 2 * m * tokens * args.hidden * 2 / tp if pp > 1 else 0,
            "DP": dp_bytes * (shard * (n - 1) / n + expert_shard * (n_e - 1) / max(n_e, 1)),
            "EP": all_to_all_bytes(args, tokens, ep) * passes * counts["moe_layers"]
            / args.layers}
    total = weights + grads + optimizer + acts
    status = ("batch < dp" if m < 1 else "over" if total > args.gpu_mem * 1e9
              else "m < pp" if m < pp else "fits")
    return PlannedLayout(tp, cp, pp, dp, m, weights, grads, optimizer, acts,
                         (stage, layers[stage], min(pp - stage, m)), sent, status, ep)


def powers_of_two(limit):
    return [2**k for k in range(int(math.log2(limit)) + 1)]


def plan_layouts(args):
    """-> (Ψ, Ψ from the shape, every candidate in the cheat sheet's order, the first that
    fits or None). The order IS step 1: least CP, then least PP, then least TP."""
    psi, shape = check_plan_args(args)
    tps = [t for t in powers_of_two(min(args.gpus_per_node, args.gpus))
           if args.gpus_per_node % t == 0 and args.heads % t == 0
           and (args.kv_heads % t == 0 or t % args.kv_heads == 0)]
    cps = [c for c in powers_of_two(args.seq) if c == 1 or args.seq % (2 * c) == 0]  # zigzag
    pps = powers_of_two(args.layers)
    if args.experts:     # MoE: TP last (DeepSeek-V3 trains without it: the experts are not
        order = [(cp, pp, tp) for cp in cps for tp in tps for pp in pps]  # split by TP)
    else:
        order = [(cp, pp, tp) for cp in cps for pp in pps for tp in tps]
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
    return f"has more replicas ({r.dp}) than sequences per step"


def _gb(x):
    return f"{x / 1e9:.1f}" if x < 99.95e9 else f"{x / 1e9:.0f}"


def _zero_label(args):
    return ["DDP over dp·cp: nothing sharded", "ZeRO-1 over dp·cp: optimizer sharded",
            "ZeRO-2 over dp·cp: optimizer + grads sharded, weights whole (Llama 3's FSDP)",
            "ZeRO-3 over dp·cp: weights, grads and optimizer sharded"][args.zero]


def _assumptions(args, psi, shape):
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
    t, c, p = best.tp, best.cp, best.pp
    less = {(t // 2, c, p), (t, c, p // 2), (t, c, p // 4), (t, c // 2, p), (t, c // 4, p)}
    return [r for r in rows if (r.tp, r.cp, r.pp) in less] + \
        [r for r in rows[rows.index(best):] if r.status == "fits"][:8]


def _candidates(shown, best):
    dims = ["TP", "CP", "PP", "DP"] + ["EP"] * any(r.ep > 1 for r in shown)
    out = ["candidates, in the cheat sheet's order (GB held | GB sent per step, per GPU):",
           f"  {'tp':>3}{'cp':>4}{'pp':>4}{'dp':>6}{'m':>6}{'weights':>8}{'grads':>6}"
           f"{'optim':>6}{'acts':>6}{'total':>7} |" + "".join(f"{d:>6}" for d in dims)
           + " | bubble"]
    for r in shown:
        held = "".join(f"{_gb(x):>{w}}" for x, w in ((r.weights, 8), (r.grads, 6),
                                                      (r.optimizer, 6), (r.acts, 6),
                                                      (r.total, 7)))
        sent = "".join(f"{_gb(r.sent[k]):>6}" for k in dims)
        out.append(f"{'->' if r is best else '  '}{r.tp:>3}{r.cp:>4}{r.pp:>4}{r.dp:>6}{r.m:>6}"
                   f"{held} |{sent} | {r.bubble:>5.0%}  {r.status}")
    return out


def _nothing_fits(args, rows, shown):
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
    if b.pp > 1:
        out.append(f"  1F1B bubble (pp−1)/(m+pp−1) = {b.pp - 1}/{b.m + b.pp - 1} = "
                   f"{b.bubble:.0%}; interleaving v stages per GPU divides it by about v")
    s = {k: fmt_bytes(v) for k, v in b.sent.items()}
    out.append(f"  sent per GPU and step: TP {s['TP']}{' (NVLink)' * (b.tp > 1)}, CP "
               f"{s['CP']}, PP {s['PP']}, DP {s['DP']} "
               f"({'all-reduce' if args.zero == 0 else 'RS + AG'} over {b.dp * b.cp})"
               + f", EP {s['EP']} (all-to-all over {b.ep})" * (b.ep > 1))
    return out


def plan(args):
    """The cheat sheet's three steps for args (see the header), as text."""
    psi, shape, rows, best = plan_layouts(args)
    shown = _shown(rows, best)
    out = _assumptions(args, psi, shape) + _candidates(shown, best)
    out.append("step 1 - fit: " + ("PP first, TP last (MoE: TP would not split the "
                                   "experts), then CP" if args.experts else
                                   "TP inside a node first, then PP across nodes, then CP"))
    per = sum(args.state_bytes)
    out.append(f"  one replica holds {per:g} B/param × Ψ = {fmt_bytes(per * psi)}; one layer's "
               f"activations at tp 1, cp 1: {fmt_bytes(activation_bytes_per_layer(args, 1, 1))}")
    if best is None:
        return "\n".join(out + _nothing_fits(args, rows, shown))
    out += _step1_fit(args, psi, rows, best) + _step2_batch(args, best)
    out.append(f"step 3 - layout: {best.name}")
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


def add_plan_arguments(parser):
    add_knobs(parser, PLAN_KNOBS)
    add_knobs(parser, MOE_PLAN_KNOBS, "mixture of experts (DeepSeekMoE) and latent attention")


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nplanner.py is a library: the layout planner runs as `python parallel.py plan --help`.")
