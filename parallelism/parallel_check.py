"""
parallelism/parallel_check.py -- how parallel.py is proven and measured: the one-process
reference, the traffic formulas, the ledger, and PyTorch's DTensor tensor parallelism side
by side.

A part of parallel.py, imported one way: parallel.py says how the model is split and trained;
this file says how we know the split is right and what it costs. It needs nothing from
parallel.py but what parallel.py hands it (its Shard: the sliced model, the parameters
this rank trains with their placements, the process groups; the Layout), so a reader of
parallel.py can skip it and a reader of this file sees every assertion in one place.

  1. the reference: the same GPT, seed and global batch on ONE process with model.py's own
     code (dense MoE, full softmax attention, full vocabulary), then the same clipping and
     AdamW; every step (`parallel.py --check`) compares the loss, the gradient norm, every
     gradient and every weight after the optimizer step -- each rank its own slices;
  2. the traffic formulas: the calls and bytes every collective of a step must send, from
     the shapes alone (Megatron-LM, Korthikanti et al. 2022 for sp, the ring for cp, the
     stage boundaries for pp), asserted equal to what meters.comm counted;
  3. the ledger rank 0 prints at the end: measured traffic next to the formulas, the
     activation bytes of one microbatch next to one process's, the model state held;
  4. bench-tp: the hand tensor parallelism next to torch.distributed.tensor.parallel
     (Colwise/RowwiseParallel) on the same weights and data: losses and gradients equal,
     then step time and collectives per step.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallelism import pipeline
from model import GPT
from core.moe import MoE
from core.cli import fmt_bytes
from core.meters import ActivationMeter, comm, model_state_bytes
from core.runtime import print0
from parallelism.ring_attention import ring_traffic_formula


# ----------------------------------------------------------------------------------------
# 1. The single-process reference

class DenseReferenceMoE(MoE):
    """moe.MoE computed densely (every expert on every token, unchosen ones gated by
    zero): slow and obviously right. Holds the original MoE's router, routed experts and
    shared experts (DeepSeekMoE) under the same names, so its parameters line up with the
    split model's by name."""

    def __init__(self, moe: MoE):
        nn.Module.__init__(self)
        self.top_k = moe.top_k
        self.router = moe.router
        self.experts = moe.experts
        self.shared_experts = moe.shared_experts
        self.aux_loss = None
        self.load = None

    def forward(self, x):
        return self.forward_dense(x)


def build_reference(cfg, device):
    """--check's one process: the full model from every rank's seed (GPT(cfg, seed=0)),
    its MoE layers dense."""
    ref = GPT(cfg, seed=0).to(device)
    for block in ref.layers if cfg.n_expert else []:
        block.feed_forward = DenseReferenceMoE(block.feed_forward)
    return ref


def reference_loads(ref, x):
    """The one process's tokens per expert for the step's global batch x: one no-grad
    forward, run before its optimizer step (routing is per token, so these equal the sum
    over its microbatches)."""
    with torch.no_grad():
        ref(x)
    return ref.expert_loads()


def check_expert_bias(step, shard, ref, loads):
    """--check, loss-free balancing: the one process moves its bias by its own loads; every
    MoE layer this rank holds must have seen the same loads and hold the same bias."""
    ref.update_expert_bias(loads)
    for i, block in enumerate(shard.model.layers):
        moe = block.feed_forward
        if moe.load_seen is None:           # another pipeline stage's layer
            continue
        bias = ref.layers[i].feed_forward.router.expert_bias
        same_loads = torch.equal(moe.load_seen, loads[i])
        if not same_loads or not torch.equal(moe.router.expert_bias, bias):
            raise AssertionError(f"step {step}, layer {i}: loads {moe.load_seen.tolist()} / "
                                 f"bias differ from one process's ({loads[i].tolist()})")
    print0(f"CHECK step {step}: every layer's expert loads and loss-free bias equal one "
           f"process's (max |b| {float(bias.abs().max()):.4f})")


def reference_step(ref, layout, x, y):
    """Microbatch m of the reference = microbatch m of every data replica together."""
    replicas = layout.dp * layout.ep
    M = layout.microbatches
    rows = x.shape[0] // replicas
    mb = rows // M
    total = 0.0
    for m in range(M):
        idx = torch.cat([torch.arange(q * rows + m * mb, q * rows + (m + 1) * mb)
                         for q in range(replicas)]).to(x.device)
        _, loss = ref(x[idx], y[idx])
        (loss / M).backward()
        total += loss.item() / M
    return total


