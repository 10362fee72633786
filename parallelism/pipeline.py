"""
parallelism/pipeline.py -- pipeline parallelism by hand: GPipe, 1F1B, ZB-H1 and DualPipeV.

Cut the layers into contiguous stages, one (or two) per rank, cut the batch into M
microbatches and stream them through: rank r runs stage r of microbatch m while rank r+1
runs stage r+1 of microbatch m-1. Only the activations at stage boundaries travel, point
to point: one (mb, T, D) tensor per microbatch, boundary and direction -- little enough to
cross slow links, which is why pipelining is the dimension that spans nodes.

What it costs, with F, B, W the time of one stage's forward, full backward, and the
weight-gradient part of that backward (bubble = time a rank idles per step):
  GPipe (Huang et al. 2019): all F, then all B. Bubble (P-1)(F+B), i.e. a fraction
      (P-1)/(M+P-1) of the step; holds the activations of all M microbatches.
  1F1B (PipeDream-Flush, Narayanan et al. 2021): P-1-r warm-up forwards, then one F per B.
      Same bubble; rank r holds at most P-r microbatches instead of M.
  ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward splits into I
      (input gradient: the next stage waits for it) and W (weight gradient: nobody waits
      until the optimizer); W's move into the cool-down. Bubble (P-1)(F+B-2W), a third of
      1F1B's when F = I = W, same peak activations. The bookkeeping: every Linear keeps
      its input X and output gradient dY alive from I until W.
  DualPipeV (DeepSeek-V3's DualPipe, cut in half): 2P stages in a V, rank r holds stages r
      and 2P-1-r, so rank 0 holds the embedding and the loss. Bubble (P-1)(F&B+B-3W) (the
      DualPipe README's (PP/2-1)(...) with PP = the 2P stages), M >= 2P, two stages'
      parameters per rank, twice 1F1B's P2P messages, 2P+1 half-size stages of activations.

Each schedule is an explicit list of actions per rank that a reader can print (`python
parallelism/pipeline.py show --schedule zb --pp 4 --microbatches 8`); one executor runs them all;
the tests check each against one process doing gradient accumulation over the same
microbatches. `torchrun --nproc_per_node=P parallelism/pipeline.py bench` times each against
torch.distributed.pipelining and draws what every rank did, bubble measured vs theory.
"""
import time
from collections import Counter, deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model import GPT, get_config
from core.cli import command_line, fmt_bytes, given, knob, require_at_least_one
from core.distributed import setup_runtime
from core.errors import UserError
from core.meters import comm
from core.runtime import print0, run_cli, TimingConditions

SCHEDULES = ("gpipe", "1f1b", "zb", "dualpipev")


# ----------------------------------------------------------------------------------------
# Stages: which layers run where

def split_layers(n_layer, n_stages):
    """Contiguous [start, end) layer ranges, equal sizes (a stage that is slower than the
    others sets the pace of the whole pipeline)."""
    if n_stages < 1 or n_layer % n_stages:
        raise UserError(f"layers not divisible into stages: {n_layer} layers into {n_stages} "
                        f"stages (n_layer must be a multiple of the number of stages)")
    per = n_layer // n_stages
    return [(s * per, (s + 1) * per) for s in range(n_stages)]


def rank_of_stages(n_stages, n_ranks):
    """Stage id -> pp rank: one stage per rank in a line, or two per rank in a V (rank r
    holds r and 2P-1-r, so the way down and the way back up meet on the last rank)."""
    if n_stages == n_ranks:
        return {s: s for s in range(n_stages)}
    assert n_stages == 2 * n_ranks, (n_stages, n_ranks)
    return {s: s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)}


def stage_count(schedule, n_ranks):
    """Stages in all: one per rank in a line, two per rank in DualPipeV's V."""
    return 2 * n_ranks if schedule == "dualpipev" else n_ranks


def stage_ranks(schedule, n_ranks):
    return rank_of_stages(stage_count(schedule, n_ranks), n_ranks)