def compare(shard, ref, what, tensor_of, atol, rtol=1e-4):
    """Every tensor this rank holds against the matching slice of the reference's.
    tensor_of(p) picks the parameter itself or its gradient. Allowed: atol + rtol times
    the tensor's largest entry -- per tensor, not per element: a gradient is a sum over
    every token of the batch, and summed in another order its small entries (a sum of
    terms that cancel) carry the rounding of its large terms, about 1e-7 of them in fp32.
    Measured: `small`'s embedding gradient 7e-6 apart at step 9 of a tp=2 run, both sums
    right. A wrong sum (a missing all-reduce, a wrong scale) misses by the entries
    themselves."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in shard.params:
        full = tensor_of(ref_params[name])
        mine = tensor_of(p)
        if mine is None and full is None:
            continue
        full = reference_slice(shard, name, full, mine)
        diff = (mine - full).abs().max().item()
        allowed = atol + rtol * full.abs().max().item()
        if not diff <= allowed:                      # (not <=: a NaN fails too)
            raise AssertionError(f"{what} of {name} differs from one process: max |diff| "
                                 f"{diff:.3e} > {allowed:.3e}")
        worst = max(worst, diff)
    return worst


def reference_slice(shard, name, full, local):
    """The part of the reference's tensor `full` that this rank holds as `local` (parameter
    `name`, or its gradient or Adam moment): its tp slice, or all of it."""
    tp_dim = shard.placement[name].tp_dim
    if tp_dim is None:
        return full
    size = local.shape[tp_dim]
    return full.narrow(tp_dim, shard.coords["tp"] * size, size)


@torch.no_grad()
def start_from_reference(shard, ref, optimizer, ref_optimizer):
    """Copy the reference's weights and AdamW moments (this rank's slices) into ours."""
    ref_params = dict(ref.named_parameters())
    for name, p in shard.params:
        full = ref_params[name]
        p.copy_(reference_slice(shard, name, full, p))
        mine, theirs = optimizer.state[p], ref_optimizer.state[full]
        for key in ("exp_avg", "exp_avg_sq"):
            mine[key].copy_(reference_slice(shard, name, theirs[key], p))


def check_step(step, shard, layout, ref, ref_optimizer, batch, ours, grad_clip, lr,
               optimizer):
    """The same step on one process, after ours (whose .grad are still there): loss, norm,
    every gradient, then every weight after both optimizers stepped; then the reference's
    weights and Adam moments are copied into ours, so that every step is checked from the
    same start. ours = (loss, norm); lr: this step's learning rate.

    Why the copy: two correct runs drift apart. Adam moves a coordinate by lr·m/(√v + ε),
    about lr·g/(|g| + ε) on a first step, so a gradient at the level of ε = 1e-8 (a rare
    token's embedding row, say) moves by a fraction of lr that a 1e-9 difference in
    summation order changes by a few percent -- measured: 5% of lr on `small`'s embedding.
    Left to run, the weights drift apart by those amounts, the gradients computed at the
    drifted weights follow, and by step 9 of `parallel.py --tp 2 --check` on `small` the
    gradient norms differed by 1.2e-4 with nothing wrong. From the same start, the weights
    of one step differ by at most a few percent of that step's lr (the tolerance below),
    and a real error (a parameter not stepped, a wrong scale, a missing sum) still misses
    by whole lr's or by the gradient itself, on the step it happens. The step counts are
    not copied: each optimizer keeps its own, so a shard that skipped a step is still
    caught by its bias correction.

    Loss-free balancing: the biases must have moved alike too (check_expert_bias), by the
    loads the one process routes with the weights it had BEFORE its optimizer step."""
    x, y = batch
    loss, norm = ours
    cfg = shard.model.config
    loss_free = cfg.n_expert and cfg.moe_balance == "loss_free"
    loads = reference_loads(ref, x) if loss_free else None
    ref_optimizer.zero_grad(set_to_none=True)
    ref_loss = reference_step(ref, layout, x, y)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip).item()
    grad_diff = compare(shard, ref, "gradient", lambda p: p.grad, atol=1e-6)
    ref_optimizer.step()
    weight_atol = 1e-5 + 0.05 * lr
    weight_diff = compare(shard, ref, "weight", lambda p: p.detach(), atol=weight_atol)
    if abs(loss - ref_loss) > 1e-5 or abs(norm - ref_norm) > 1e-4 * max(1, ref_norm):
        raise AssertionError(f"step {step}: loss {loss:.6f} / grad norm {norm:.6f} "
                             f"vs one process {ref_loss:.6f} / {ref_norm:.6f}")
    start_from_reference(shard, ref, optimizer, ref_optimizer)
    idle = sum(m.idle_experts for m in shard.expert_layers)
    idle_note = f" ({idle} experts got no token so far)" if idle else ""
    print0(f"CHECK step {step} {layout}: loss {loss:.6f} = {ref_loss:.6f}, every "
           f"gradient (max |diff| {grad_diff:.1e}) and weight ({weight_diff:.1e}, "
           f"tolerance {weight_atol:.1e}) equal one process" + idle_note)
    if loss_free:
        check_expert_bias(step, shard, ref, loads)


# ----------------------------------------------------------------------------------------
# 2. The traffic formulas. Payload = the bytes handed to each call (the "message size" of
# the formulas); meters.comm counts the same.

def expected_traffic(shard, layout, cfg, batch_size, seq_len):
    """(op, group) -> (calls, payload bytes) per step on this rank, from the shapes alone.
    The terms, per microbatch (b rows, s = seq/cp tokens, h = width, 4-byte fp32):
      tp       4 all-reduces of b·s·h per layer (2 forward g, 2 backward f), + 1 for the
               embedding (g) and 1 for the head's input (f), + 3 of b·s numbers in the
               vocabulary-parallel cross-entropy;
      tp + sp  the same bytes as 4 all-gathers of b·s·h/t and 4 reduce-scatters of b·s·h
               per layer, + 2 all-gathers per layer in backward to rebuild the inputs that
               were saved as shards; norm-weight gradients all-reduced once per step;
      cp       ring attention: ring_traffic_formula (K/V blocks round the ring);
      pp       one b·s·h activation forward and one gradient backward per stage boundary;
      data     the gradients once per step (dp, ep and cp ranks sum them)."""
    M = layout.microbatches
    t = layout.tp
    c = layout.cp
    b = batch_size // (layout.dp * layout.ep * M)     # rows of one microbatch on a rank
    s = seq_len // c                                  # tokens of a sequence on a rank
    f32 = 4
    act = b * s * cfg.n_embd * f32                    # one (b, s, h) activation
    held = sorted(shard.stages)
    n_stages = pipeline.stage_count(layout.schedule, layout.pp)
    first = int(0 in held)                            # holds the embedding
    last = int(n_stages - 1 in held)                  # holds the head and the loss
    layers = sum(len(shard.stages[k].layers) for k in held)
    out = {}

    def add(op, group, calls, payload):
        if calls:
            old_calls, old_payload = out.get((op, group), (0, 0))
            out[(op, group)] = (old_calls + calls, old_payload + payload)

    if t > 1:
        regions = M * (4 * layers + first + last)     # f/g pairs entered and left
        if layout.sp:
            regathers = M * (2 * layers + last)       # backward: shards gathered again
            add("all_gather", "tp", regions + regathers, (regions + regathers) * act // t)
            add("reduce_scatter", "tp", regions, regions * act)
            norms = [p for name, p in shard.params if shard.placement[name].sequence_partial]
            add("all_reduce", "tp", 1, sum(p.numel() * f32 for p in norms))
        else:
            add("all_reduce", "tp", regions, regions * act)
        add("all_reduce", "tp", 3 * M * last, 3 * M * last * b * s * f32)   # the loss
    if c > 1:
        calls, payload = ring_traffic_formula(b, cfg.n_kv_head // t, s, cfg.head_dim, c)
        add("send", "cp", M * layers * calls, M * layers * payload)
        add("recv", "cp", M * layers * calls, M * layers * payload)
    if layout.pp > 1:
        _add_pipeline_traffic(add, shard, layout, n_stages, M, act // (t if layout.sp else 1))
    _add_gradient_traffic(add, shard, layout, cfg, M, layers)
    add("all_reduce", "world", 1, 8)                     # the global gradient norm
    return out


def _add_pipeline_traffic(add, shard, layout, n_stages, M, boundary):
    """One activation forward and one gradient backward for every stage boundary whose
    neighbour stage lives on another rank (DualPipeV's two stages of a rank may touch)."""
    where = pipeline.stage_ranks(layout.schedule, layout.pp)
    me = shard.coords["pp"]
    sends = 0
    for k in shard.stages:
        sends += k + 1 < n_stages and where[k + 1] != me
        sends += k > 0 and where[k - 1] != me
    add("send", "pp", M * sends, M * sends * boundary)
    add("recv", "pp", M * sends, M * sends * boundary)


def _add_gradient_traffic(add, shard, layout, cfg, M, layers):
    """The data-parallel gradient all-reduces (dense over dp·ep·cp, experts over dp·cp) and
    the MoE balance-loss statistics (3 all-reduces per MoE layer and microbatch)."""
    f32 = 4
    c = layout.cp
    dense = [p for name, p in shard.params if not shard.placement[name].expert]
    experts = [p for name, p in shard.params if shard.placement[name].expert]
    if layout.dp * layout.ep * c > 1:
        add("all_reduce", "data", 1, sum(p.numel() * f32 for p in dense))
    if layout.dp * c > 1 and cfg.n_expert:
        add("all_reduce", "dp·cp", 1, sum(p.numel() * f32 for p in experts))
    if cfg.n_expert and layout.dp * layout.ep * c > 1:
        add("all_reduce", "data", 3 * M * layers, M * layers * (3 * cfg.n_expert + 1) * f32)


def check_traffic(shard, layout, cfg, args):
    """--check: every rank's measured calls and bytes per step equal the formulas (the
    all-to-all sizes of expert parallelism depend on the routing and are left out)."""
    want = expected_traffic(shard, layout, cfg, args.batch_size, args.seq_len)
    got = {(op, g): (calls / args.steps, payload / args.steps)
           for op, g, calls, payload, _ in comm.table() if op != "all_to_all"}
    if got != want:
        raise AssertionError(f"rank {dist.get_rank()}: traffic per step {got} != formulas "
                             f"{want}")
    print0(f"CHECK traffic {layout}: calls and bytes of every collective per step equal the "
           f"formulas on every rank")


# ----------------------------------------------------------------------------------------
# 3. The ledger

def state_bytes(shard, optimizer):
    """Model state this rank holds: its parameters, their gradients, its AdamW state."""
    return model_state_bytes(nn.ParameterList(p for _, p in shard.params), optimizer)


def ledger(shard, layout, cfg, args, rt, optimizer):
    """Rank 0's rows: communication per step by (group, collective), measured vs formula
    (all-to-all sizes depend on the routing: no formula), then what this rank holds."""
    steps = max(1, args.steps)
    want = expected_traffic(shard, layout, cfg, args.batch_size, args.seq_len)
    lines = [f"ledger ({layout}), rank {rt.rank}, per step:",
             f"  {'group':<7}{'collective':<15}{'calls':>6}{'payload':>12}{'formula':>12}"
             f"{'sent (wire)':>13}"]
    for op, group, calls, payload, wire in sorted(comm.table(), key=lambda r: (r[1], r[0])):
        formula = want.get((op, group), (0, None))[1]
        lines.append(f"  {group:<7}{op:<15}{calls / steps:6.0f}{fmt_bytes(payload / steps):>12}"
                     f"{fmt_bytes(formula) if formula is not None else '-':>12}"
                     f"{fmt_bytes(wire / steps):>13}")
    held = state_bytes(shard, optimizer)
    whole = GPT(cfg, seed=None).num_params() * 4
    if shard.activation_bytes:  # one process running the step's whole microbatch
        one = GPT(cfg, seed=0).to(rt.device)
        b = args.batch_size // layout.microbatches
        ids = torch.zeros(b, args.seq_len, dtype=torch.long, device=rt.device)
        with ActivationMeter(one) as meter:
            one(ids, ids)
        lines.append(f"  activations of one microbatch, this rank's stages: "
                     f"{fmt_bytes(shard.activation_bytes)} (one process, all {b} sequences "
                     f"and layers: {fmt_bytes(meter.bytes)})")
    lines.append(f"  holds params {fmt_bytes(held['params'])}, grads {fmt_bytes(held['grads'])}, "
                 f"AdamW {fmt_bytes(held['optimizer'])} (one process: params {fmt_bytes(whole)}, "
                 f"AdamW {fmt_bytes(2 * whole)})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# 4. bench-tp: the hand tensor parallelism next to PyTorch's DTensor TP (parallelize_module
# with Colwise/RowwiseParallel) on the same model, weights and data.

def dtensor_tp_model(cfg, tp_mesh, device):
    """The reference: the same GPT, sharded by torch.distributed.tensor.parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = GPT(cfg, seed=0).to(device)
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.n_layer):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                     "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


class CollectivesSeen(TorchDispatchMode):
    """Counts the collectives DTensor issues (its functional c10d ops pass through the
    dispatcher) and the bytes handed to each: the same "payload" meters.comm counts."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.payload = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "c10d" in name.split("::")[0] and any(
                op in name for op in ("reduce", "gather", "scatter", "to_all", "broadcast")):
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.calls += 1
            self.payload += sum(t.numel() * t.element_size() for t in tensors
                                if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _time_steps(step, model, batches):
    """Losses of every batch and the mean time of all but the first (the warm-up:
    allocations, DTensor's caches), then one more step to count the collectives: ours
    with the meter, DTensor's as they pass the dispatcher (counting slows a step down)."""
    losses = []
    seconds = 0.0
    for i, (x, y) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        losses.append(step(x, y))
        if i:
            seconds += time.perf_counter() - t0
    comm.reset()
    with CollectivesSeen() as seen:
        model.zero_grad(set_to_none=True)
        step(*batches[-1])
    return losses, seconds / (len(batches) - 1), seen


def bench_against_dtensor(hand, hand_loss, cfg, tp_mesh, batches, device):
    """hand: this rank's slice of the hand-split model; hand_loss(x, y) its mean loss
    (parallel.py builds both). Asserts equal losses and gradients, prints the table."""
    from torch.distributed.tensor.parallel import loss_parallel
    theirs = dtensor_tp_model(cfg, tp_mesh, device)

    def hand_step(x, y):
        loss = hand_loss(x, y)
        loss.backward()
        return loss.item()

    def their_step(x, y):
        logits, _ = theirs(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        return loss.full_tensor().item()

    hand_losses, hand_t, _ = _time_steps(hand_step, hand, batches)
    hand_calls = sum(calls for _, _, calls, _, _ in comm.table())
    hand_payload = sum(payload for _, _, _, payload, _ in comm.table())
    their_losses, their_t, seen = _time_steps(their_step, theirs, batches)
    for a, b in zip(hand_losses, their_losses):
        if abs(a - b) > 1e-5:
            raise AssertionError(f"hand TP loss {a:.6f} != DTensor TP loss {b:.6f}")
    for (name, p), q in zip(hand.named_parameters(), theirs.parameters()):
        theirs_local = q.grad
        if hasattr(q, "placements"):  # (DTensor may hand back the embedding's grad whole)
            theirs_local = q.grad.redistribute(q.device_mesh, q.placements).to_local()
        if not torch.allclose(p.grad, theirs_local, atol=1e-6, rtol=1e-4):
            raise AssertionError(f"gradient of {name}: hand TP differs from DTensor TP")
    print0(f"CHECK hand TP = DTensor TP (tp={tp_mesh.size()}): losses "
           f"{', '.join(f'{v:.5f}' for v in hand_losses)} and every gradient equal")
    print0(f"{'':10}{'step time':>12}{'collectives/step':>18}{'payload/step':>14}")
    print0(f"{'hand':10}{hand_t * 1e3:10.1f}ms{hand_calls:18d}{fmt_bytes(hand_payload):>14}")
    print0(f"{'DTensor':10}{their_t * 1e3:10.1f}ms{seen.calls:18d}"
           f"{fmt_bytes(seen.payload):>14}")
    print0(f"hand / DTensor step time: {hand_t / their_t:.2f}")


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nparallel_check.py is a library: it runs under `parallel.py --check` and "
          "`parallel.py bench-tp` (see parallel.py --help).")