def cross_entropy_loss(logits, targets):
    """The model's next-token loss (model.GPT.loss without its extras)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)


class Stage(nn.Module):
    """A slice of the model. It holds references to the model's own modules (not copies),
    under the model's own names ("layers.5.attention.wq.weight"), so a parameter of the
    stage IS the model's parameter: whatever the caller did to them before (tensor-parallel
    slicing, hooks) stays, and an optimizer built from either sees the same tensors."""

    def __init__(self, model, stage_id, n_stages, layer_range, loss_fn, cos, sin):
        super().__init__()
        if model.config.tie_embeddings and n_stages > 1:
            raise UserError("tied embeddings put one matrix on the first and the last stage: "
                            "pipeline parallelism here needs tie_embeddings=False")
        self.stage_id, self.n_stages = stage_id, n_stages
        self.is_first, self.is_last = stage_id == 0, stage_id == n_stages - 1
        a, b = layer_range
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(a, b)})
        if self.is_last:
            self.norm, self.output = model.norm, model.output
        self.loss_fn, self.cos, self.sin = loss_fn, cos, sin

    def forward(self, x, targets=None):
        if self.is_first:
            x = self.tok_embeddings(x)            # token ids -> (B, T_local, D)
        for layer in self.layers.values():
            x = layer(x, self.cos, self.sin)
        if not self.is_last:
            return x
        logits = self.output(self.norm(x))
        return logits if targets is None else self.loss_fn(logits, targets)


def build_stages(model, schedule, n_ranks, pp_rank, loss_fn, cos, sin, make_stage=Stage):
    """stage id -> Stage for the stages this pp rank holds (1, or 2 for DualPipeV).
    make_stage: Stage or a subclass (parallel.py's ShardedStage meters each forward)."""
    n_stages = stage_count(schedule, n_ranks)
    owner = stage_ranks(schedule, n_ranks)
    return {s: make_stage(model, s, n_stages, layers, loss_fn, cos, sin)
            for s, layers in enumerate(split_layers(model.config.n_layer, n_stages))
            if owner[s] == pp_rank}


# ----------------------------------------------------------------------------------------
# The zero-bubble split: backward for the input (I) now, for the weights (W) later.
#
# For y = x Wᵀ the backward is two matmuls: dX = dY W (the next stage down the pipe waits for
# it) and dW = dYᵀ X (nobody waits for it until the optimizer). While a schedule with W
# actions runs a stage's forward, the TorchFunctionMode DeferWeightGrads (PyTorch's
# documented seam for intercepting torch functions) routes every F.linear -- which is what
# nn.Linear.forward calls -- through the autograd Function below; the modules themselves
# are untouched, so hooks registered on them (tensor parallelism's) still run. During an I
# action the Function returns dX only and files (weight, X, dY) in the run's
# WeightGradStore; the W action for that (stage, microbatch) does the dW matmuls. The same
# trick as Megatron's / DualPipe's WeightGradStore. Norm gains and the embedding are cheap
# and get their gradients in I. The cost: X and dY of every Linear stay alive between I
# and W.

class WeightGradStore:
    """One per run_schedule call (or the caller's, to inspect it afterwards). Written by
    LinearWithDeferredWeightGrad.backward while `deferring`; run_schedule sets `deferring`
    around each I action's backward, files the jobs under (stage, mb) and runs them at W."""

    def __init__(self):
        self.deferring = False   # True while an I action runs its backward
        self.pending = []        # (weight, X, dY) of the backward that is running
        self.queue = {}          # (stage, mb) -> its jobs, until its W action runs
        self.deferred_jobs = 0   # count, for the tests: the split really happened

    def defer(self, weight, x, grad_out):
        self.pending.append((weight, x, grad_out))
        self.deferred_jobs += 1

    def file(self, key):
        self.queue[key] = self.pending
        self.pending = []

    def run(self, key):
        for weight, x, grad_out in self.queue.pop(key):
            dw = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)      # dW = dYᵀ X
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw       # accumulate, as autograd would


class LinearWithDeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        # the Parameter itself, to put W's result in its .grad: what saved_tensors hands
        # back may be another tensor object on the same storage (with saved-tensor hooks)
        ctx.parameter = weight
        ctx.store = store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None        # dX = dY W
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None
        if ctx.store.deferring:
            ctx.store.defer(ctx.parameter, x, grad_out)
            return grad_x, None, None
        return grad_x, grad_out.flatten(0, -2).t() @ x.flatten(0, -2), None


class DeferWeightGrads(TorchFunctionMode):
    """While active: F.linear(x, W, b) with a trainable W becomes
    LinearWithDeferredWeightGrad(x, W, store) + b (bias gradient: cheap, done in I). Inside
    its own handler the mode is off, so the Function's F.linear is the plain one."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1].requires_grad:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = LinearWithDeferredWeightGrad.apply(args[0], args[1], self.store)
            return y if bias is None else y + bias
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------
# Schedules: an explicit list of actions per rank.
#
# kind: "F" forward; "B" full backward (input and weight gradients); "I" backward for the
# input only (the ZB paper's "B"); "W" weight gradients of an earlier I. The same letters as
# torch.distributed.pipelining. slot: the column of the step table where the action runs
# when every action takes one time unit; send_at: the slot at which another rank consumes
# what this action produces (-1 when nothing leaves the rank) -- the executor uses both to
# pair every send with its receive (see run_schedule).

@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    mb: int
    slot: int = -1
    send_at: int = -1


def gpipe_rank(P, M, r):
    """GPipe: all forwards, then all backwards (in the same order: gradients of microbatch 0
    come back first). Simple; holds all M microbatches' activations."""
    return [("F", r, m) for m in range(M)] + [("B", r, m) for m in range(M)]


def one_f_one_b_rank(P, M, r, split=False):
    """1F1B: P-1-r warm-up forwards (enough to keep the ranks below busy), then each
    forward is followed by the backward of the oldest microbatch, then the remaining
    backwards. Rank r never holds more than P-r microbatches.

    split=True is ZB-H1 (as torch's ScheduleInterleavedZeroBubble with one stage per rank):
    each B becomes I, and rank r runs the W of microbatch b-r after the I of microbatch b.
    Delaying its W's by r keeps rank r's I's -- the critical path -- on time in the steady
    state; the r W's it owes fill the cool-down, where 1F1B idles."""
    warmup = min(P - 1 - r, M)
    actions = [("F", r, m) for m in range(warmup)]
    for b in range(M):
        if warmup + b < M:
            actions.append(("F", r, warmup + b))
        actions.append(("I" if split else "B", r, b))
        if split and b >= r:
            actions.append(("W", r, b - r))
    if split:
        actions += [("W", r, m) for m in range(max(M - r, 0), M)]
    return actions


def dualpipev_rank(P, M, r):
    """DualPipeV, phase by phase as in deepseek-ai/DualPipe dualpipev.py (and torch's
    ScheduleDualPipeV). stage0 = r is on the way down the V, stage1 = 2P-1-r on the way up.
    "F0&B1" pairs are where DualPipe overlaps one chunk's compute with the other's
    communication (MoE all-to-all); we run the two halves one after the other, in the same
    order -- no overlap here."""
    s0, s1 = r, 2 * P - 1 - r
    actions, next_f, next_b, w_queue = [], Counter(), Counter(), deque()

    def f(s):
        actions.append(("F", s, next_f[s]))
        next_f[s] += 1

    def b(s, zero_bubble=False):          # full backward, or I with its W queued (FIFO)
        actions.append(("I" if zero_bubble else "B", s, next_b[s]))
        if zero_bubble:
            w_queue.append((s, next_b[s]))
        next_b[s] += 1

    def w():
        if w_queue:
            actions.append(("W", *w_queue.popleft()))

    for _ in range(2 * (P - r - 1)):         # 1: nF0         fill the way down
        f(s0)
    for _ in range(r + 1):                   # 2: nF0F1       turn at the bottom of the V
        f(s0)
        f(s1)
    for _ in range(P - r - 1):               # 3: nI1W1F1     zero-bubble fill
        b(s1, zero_bubble=True)
        w()
        f(s1)
    for _ in range(M - 2 * P + r + 1):       # 4: nF0B1F1B0   steady state: two F&B pairs
        f(s0)
        b(s1)
        f(s1)
        b(s0)
    for _ in range(P - r - 1):               # 5: nB1F1B0
        b(s1)
        f(s1)
        b(s0)
    zero_bubble = False                      # 6: nB1B0: the second half as I's
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        b(s1, zero_bubble)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        b(s0, zero_bubble)
    for _ in range(P - r - 1):               # 7: nWB0        fill with W's
        w()
        b(s0, zero_bubble)
    for _ in range(r + 1):                   # 8: nW          the W's left
        w()
    assert not w_queue
    return actions


def needs(kind, stage, mb, n_stages):
    """What an action waits for: F the previous stage's F; a backward its own F and the
    next stage's backward; W its own I."""
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in "BI":
        return [("F", stage, mb)] + ([("back", stage + 1, mb)] if stage < n_stages - 1 else [])
    return [("back", stage, mb)]


PROVIDES = {"F": ("F",), "B": ("back", "W"), "I": ("back",), "W": ("W",)}


def place_on_grid(per_rank, n_stages):
    """Run the action lists on an ideal machine where every action takes one time step and
    starts as soon as its inputs exist: -> the slot of each action. A list that can never
    finish (an action waiting for one that comes later) is a bug in its builder."""
    done, pos, slots, t = {}, [0] * len(per_rank), [[] for _ in per_rank], 0
    while any(p < len(lst) for p, lst in zip(pos, per_rank)):
        ready = [r for r, lst in enumerate(per_rank) if pos[r] < len(lst) and
                 all(done.get(d, t) < t for d in needs(*lst[pos[r]], n_stages))]
        if not ready:
            stuck = {r: lst[pos[r]] for r, lst in enumerate(per_rank) if pos[r] < len(lst)}
            raise RuntimeError(f"schedule deadlocks at step {t}: waiting {stuck}")
        for r in ready:
            kind, stage, mb = per_rank[r][pos[r]]
            for what in PROVIDES[kind]:
                done[(what, stage, mb)] = t
            slots[r].append(t)
            pos[r] += 1
        t += 1
    return slots, done


def build_schedule(schedule, n_ranks, n_microbatches):
    """Per pp rank, its ordered list of Actions. Same answer on every rank (no
    communication), so a UserError here is raised everywhere before any P2P."""
    P, M = n_ranks, n_microbatches
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if P < 1 or M < 1:
        raise UserError(f"pipeline needs at least 1 rank and 1 microbatch, got P={P}, M={M}")
    if schedule == "dualpipev" and M < 2 * P:
        raise UserError(f"dualpipev needs at least 2·P = {2 * P} microbatches for P={P} "
                        f"ranks (as DualPipe and torch's ScheduleDualPipeV), got {M}")
    build = {"gpipe": gpipe_rank, "1f1b": one_f_one_b_rank, "dualpipev": dualpipev_rank,
             "zb": lambda P, M, r: one_f_one_b_rank(P, M, r, split=True)}[schedule]
    per_rank = [build(P, M, r) for r in range(P)]
    n_stages = stage_count(schedule, P)
    rank_of = rank_of_stages(n_stages, P)
    slots, done = place_on_grid(per_rank, n_stages)
    out = []
    for r, lst in enumerate(per_rank):
        row = []
        for (kind, stage, mb), slot in zip(lst, slots[r]):
            # the consumer: F of the next stage, or the backward of the previous stage
            to = stage + 1 if kind == "F" else stage - 1
            crosses = kind in "FBI" and 0 <= to < n_stages and rank_of[to] != r
            consumer = ("F" if kind == "F" else "back", to, mb)
            row.append(Action(kind, stage, mb, slot, done[consumer] if crosses else -1))
        out.append(row)
    return out


def format_schedule(actions_per_rank):
    """The step table: one row per rank, one column per slot, '.' where the rank waits.
    Lower case: the rank's second stage (DualPipeV's way back up the V)."""
    P = len(actions_per_rank)
    v_shape = max(a.stage for row in actions_per_rank for a in row) + 1 == 2 * P
    n_slots = 1 + max(a.slot for row in actions_per_rank for a in row)
    width = 1 + max(len(f"{a.kind}{a.mb}") for row in actions_per_rank for a in row)
    lines = []
    for r, row in enumerate(actions_per_rank):
        cells = ["."] * n_slots
        for a in row:
            kind = a.kind.lower() if v_shape and a.stage >= P else a.kind
            cells[a.slot] = f"{kind}{a.mb}"
        lines.append(f"rank {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    lines.append("(F forward, B backward, I input-gradient backward, W weight gradients, "
                 "digits: microbatch, '.' idle" + (", lower case: second stage)" if v_shape
                                                   else ")"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# The executor: one loop runs any schedule.
#
# No deadlock by construction. On NCCL a large send does not complete before the peer posts
# its receive, and the ops between two ranks run in order on one stream: two neighbours
# that each "send, then receive" would wait for each other forever. So both halves of
# every transfer are posted at the same slot of the step table -- the receive right before
# the action that consumes it, the send at the sender's first action at or after that slot
# (it keeps the tensor until then) -- and a rank's sends and receives of one slot go out as
# ONE batch_isend_irecv (one NCCL group). On gloo we wait for our receives only; the sends
# complete in the background and are waited for at the end.

class Exchange:
    """This rank's P2P traffic during one run of its action list. A tensor for a stage on
    another rank waits in the outbox until the slot at which its receiver consumes it
    (send_at); before each action, the sends due and the action's own receive go out as
    ONE batch_isend_irecv (one NCCL group)."""

    def __init__(self, pp_group, n_stages, activation_shape, dtype, device):
        if pp_group is None:                                # one process, all stages here
            self.me, self.global_ranks = 0, [0]
        else:
            self.me = dist.get_rank(pp_group)
            self.global_ranks = dist.get_process_group_ranks(pp_group)
        self.rank_of = rank_of_stages(n_stages, len(self.global_ranks))
        self.group, self.n_stages = pp_group, n_stages
        self.shape, self.dtype, self.device = activation_shape, dtype, device
        self.outbox = []            # (send_at slot, tensor, destination global rank)
        self.send_works = []        # gloo: send handles, waited for at the end

    def hand_over(self, box, key, tensor, to_stage, send_at):
        if self.rank_of[to_stage] == self.me:   # DualPipeV: both stages here, no traffic
            box[key] = tensor
        else:
            dst = self.global_ranks[self.rank_of[to_stage]]
            self.outbox.append((send_at, tensor.contiguous(), dst))

    def before(self, a):
        """Post the sends due by action a's slot and a's receive; -> the received tensor."""
        ops, recvs = [], []
        due = sorted((o for o in self.outbox if o[0] <= a.slot), key=lambda o: o[0])
        self.outbox = [o for o in self.outbox if o[0] > a.slot]
        for _, tensor, dst in due:
            ops.append(dist.P2POp(dist.isend, tensor, dst, self.group))
        src = a.stage - 1 if a.kind == "F" else a.stage + 1
        if a.kind in "FBI" and 0 <= src < self.n_stages and self.rank_of[src] != self.me:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            src_rank = self.global_ranks[self.rank_of[src]]
            ops.append(dist.P2POp(dist.irecv, buf, src_rank, self.group))
            recvs.append(buf)
        if not ops:
            return None
        works = comm.batch_isend_irecv(ops)
        if len(works) == len(ops):       # one handle per op (gloo): wait for receives only
            self.send_works.extend(works[:len(due)])
            works = works[len(due):]
        for w in works:                  # NCCL: one handle for the group, a stream wait
            w.wait()
        return recvs[0] if recvs else None

    def finish(self):
        """Send what is left (gradients for a slot after our last action); wait for all."""
        if self.outbox:
            ops = [dist.P2POp(dist.isend, t, dst, self.group)
                   for _, t, dst in sorted(self.outbox, key=lambda o: o[0])]
            self.send_works.extend(comm.batch_isend_irecv(ops))
        for w in self.send_works:
            w.wait()


def run_schedule(stages, actions, inputs, targets, pp_group, activation_shape, dtype,
                 device, timeline=None, weight_grads=None):
    """Run this rank's action list once. weight_grads: the WeightGradStore for the I/W
    split (a fresh one by default; pass one to count its deferred jobs)."""
    device = torch.device(device)
    n_stages = next(iter(stages.values())).n_stages
    p2p = Exchange(pp_group, n_stages, activation_shape, dtype, device)
    M = 1 + max(a.mb for a in actions)          # every rank runs an F of every microbatch
    arriving_x, arriving_grad = {}, {}   # (stage, mb) -> activation in / gradient of output
    held = {}                            # (stage, mb) -> (input, output) kept for backward
    losses = []
    split = any(a.kind == "I" for a in actions)
    store = WeightGradStore() if weight_grads is None else weight_grads
    store.pending, store.queue = [], {}              # nothing left from a failed step
    for_forward = (lambda: DeferWeightGrads(store)) if split else nullcontext
    try:
        for a in actions:
            received = p2p.before(a)
            stage, key = stages[a.stage], (a.stage, a.mb)
            t_start = time.perf_counter()
            if a.kind == "F":
                if stage.is_first:
                    x = inputs[a.mb].to(device)
                else:                    # a leaf: its .grad is what we send back
                    x = (received if received is not None else arriving_x.pop(key))
                    x.requires_grad_(True)
                with for_forward():
                    y = stage(x, targets[a.mb].to(device) if stage.is_last else None)
                held[key] = (x, y)
                if stage.is_last:
                    losses.append(y.detach())
                else:
                    p2p.hand_over(arriving_x, (a.stage + 1, a.mb), y.detach(), a.stage + 1,
                                  a.send_at)
            elif a.kind in "BI":
                x, y = held.pop(key)
                store.deferring = a.kind == "I"
                if stage.is_last:        # gradient accumulation: each loss weighs 1/M
                    torch.autograd.backward(y / M)
                else:
                    grad = received if received is not None else arriving_grad.pop(key)
                    torch.autograd.backward(y, grad_tensors=grad)
                store.deferring = False
                if a.kind == "I":
                    store.file(key)
                if not stage.is_first:
                    p2p.hand_over(arriving_grad, (a.stage - 1, a.mb), x.grad, a.stage - 1,
                                  a.send_at)
            else:
                store.run(key)
            if timeline is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                timeline.append((a.kind, a.stage, a.mb, t_start, time.perf_counter()))
        p2p.finish()
    finally:
        store.deferring = False
    assert not store.queue, f"W never ran for {list(store.queue)}"
    return torch.stack(losses).mean().item() if losses else None


# ----------------------------------------------------------------------------------------
# What actually happened: timelines, bubbles, in-flight microbatches

def gather_timelines(timeline, t0, group=None):
    """Every rank's (kind, stage, mb, start, end) records, times relative to its t0 (taken
    right after a barrier). all_gather_object: bookkeeping, not model traffic, unmetered."""
    mine = [(k, s, m, a - t0, b - t0) for k, s, m, a, b in timeline]
    if not dist.is_initialized():
        return [mine]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def peak_in_flight(records):
    """Max microbatches whose activations a rank holds (after F, before its backward), and
    max whose W is still owed (after I, before W). Works on actions or timeline records."""
    held = owed = peak_held = peak_owed = 0
    for kind, *_ in ((r.kind,) if isinstance(r, Action) else r for r in records):
        held += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
        owed += {"I": 1, "W": -1}.get(kind, 0)
        peak_held, peak_owed = max(peak_held, held), max(peak_owed, owed)
    return peak_held, peak_owed


def mean_times(timelines):
    """Mean F, full-backward and W durations over every rank (B = I + W when split)."""
    spans = {k: [e - s for tl in timelines for kk, _, _, s, e in tl if kk == k] for k in "FBIW"}
    mean = {k: sum(v) / len(v) if v else 0.0 for k, v in spans.items()}
    b = mean["B"] if spans["B"] else mean["I"] + mean["W"]
    return mean["F"], b, mean["W"]


def theory_bubble(schedule, P, M, f, b, w):
    """Idle fraction of a rank's step. GPipe/1F1B: (P-1)/(M+P-1). ZB-H1 and DualPipeV: the
    DualPipe README's bubble over (bubble + work); its F&B is F+B here (no overlap), and
    its PP is the number of stages, 2P for DualPipeV."""
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if schedule == "zb":
        idle, work = (P - 1) * (f + b - 2 * w), M * (f + b)
    else:
        idle, work = (P - 1) * ((f + b) + b - 3 * w), 2 * M * (f + b)
    idle = max(idle, 0.0)
    return idle / (idle + work) if idle + work > 0 else 0.0


def measured_bubbles(timelines):
    """Per rank: 1 - busy/step, the step running from the barrier to the last end."""
    end = max(e for tl in timelines for *_, e in tl)
    return [1 - sum(e - s for *_, s, e in tl) / end for tl in timelines]


def format_timeline(timelines, schedule, M, width=100):
    P = len(timelines)
    end = max(e for tl in timelines for *_, e in tl)
    bubbles = measured_bubbles(timelines)
    f, b, w = mean_times(timelines)
    lines = [f"{schedule}: what each rank ran ({end * 1e3:.1f} ms across {width} columns, "
             f"'.' idle or waiting for a neighbour)"]
    for r, tl in enumerate(timelines):
        row = ["."] * width
        for kind, stage, mb, s, e in tl:
            c0 = min(int(s / end * width), width - 1)
            c1 = max(min(int(e / end * width), width), c0 + 1)
            letter = kind.lower() if schedule == "dualpipev" and stage >= P else kind
            label = f"{letter}{mb}" if c1 - c0 >= len(f"{letter}{mb}") else letter
            row[c0:c1] = list(label.ljust(c1 - c0))
        held, owed = peak_in_flight(tl)
        lines.append(f"rank {r} |{''.join(row)}| bubble {bubbles[r]:5.1%}  in flight "
                     f"{held}" + (f" (+{owed} W owed)" if owed else ""))
    theory = theory_bubble(schedule, P, M, f, b, w)
    lines.append(f"mean bubble {sum(bubbles) / P:.1%} measured vs {theory:.1%} theory "
                 f"(F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, W {w * 1e3:.2f} ms)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Benchmark: each hand schedule against torch.distributed.pipelining, same model, same data

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zb": "ScheduleInterleavedZeroBubble",   # one stage per rank: ZB1P
                   "dualpipev": "ScheduleDualPipeV"}


def torch_pipeline_step(schedule, stages, pp_group, M, device):
    """-> step(xs, ys) running torch's schedule on the same Stage modules (they return
    logits when given no targets; torch applies the loss and scales gradients by 1/M)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    ordered = [stages[s] for s in sorted(stages)]
    pipe_stages = [PipelineStage(st, st.stage_id, st.n_stages, device, group=pp_group)
                   for st in ordered]
    cls = getattr(torch_schedules, TORCH_SCHEDULES[schedule])
    multi = issubclass(cls, torch_schedules.PipelineScheduleMulti)
    runner = cls(pipe_stages if multi else pipe_stages[0], n_microbatches=M,
                 loss_fn=cross_entropy_loss)
    first = any(st.is_first for st in ordered)
    last = any(st.is_last for st in ordered)

    def step(xs, ys):
        losses = []
        args = (torch.cat(xs).to(device),) if first else ()
        kwargs = dict(target=torch.cat(ys).to(device), losses=losses) if last else {}
        runner.step(*args, return_outputs=False, **kwargs)
        return torch.stack(losses).mean().item() if last else None
    return step


def timed(step, args, model, device):
    """The wall time of each timed step (barrier to barrier), the last step's result, and
    each timed step's start (step(t0) may use it, e.g. to keep that step's timeline)."""
    times, starts = [], []
    for i in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        if i >= args.warmup:
            starts.append(t0)
        result = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], result, starts


def bench_schedule(schedule, args, rt, cfg, batch, pp_group):
    """One schedule, by hand and (under torchrun) through torch.distributed.pipelining, on
    the same weights and microbatches. -> (its table row, the last step's timeline)."""
    P, M, T, device = rt.world_size, args.microbatches, args.seq_len, rt.device
    xs, ys = batch
    model = GPT(cfg, seed=0).to(device)
    cos, sin = model.rope(torch.arange(T, device=device))
    stages = build_stages(model, schedule, P, rt.rank, cross_entropy_loss, cos, sin)
    actions = build_schedule(schedule, P, M)[rt.rank]
    wire = comm.total_wire
    steps_run = []

    def hand_step():
        timeline = []
        steps_run.append(timeline)
        return run_schedule(stages, actions, xs, ys, pp_group,
                            (args.microbatch_size, T, cfg.n_embd), torch.float32, device,
                            timeline)
    hand_times, hand_loss, starts = timed(hand_step, args, model, device)
    sent = (comm.total_wire - wire) / (args.warmup + args.steps)
    # every timed step's timeline: the bubble is the median over steps (one step on a
    # shared CPU is noisy), the picture is the last step's
    per_step = [gather_timelines(tl, t0) for tl, t0 in zip(steps_run[args.warmup:], starts)]
    bubbles = sorted(sum(measured_bubbles(tls)) / P for tls in per_step)
    torch_times, torch_loss = [], None
    note = "needs torchrun" if not rt.distributed else "skipped" if args.no_torch else ""
    if not note:
        try:
            step = torch_pipeline_step(schedule, stages, pp_group, M, device)
            torch_times, torch_loss, _ = timed(lambda: step(xs, ys), args, model, device)
        except Exception as e:   # a schedule torch cannot drive here: say so, no number
            note = f"torch failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    f, b, w = mean_times([tl for tls in per_step for tl in tls])
    mine = (hand_loss, torch_loss, sent)        # losses live where the last stage is
    everyone = [mine] * P
    if rt.distributed:
        dist.all_gather_object(everyone, mine)
    # the median step (the upper one of an even count), and every step for the spread
    row = dict(schedule=schedule, hand_ms=sorted(hand_times)[args.steps // 2] * 1e3,
               torch_note=note,
               torch_ms=sorted(torch_times)[args.steps // 2] * 1e3 if torch_times else None,
               times={f"{schedule} hand": hand_times, f"{schedule} torch": torch_times},
               hand_loss=next(e[0] for e in everyone if e[0] is not None),
               torch_loss=next((e[1] for e in everyone if e[1] is not None), None),
               sent=max(e[2] for e in everyone),
               bubble=bubbles[len(bubbles) // 2],
               theory=theory_bubble(schedule, P, M, f, b, w))
    return row, format_timeline(per_step[-1], schedule, M)


def print_bench(rows):
    print0(f"{'schedule':<10} {'hand ms':>8} {'torch ms':>9} {'hand/torch':>10} {'bubble':>7} "
           f"{'theory':>7} {'P2P sent/rank':>13}  loss hand / torch")
    for r in rows:
        torch_ms = f"{r['torch_ms']:9.2f}" if r["torch_ms"] else f"{'-':>9}"
        ratio = f"{r['hand_ms'] / r['torch_ms']:10.2f}" if r["torch_ms"] else f"{'-':>10}"
        versus = f"{r['torch_loss']:.6f}" if r["torch_loss"] is not None else r["torch_note"]
        print0(f"{r['schedule']:<10} {r['hand_ms']:8.2f} {torch_ms} {ratio} {r['bubble']:7.1%} "
               f"{r['theory']:7.1%} {fmt_bytes(r['sent']):>13}  {r['hand_loss']:.6f} / {versus}")


def bench(args, rt, conditions=None):
    """Every --schedules schedule timed by hand and through torch; the table, one warning
    line when core.runtime.TimingConditions (None: the machine's own) doubts the times,
    then each schedule's timeline."""
    conditions = conditions or TimingConditions()
    P, M, T, device = rt.world_size, args.microbatches, args.seq_len, rt.device
    pp_group = dist.new_group(list(range(P))) if rt.distributed else None
    if pp_group is not None:
        comm.name_group(pp_group, "pp")
    cfg = get_config(args.preset, **given(args, BENCH_MODEL_KNOBS),
                     block_size=max(T, get_config(args.preset).block_size))
    for schedule in args.schedules:                 # every UserError before any P2P
        build_schedule(schedule, P, M)
        split_layers(cfg.n_layer, stage_count(schedule, P))
    data = torch.randint(0, cfg.vocab_size, (M, args.microbatch_size, T + 1),
                         generator=torch.Generator().manual_seed(args.seed))
    batch = ([d[:, :-1].to(device) for d in data], [d[:, 1:].to(device) for d in data])
    print0(f"pipeline bench: P={P} ranks, M={M} microbatches of {args.microbatch_size}x{T} "
           f"tokens, {args.preset} with n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
           f"vocab {cfg.vocab_size}, {device}")
    rows, pictures = [], []
    with conditions:                # the load average as the first schedule starts, the last ends
        for schedule in args.schedules:
            row, picture = bench_schedule(schedule, args, rt, cfg, batch, pp_group)
            rows.append(row)
            pictures.append(picture)
    print_bench(rows)
    conditions.report({k: v for r in rows for k, v in r["times"].items()}, out=print0)
    for picture in pictures:
        print0("\n" + picture)
    return rows


# ----------------------------------------------------------------------------------------
# Command line: every knob once, a row each (flag, default, help; core/cli.py makes the
# flags and --help).

MODE_KNOBS = [
    knob("mode", None, "show: print the step table of --schedule (no torchrun needed); "
         "bench: run under torchrun --nproc_per_node=P", choices=("show", "bench")),
]

SHOW_KNOBS = [
    knob("--schedule", "1f1b", "show: which schedule", choices=SCHEDULES),
    knob("--pp", 4, "show: number of pipeline ranks"),
]

# the bench model: --preset with these three overrides (bench's get_config)
BENCH_MODEL_KNOBS = [
    knob("--n-layer", 8, "bench: layers (the 2P stages of dualpipev must divide them)"),
    knob("--n-embd", 384, "bench: model width (tiny's own 32 leaves too little to compute)"),
    knob("--vocab-size", 64, "bench: vocabulary. The head and the loss make the last stage "
         "heavier; a small vocabulary balances the stages, as the bubble formulas assume"),
]

BENCH_KNOBS = [
    knob("--schedules", ",".join(SCHEDULES), "bench: comma-separated schedules to run"),
    knob("--microbatches", 8, "microbatches per step (M)"),        # show's too
    knob("--preset", "tiny", "model preset (model.PRESETS)"),
    *BENCH_MODEL_KNOBS,
    knob("--seq-len", 256, "bench: tokens per sequence"),
    knob("--microbatch-size", 4, "bench: sequences per microbatch"),
    knob("--steps", 7, "bench: timed steps (median reported)"),
    knob("--warmup", 1, "bench: untimed steps first"),
    knob("--seed", 0, "bench: seed of the random token ids"),
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--no-torch", False, "bench: skip the torch schedules"),
]


def parse_args(argv=None):
    p = command_line("Pipeline parallelism by hand: print a schedule, or time every schedule "
                     "against torch.distributed.pipelining (training runs go through "
                     "parallel.py --pp).", {None: MODE_KNOBS + SHOW_KNOBS + BENCH_KNOBS})
    args = p.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedules:
        if s not in SCHEDULES:
            raise UserError(f"unknown schedule {s!r}: choose from {', '.join(SCHEDULES)}")
    require_at_least_one(args, ["microbatches", "pp", "seq_len", "microbatch_size", "steps"])
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "show":
        actions = build_schedule(args.schedule, args.pp, args.microbatches)
        print(f"{args.schedule}, P={args.pp} ranks, M={args.microbatches} microbatches, one "
              f"column per time step when every action takes one unit:")
        print(format_schedule(actions))
        print("peak microbatches held per rank: " + ", ".join(
            str(peak_in_flight(row)[0]) for row in actions))
        return actions
    with setup_runtime(args.device) as rt:
        return bench(args, rt)


if __name__ == "__main__":
    run_cli(main)
