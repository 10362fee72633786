"""
parallel.py -- when data parallelism is not enough: split the model itself, along five axes.

One DeviceMesh with named dimensions (dp, ep, pp, cp, tp) -- world = dp·ep·pp·cp·tp -- and
the shared GPT split along each of them, by hand:

  tp  tensor parallelism (parallelism/tensor_parallel.py, next door; Megatron-LM): inside a layer,
      heads and MLP slices per rank, f/g all-reduces around each region, the vocabulary
      split in the embedding, the head and the loss.
      saves: weights/grads/optimizer ÷ t, activations inside the regions ÷ t.
      adds:  4 all-reduces of b·s·h per layer, on the critical path.
  sp  sequence parallelism (parallelism/tensor_parallel.py; Korthikanti et al. 2022), on top of tp:
      norms and residual on sequence shards. saves: the rest of the activations ÷ t.
      adds: 2 all-gathers per layer in backward.
  cp  context parallelism (parallelism/ring_attention.py, next door; Liu et al. 2023): the sequence
      split across ranks everywhere, attention computed block by block while K/V travel
      round a ring.
      Zigzag sharding balances the causal triangle. saves: activations ÷ c (long context).
      adds:  per layer (c−1)/c of K and V sent forward, twice that backward.
  pp  pipeline parallelism (parallelism/pipeline.py, next door): the layers split into stages.
      saves: weights/grads/optimizer ÷ p.  adds: a bubble of idle time, P2P activations.
  ep  expert parallelism (GShard, Lepikhin et al. 2020): the MoE experts spread over
      ranks, tokens sent to their experts and back with all-to-all (uneven splits).
      saves: expert weights ÷ e.  adds: 2 all-to-alls forward and 2 backward per layer.
      Shared experts (DeepSeekMoE) stay replicated, outside the all-to-all; DeepSeek-V3's
      loss-free bias moves by loads the balance statistics already all-reduce.
  dp  data parallelism: whatever is left replicates the model and averages gradients.

This file composes them: the mesh and its process groups (build_mesh, group_over), the
model cut down to this rank's share (build_shard), the one table of where each parameter
lives (Placement: sliced over tp, a partial sum under sp, an expert), the gradient sums
that table implies (sync_gradients, clip_gradients), expert parallelism's all-to-all
(below), and the training loop. How the split is proven and measured lives next door in
parallelism/parallel_check.py: with `--check` every step is compared with one process running the
same model on the same global batch (loss, every gradient -- each rank its slices -- and
the weights after the optimizer step), and every collective (all through meters.comm)
with its formula; the ledger prints the bytes each group sent per step.

    torchrun --standalone --nproc_per_node=4 parallel.py --tp 2 --cp 2 --sp --check
    torchrun --standalone --nproc_per_node=8 parallel.py --dp 2 --pp 2 --tp 2 --schedule 1f1b
    torchrun --standalone --nproc_per_node=2 parallel.py bench-tp     (hand TP vs DTensor)
    python parallel.py plan --params 405B --layers 126 --hidden 16384 --seq 8192 --gpus 16384
"""
import argparse
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from core import data
from parallelism import parallel_check
from parallelism import pipeline
from parallelism import planner
from parallelism.ring_attention import cp_positions, cp_shard, make_ring_attn_fn
from model import GPT, get_config
from core.moe import MoE
from core.cli import ArgumentParser, add_knobs, fmt_bytes, given, knob, require_at_least_one
from core.distributed import all_reduce_flat, setup_runtime
from core.errors import UserError
from core.meters import comm, StepTimer
from core.recipe import decay_groups, warmup_cosine
from core.runtime import print0, run_cli, seed_everything, TimingConditions
from parallelism.tensor_parallel import (GatheredInputs, SavedActivations,
                                         VocabParallelCrossEntropy, apply_tensor_parallel,
                                         summed_over)

# init_device_mesh numbers the ranks row-major over these names: the LAST varies fastest, so
# with tp=2 the tp groups are ranks (0, 1), (2, 3), ... -- consecutive ranks, which torchrun
# places on one node. The order decides which links carry which traffic, not what is computed.
DIMS = ("dp", "ep", "pp", "cp", "tp")     # outermost to innermost: tp talks the most,
                                          # so its ranks are neighbours (same node)


# ----------------------------------------------------------------------------------------
# The layout and its mesh

@dataclass
class Layout:
    # sizes along each mesh dimension; check_layout demands dp·ep·pp·cp·tp = world size
    dp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False          # sequence parallelism inside the tp group
    zigzag: bool = True       # context parallelism: zigzag (balanced) or plain chunks
    schedule: str = "1f1b"    # one of pipeline.SCHEDULES; read only when pp > 1
    # M microbatches per step and data replica. With pp > 1, GPipe/1F1B idle (P-1)/(M+P-1)
    # of the step: raise M and the bubble shrinks; with pp = 1 it is gradient accumulation
    microbatches: int = 1

    @property
    def world(self):
        return self.dp * self.ep * self.pp * self.cp * self.tp

    def __str__(self):
        # the name --check prints, e.g. "dp=2 × pp=2 × tp=2" (tests/test_parallel.py looks
        # for "CHECK step 2 dp=2 × pp=2 × tp=2"); dimensions of size 1 are left out
        parts = [f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        if self.sp:
            parts.append("sp")
        if self.cp > 1:
            parts.append("zigzag" if self.zigzag else "plain")
        if self.pp > 1:
            parts.append(f"{self.schedule} M={self.microbatches}")
        return " × ".join(parts) or "one process"


def check_layout(layout, cfg, world, batch_size, seq_len):
    """Every rank runs the same checks before any collective: a bad layout is one clear
    message and exit status 2 on every rank, never a hang."""
    L = layout
    require_at_least_one(L, DIMS)       # "--tp must be at least 1, got 0"
    if L.world != world:
        raise UserError(f"the layout {' × '.join(f'{d} {getattr(L, d)}' for d in DIMS)} "
                        f"needs {L.world} processes, but {world} were launched")
    # tp slices wq/wk/wv by heads, w1/w3/w2 by ffn_dim and the embedding and head by vocabulary
    # rows (tensor_parallel._slice_linear): every rank needs whole heads -- and whole KV heads,
    # since q head j reads KV head j // (n_head/n_kv_head) -- and equal slices
    for what, n in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head),
                    ("vocab_size", cfg.vocab_size), ("ffn_dim", cfg.ffn_dim)):
        if n % L.tp:
            raise UserError(f"--tp {L.tp} does not divide {what}={n}: each rank must hold "
                            f"whole heads and equal slices")
    if cfg.n_expert and L.tp > 1:
        raise UserError("tensor parallelism inside the experts is not implemented here: "
                        "spread a mixture of experts with --ep instead")
    if L.ep > 1 and not cfg.n_expert:
        raise UserError(f"--ep {L.ep} needs a mixture-of-experts model (--preset moe or "
                        f"--n-expert)")
    if cfg.n_expert % L.ep:
        raise UserError(f"--ep {L.ep} does not divide the {cfg.n_expert} experts")
    if cfg.n_extra_heads and (L.tp > 1 or L.cp > 1):
        raise UserError("extra next-token heads see whole sequences and the whole "
                        "vocabulary here: use them without --tp and --cp")
    if cfg.tie_embeddings and (L.tp > 1 or L.pp > 1):
        raise UserError("tied embeddings would live on two tp slices / pipeline stages: "
                        "parallel.py splits untied models only")
    # zigzag cuts the sequence into 2·cp chunks and rank r keeps chunks r and 2cp-1-r: one
    # cheap (early) and one expensive (late) piece of the causal triangle per rank
    chunks = L.cp * (2 if L.zigzag and L.cp > 1 else 1)
    if seq_len % chunks:
        raise UserError(f"--seq-len {seq_len} is not divisible into {chunks} equal chunks "
                        f"(context parallelism {'zigzag 2·' if L.zigzag else ''}cp)")
    # under sp the residual stream between blocks is cut again, T/cp tokens into tp shards
    if L.sp and (seq_len // L.cp) % L.tp:
        raise UserError(f"--sp: each rank's {seq_len // L.cp} tokens do not split evenly "
                        f"over tp={L.tp}")
    # ep ranks take rows of their own, like dp: each replica runs batch/(dp·ep·M) rows at once
    replicas = L.dp * L.ep
    if batch_size % (replicas * L.microbatches):
        raise UserError(f"--batch-size {batch_size} is not divisible into {replicas} data "
                        f"replicas × {L.microbatches} microbatches")
    if L.pp > 1:              # the calls build_shard makes later, run now for their errors;
        # DualPipeV puts two stages on each rank (a V), so the layers split 2·pp ways
        pipeline.split_layers(cfg.n_layer, pipeline.stage_count(L.schedule, L.pp))
        pipeline.build_schedule(L.schedule, L.pp, L.microbatches)   # raises if M too small


def build_mesh(layout, device):
    """The (dp, ep, pp, cp, tp) DeviceMesh over all ranks; mesh.get_group(d) is then this
    rank's group along d. A collective: every rank calls it, with the same shape."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, tuple(getattr(layout, d) for d in DIMS),
                            mesh_dim_names=DIMS)
    comm.name_mesh(mesh)      # the ledger's rows say "tp", "cp", ... instead of "group"
    return mesh


def group_over(mesh, dims, name):
    """The process group spanning several mesh dimensions (e.g. dp and cp: the ranks whose
    gradients must be summed) that contains this rank. new_group must be called by every
    rank for every such group, in the same order, so we enumerate them all."""
    names = mesh.mesh_dim_names
    keep = [names.index(d) for d in dims]
    # The kept dimensions moved last, each row of the reshaped grid is one group: the ranks
    # that agree on every other coordinate. E.g. dp=2, cp=2, tp=2 and dims (dp, cp): two
    # groups of 4 ranks, one per tp coordinate; a rank's tp partner sums in the other group.
    grid = mesh.mesh.permute([i for i in range(len(names)) if i not in keep] + keep)
    mine = None
    for ranks in grid.reshape(-1, math.prod(grid.shape[len(names) - len(keep):])).tolist():
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    comm.name_group(mine, name)
    return mine


# ----------------------------------------------------------------------------------------
# Expert parallelism: the MoE layer with its experts spread over the ep ranks.

class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        # Dropless: the output is exactly as long as the sizes exchanged beforehand say, no
        # capacity padding; rows arrive grouped by source rank, in rank order. The collective
        # reads raw memory, hence .contiguous() (a gradient coming back may be strided).
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        # A row's gradient goes back to the rank that sent the row: the splits swap roles.
        # Every ep rank must reach this call, or the others block in it (see out_rows below).
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        comm.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits,
                               group=ctx.group)
        return out, None, None, None


class AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x; every rank's loss uses y, so ∂/∂x = Σ_ranks ∂loss_r/∂y."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return summed_over(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Not the identity of Megatron's g (ReduceFromTP): there every tp rank computes the
        # same loss from y; here each data rank's loss is a different part of the total.
        # Make it the identity and the balance loss's router gradient comes out 1/(dp·ep·cp)
        # of one process's. parallel_check counts this call: 3 all-reduces per MoE layer and
        # microbatch (statistics, this forward, this backward).
        return summed_over(grad, ctx.group), None


class AttachAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also sends `scale` into the aux loss: the MoE balance
    loss joins the backward pass wherever its layer runs (inside a pipeline stage too)
    without threading it through every return value (the trick Megatron-LM uses)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        # aux is an input only so that autograd walks into its graph (router → probs →
        # AllReduceSum) once backward reaches this layer's output
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        # d(total loss)/d(aux) = scale, whatever flows into x: a 0-d tensor, aux's shape
        return grad, torch.full((), ctx.scale, device=grad.device), None


class ExpertParallelMoE(nn.Module):
    """moe.MoE with experts [r·E/e, (r+1)·E/e) on ep rank r. Dropless: every token goes
    to its top-k experts however unbalanced the routing (no capacity factor, nothing
    dropped; the price is uneven all-to-all sizes, exchanged first).

    The router is replicated. Its balance loss needs the fraction of tokens per expert and
    the mean router probability over the WHOLE microbatch, which is spread over the data
    ranks (dp, ep, cp): both are summed over `stats_group`, so the loss equals one
    process's exactly. Those summed counts are also the loads that loss-free balancing
    (DeepSeek-V3) moves its routing bias by: every rank sees the same global loads, so
    every rank's bias stays identical with no collective of its own (`load_seen`: the
    step's loads so far, summed over microbatches; reset by forward_backward).
    Shared experts (DeepSeekMoE) are replicated like the router: each rank runs them on
    its own tokens, no all-to-all; their gradients are dense ones (summed over the data
    ranks)."""

    def __init__(self, moe: MoE, ep_group, stats_group, aux_scale):
        super().__init__()
        e, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        # Every rank built the whole MoE (same seed) and keeps one contiguous block of E/e
        # experts; the rest go with the full MoE. Contiguity is what lets the dispatch below
        # sort by expert id and get the rows grouped by destination rank for free.
        self.n_expert, self.top_k = len(moe.experts), moe.top_k
        self.ep_size, self.local = e, self.n_expert // e
        self.first = r * self.local
        self.router = moe.router                  # moe.Router: scores, the bias buffer
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + self.local])
        self.shared_experts = moe.shared_experts
        self.ep_group, self.stats_group, self.aux_scale = ep_group, stats_group, aux_scale
        # logging and checks: aux_loss of the last forward, aux_seen its share of the step's
        # logged loss, idle_experts how many experts got no token in a forward, run-long
        self.aux_loss, self.aux_seen, self.idle_experts = None, 0.0, 0
        self.load_seen = None

    def forward(self, x):
        B, T, D = x.shape
        x_flat = x.reshape(-1, D)
        # routing: moe.MoE's own gate (it reads only .router and .top_k, which this layer
        # holds), so both route identically; the balance statistics cover the microbatch
        probs, weights, ids = MoE.gate(self, x_flat)
        weights = weights.type_as(x_flat)         # the gate is fp32; the combine is x's dtype
        aux = self.balance_loss(probs, ids, x_flat.shape[0])

        # dispatch: (token, slot) pairs sorted by expert = grouped by destination rank
        # flat index = token·k + slot, so order // k is each pair's token; stable keeps each
        # expert's tokens in token order: the same rows, in the same order, every run
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k
        send_splits, recv_splits, recv_counts = self.exchange_sizes(flat_ids)
        # x_flat[token_of]: a token is copied once per chosen expert, N·k rows of D go out
        # (less those whose expert is on this rank) and as many come back in the combine
        received = AllToAll.apply(x_flat[token_of], send_splits, recv_splits, self.ep_group)
        out_rows = self.run_local_experts(received, recv_counts)
        # the reverse exchange: each rank gets its own pairs back, in its sorted order
        returned = AllToAll.apply(out_rows, recv_splits, send_splits, self.ep_group)

        # combine: weight each expert output by its gate and add it to its token
        # each pair's gate weight in the same sorted order as `returned`; index_add sums a
        # token's k weighted expert outputs. Shared experts: local tokens, no exchange.
        gate = weights.flatten()[order][:, None]
        out = torch.zeros_like(x_flat).index_add(0, token_of, returned * gate)
        out = AttachAuxLoss.apply(out + MoE.shared(self, x_flat), aux, self.aux_scale)
        return out.view(B, T, D)

    def balance_loss(self, probs, ids, n_local):
        """Switch Transformer's aux loss over the GLOBAL microbatch (its statistics summed
        over the data ranks), and the step's bookkeeping: aux_loss, aux_seen, idle_experts,
        load_seen (the loads loss-free balancing moves its bias by)."""
        device = probs.device
        # f_i's numerators, (token, slot) pairs per expert among this rank's tokens; the token
        # count rides in the same buffer, so ONE all-reduce of E+1 floats gives both totals
        counts = torch.zeros(self.n_expert, device=device).index_add_(
            0, ids.flatten(), torch.ones(ids.numel(), device=device))
        n_tokens = torch.tensor([float(n_local)], device=device)
        stats = torch.cat([counts, n_tokens])
        comm.all_reduce(stats, group=self.stats_group)            # no gradient through f_i
        # P_i's numerator must keep its gradient (the router learns balance through it):
        # a differentiable all-reduce, not an in-place one
        prob_sum = AllReduceSum.apply(probs.sum(0), self.stats_group)
        # Switch Transformer's aux = E · Σ_i f_i · P_i over the GLOBAL microbatch of N tokens:
        # f_i = stats[i] / (N·k), P_i = prob_sum[i] / N; 1 when the load is uniform
        fraction, mean_prob = stats[:-1] / (stats[-1] * self.top_k), prob_sum / stats[-1]
        aux = self.n_expert * (fraction * mean_prob).sum()
        self.aux_loss = aux.detach()
        # .item() (and the .tolist() calls below) wait for the device: a host sync per layer
        # and microbatch, the price of readable bookkeeping and of host-side split sizes
        self.aux_seen += self.aux_scale * aux.item()   # its share of the logged loss
        self.idle_experts += int((stats[:-1] == 0).sum())   # experts that got no token
        self.load_seen = stats[:-1] if self.load_seen is None else self.load_seen + stats[:-1]
        return aux

    def exchange_sizes(self, flat_ids):
        """-> (rows sent to each ep rank, rows received from each, the received rows per
        (source rank, local expert)): the sizes every all-to-all of this layer needs."""
        per_expert = torch.bincount(flat_ids, minlength=self.n_expert)
        send_counts = per_expert.view(self.ep_size, self.local)   # [dest rank, its expert]
        recv_counts = torch.empty_like(send_counts)
        # The receiver must size its buffer before the rows arrive, and needs per-expert
        # counts to know which rows are whose: e·L integers, then the payload itself.
        comm.all_to_all_single(recv_counts, send_counts, group=self.ep_group)  # sizes first
        return send_counts.sum(1).tolist(), recv_counts.sum(1).tolist(), recv_counts

    def run_local_experts(self, received, recv_counts):
        """Each received row through its local expert, in arrival order."""
        # received rows are [source rank][local expert] blocks; recv_counts is (source, local
        # expert) row-major, so its flattened entries are the block lengths in arrival order
        expert_of_row = torch.arange(self.local, device=received.device).repeat(
            self.ep_size).repeat_interleave(recv_counts.flatten())
        # zeros that stay in the graph: when none of this rank's experts gets a token, the
        # backward must still run its two all-to-alls, as every other ep rank's does
        # (torch.zeros_like would cut the graph: no gradient to received, no AllToAll.backward
        # on this rank, and the other ep ranks would wait in theirs forever)
        out_rows = received * 0
        # one call per local expert on a varying number of rows (dropless); production MoE
        # kernels run all experts' matmuls in one grouped GEMM launch instead
        for j, expert in enumerate(self.experts):
            rows = (expert_of_row == j).nonzero(as_tuple=True)[0]
            if rows.numel():                      # an expert may receive no token at all
                out_rows = out_rows.index_add(0, rows, expert(received[rows]))
        return out_rows


# ----------------------------------------------------------------------------------------
# The model on this rank: the full GPT built from the same seed everywhere, then cut down
# to this rank's share along every dimension of the mesh.

@dataclass(frozen=True)
class Placement:
    """Where one trained parameter lives on the mesh. The one table (Shard.placement) that
    sync_gradients, clip_gradients and parallel_check (compare, expected_traffic) read."""
    tp_dim: Optional[int] = None    # sliced along this dim over tp; None = whole on each
    sequence_partial: bool = False  # sp norm weight: its gradient is a partial sum over tp
    expert: bool = False            # an expert's weight: lives on one ep rank only
    # (a pipeline stage needs no field: each parameter lives on exactly one pp rank)


@dataclass
class Shard:
    model: GPT                # the (sliced) model; only `params` are this rank's to train
    stages: dict              # pipeline stage id -> ShardedStage held by this rank
    params: list              # (name in the full model, parameter) trained by this rank
    placement: dict           # name in the full model -> Placement
    groups: dict              # "tp", "cp", "pp", "ep", "data", "expert_data" -> ProcessGroup
    coords: dict              # this rank's index along each mesh dimension
    positions: torch.Tensor   # global positions of this rank's tokens (context parallel)

    @property
    def activation_bytes(self):
        """Kept for backward by one microbatch's forward through this rank's stages."""
        return sum(stage.activation_bytes for stage in self.stages.values())

    @property
    def expert_layers(self):
        """Every ExpertParallelMoE of the model, other pipeline stages' included: those
        never run here, so their load_seen stays None (the callers skip them)."""
        return [m for m in self.model.modules() if isinstance(m, ExpertParallelMoE)]


class ShardedStage(pipeline.Stage):
    """pipeline.Stage whose every forward runs under SavedActivations: sp keeps shards
    only, and the bytes autograd keeps for one microbatch are recorded on the stage."""

    def __init__(self, *stage_args, gathered):
        super().__init__(*stage_args)
        self.gathered = gathered
        self.activation_bytes = 0
        model = stage_args[0]                        # Stage(model, stage_id, n_stages, ...)
        if self.is_last and len(model.extra_heads):
            self.extra_heads = model.extra_heads     # held (and trained) by the last stage
            self.extra_heads_loss = model.extra_heads_loss

    def forward(self, x, targets=None):
        # one meter per microbatch forward: the bytes autograd keeps until its backward, the
        # activation figure tests/test_parallel.py compares across dp, tp, sp and cp
        with SavedActivations(self, self.gathered) as saved:
            if self.is_last and targets is not None and hasattr(self, "extra_heads"):
                out = self.forward_with_heads(x, targets)
            else:
                out = super().forward(x, targets)
        self.activation_bytes = saved.bytes
        return out

    def forward_with_heads(self, x, targets):
        """pipeline.Stage.forward plus the extra (MTP) heads' loss on the final hidden
        state, as GPT.loss adds it (check_layout: whole sequences, whole vocabulary)."""
        if self.is_first:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, self.cos, self.sin)
        h = self.norm(x)      # the final hidden state feeds the main head and the extra heads
        extra, _ = self.extra_heads_loss(h, targets)
        return self.loss_fn(self.output(h), targets) + extra


def build_shard(cfg, layout, mesh, seq_len, device):
    """This rank's Shard: the whole GPT built from seed 0 (identical on every rank), cut in
    place -- tp slices, cp ring attention, ep experts, pp stages -- with its parameters'
    Placement. Every rank runs the same calls in the same order (new_group is collective)."""
    coords = {d: mesh.get_local_rank(d) for d in DIMS}
    groups = {d: mesh.get_group(d) for d in DIMS}
    # the gradient-sum groups: a dense weight is replicated over dp, ep and cp (each copy saw
    # other tokens); an expert exists on one ep rank, so its copies differ in dp and cp only
    groups["data"] = group_over(mesh, ("dp", "ep", "cp"), "data")     # dense gradients
    groups["expert_data"] = group_over(mesh, ("dp", "cp"), "dp·cp")  # expert gradients
    # The whole model on every rank first -- memory for all of it, briefly: simple, and the
    # same weights as --check's one process. At 405B impossible: real frameworks build on
    # the meta device and initialise only their own shard.
    model = GPT(cfg, seed=0).to(device)
    gathered = GatheredInputs()
    sliced = {}
    if layout.tp > 1:         # slices in place, names unchanged: {name: dim sliced along}
        sliced = apply_tensor_parallel(model, groups["tp"], gathered if layout.sp else None)
    # RoPE and the causal mask need GLOBAL positions: under cp this rank holds chunks r and
    # 2cp-1-r (zigzag), not tokens 0..T/cp-1; each layer's attention becomes ring attention
    positions = torch.arange(seq_len, device=device)
    if layout.cp > 1:
        positions = cp_positions(seq_len, coords["cp"], layout.cp, layout.zigzag, device)
        for block in model.layers:
            block.attention.attn_fn = make_ring_attn_fn(groups["cp"], positions)
    if cfg.n_expert:
        # the balance loss enters backward once per layer and microbatch; each of the cp
        # ranks of a sequence injects it, so 1/cp each (see ExpertParallelMoE)
        scale = cfg.moe_aux_coef / (cfg.n_layer * layout.microbatches * layout.cp)
        for block in model.layers:
            block.feed_forward = ExpertParallelMoE(block.feed_forward, groups["ep"],
                                                   groups["data"], scale)
    model.to(device)
    cos, sin = model.rope(positions)  # looked up once, shared by every stage of this rank
    loss_fn = make_loss_fn(layout, groups, model)
    stages = pipeline.build_stages(model, layout.schedule, layout.pp, coords["pp"], loss_fn,
                                   cos, sin, make_stage=partial(ShardedStage, gathered=gathered))
    # this rank trains its stages' parameters, listed under the FULL model's names (local
    # expert j → r·E/e + j), so that --check finds each one's reference tensor by name
    held = {id(p) for stage in stages.values() for p in stage.parameters()}
    params = [(_full_name(n, model), p) for n, p in model.named_parameters() if id(p) in held]
    placement = _placements(model, sliced, sp=layout.sp and layout.tp > 1)
    for p in model.parameters():
        if id(p) not in held:   # another pipeline stage's: built only so that every rank
            p.data = torch.empty(0, device=device)   # draws the same weights; freed now
    return Shard(model, stages, params, placement, groups, coords, positions)


def _placements(model, sliced, sp):
    """The placement table, by name in the full model. Under sp the norms see only their
    sequence shard, so their weight gradients are partial sums over the tp ranks (summed
    once per step, before the optimizer)."""
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
               for p in m.experts.parameters()}
    # the 1-D parameters are the RMSNorm gains (no Linear here has a bias); under sp each
    # sees a sequence shard. Without sp they see whole sequences: plain tp copies.
    return {_full_name(name, model): Placement(tp_dim=sliced.get(name),
                                               sequence_partial=sp and p.dim() == 1,
                                               expert=id(p) in experts)
            for name, p in model.named_parameters()}


def _full_name(name, model):
    """Local expert j on ep rank r is expert r·E/e + j of the full model."""
    parts = name.split(".")         # "layers.{i}.feed_forward.experts.{j}.w1.weight"
    if "experts" in parts:
        i = parts.index("experts")
        moe = model.layers[int(parts[1])].feed_forward
        parts[i + 1] = str(moe.first + int(parts[i + 1]))
    return ".".join(parts)


def make_loss_fn(layout, groups, model):
    """Cross-entropy of the microbatch, as the part this rank contributes: with context
    parallelism each rank sums over its tokens and divides by the microbatch's tokens on
    ALL cp ranks, so the cp ranks' losses (and gradients) add up to the mean."""
    def loss_fn(logits, targets):
        if layout.tp > 1:
            # logits are this rank's V/t vocabulary columns: 3 all-reduces of one number per
            # token (max, Σexp, target logit) instead of gathering b·s·V logits
            start = model.tok_embeddings.start
            per_token = VocabParallelCrossEntropy.apply(logits, targets, start, groups["tp"])
        else:
            per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                        reduction="none")
        # Σ over this rank's tokens ÷ the microbatch's tokens on ALL cp ranks: a partial
        # mean. Divide by the local count alone and, summed over cp in sync_gradients, the
        # gradient is cp times one process's.
        return per_token.sum() / (targets.numel() * layout.cp)
    return loss_fn


def microbatches_for(shard, layout, x, y):
    """This rank's part of the global batch: its data replica's rows (dp·ep replicas),
    cut into M microbatches, and its context-parallel slice of each sequence."""
    # the replica's index on the (dp, ep) plane, ep fastest as in the mesh; the one process
    # (parallel_check.reference_step) builds microbatch m from block m of every replica
    replicas = layout.dp * layout.ep
    replica = shard.coords["dp"] * layout.ep + shard.coords["ep"]
    rows = x.shape[0] // replicas
    mb = rows // layout.microbatches
    xs, ys = [], []
    for m in range(layout.microbatches):
        sl = slice(replica * rows + m * mb, replica * rows + (m + 1) * mb)
        xi, yi = x[sl], y[sl]
        if layout.cp > 1:     # x and y cut alike: each target stays with its token
            xi = cp_shard(xi, 1, shard.coords["cp"], layout.cp, layout.zigzag)
            yi = cp_shard(yi, 1, shard.coords["cp"], layout.cp, layout.zigzag)
        # get_batch's x and y are strided views of one (B, T+1) buffer: own, dense copies
        xs.append(xi.contiguous())
        ys.append(yi.contiguous())
    return xs, ys


# ----------------------------------------------------------------------------------------
# One training step

def forward_backward(shard, layout, xs, ys, timeline=None):
    """Loss and gradients of this rank's share of the step. Returns the loss this rank saw
    (a partial sum under cp, 0 on pipeline ranks without the last stage) plus its MoE
    layers' share of the balance loss."""
    moes = [m for m in shard.model.modules() if isinstance(m, ExpertParallelMoE)]
    # per-step bookkeeping: load_seen must sum THIS step's microbatches only (balance_experts
    # moves the bias by it after the optimizer step); aux_seen likewise
    for moe in moes:
        moe.aux_seen = 0.0
        moe.load_seen = None
    return _forward_backward(shard, layout, xs, ys, timeline) + sum(m.aux_seen for m in moes)


def _forward_backward(shard, layout, xs, ys, timeline):
    if layout.pp > 1:
        P = layout.pp
        actions = pipeline.build_schedule(layout.schedule, P, layout.microbatches)
        # P2P receive buffers are allocated before the data arrives, so every stage must
        # know the boundary activation: (rows, this rank's tokens, width) -- T/(cp·tp) under
        # sp, whose residual stream is a sequence shard. fp32 as the model: a bf16 model
        # would need the dtype below changed too, or the receives mismatch.
        T_local = xs[0].shape[1] // (layout.tp if layout.sp else 1)
        shape = (xs[0].shape[0], T_local, shard.model.config.n_embd)
        loss = pipeline.run_schedule(shard.stages, actions[shard.coords["pp"]], xs, ys,
                                     shard.groups["pp"], shape, torch.float32,
                                     xs[0].device, timeline)
        return loss or 0.0    # run_schedule: the last stage's mean over M, None elsewhere
    # no pipeline: plain gradient accumulation, each backward adding loss/M into .grad, so M
    # microbatches of b rows give the gradient of one batch of M·b rows
    stage = shard.stages[0]
    total = 0.0
    for x, y in zip(xs, ys):
        loss = stage(x, y)
        (loss / layout.microbatches).backward()
        total += loss.item() / layout.microbatches
    return total


def sync_gradients(shard, layout):
    """Sum what is partial, average what is replicated:
    - sequence-parallel norm weights saw 1/t of the tokens each: sum over tp;
    - every parameter saw 1/cp of each sequence and 1/(dp·ep) of the batch: sum over the
      data ranks, divide by the number of replicas dp·ep (the loss is a mean per replica);
    - an expert lives on one ep rank and already received the tokens of every ep rank:
      sum over dp and cp only, divide by dp·ep all the same."""
    # all_reduce_flat concatenates its list into ONE buffer: ranks whose lists differed in
    # length would all-reduce different sizes (an error, or a hang)
    for _, p in shard.params:       # an expert that received no token has no gradient:
        if p.grad is None:          # zeros, so every rank's bucket has the same layout
            p.grad = torch.zeros_like(p)
    where = [(shard.placement[name], p.grad) for name, p in shard.params]
    # Three calls, in the same order on every rank. Cost of the dense one: payload 4 bytes
    # per dense parameter this rank holds, 2(N-1)/N of it on the wire (ring, N ranks). DDP
    # overlaps such buckets with backward; here they run once, after it.
    all_reduce_flat([g for pl, g in where if pl.sequence_partial], shard.groups["tp"])
    replicas = layout.dp * layout.ep
    all_reduce_flat([g for pl, g in where if not pl.expert], shard.groups["data"],
                    divide_by=replicas)
    all_reduce_flat([g for pl, g in where if pl.expert], shard.groups["expert_data"],
                    divide_by=replicas)


def clip_gradients(shard, layout, max_norm):
    """torch.nn.utils.clip_grad_norm_ over a model that no rank holds whole: each rank adds
    ‖g‖² of its parameters divided by the number of ranks holding an identical copy, and
    one all-reduce over the world gives the global norm."""
    # fp64: the sum of squares over ranks keeps its rounding far below --check's 1e-4
    # tolerance on the norm, whatever order the ranks add in
    local = torch.zeros((), dtype=torch.float64, device=shard.positions.device)
    for name, p in shard.params:
        if p.grad is None:
            continue
        where = shard.placement[name]
        # e.g. a norm gain under dp=2, tp=2: 4 ranks hold the same synced gradient and each
        # adds ‖g‖²/4. No pp factor: each stage's parameters live on one pp rank.
        copies = layout.dp * layout.cp * (1 if where.expert else layout.ep)
        copies *= 1 if where.tp_dim is not None else layout.tp
        local += p.grad.double().pow(2).sum() / copies
    # over the WORLD: every rank gets the same norm and makes the same clipping decision;
    # a per-rank norm would scale slices differently and the replicas would drift apart
    comm.all_reduce(local)
    norm = local.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for _, p in shard.params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))   # clip_grad_norm_'s factor and ε
    return norm


def make_optimizer(params, args):
    """AdamW, decay on matrices only (as train.py). AdamW is elementwise, so each rank
    updating its slices equals one process updating the whole tensors."""
    # a slice keeps its tensor's ndim, so the same parameters decay as on one process
    groups = decay_groups([(p, p.dim()) for p in params], args.weight_decay)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def learning_rate(step, args):
    """Linear warm-up, then cosine decay to lr/10 (recipe.warmup_cosine, as train.py)."""
    return warmup_cosine(step, args.steps, args.warmup_steps, args.lr, args.lr / 10)


# ----------------------------------------------------------------------------------------
# Training

def global_loss(local, layout, device):
    """The step's mean loss from the ranks' shares (bookkeeping, not metered as model
    traffic): last-stage ranks hold it, cp ranks partial sums, tp ranks copies."""
    t = torch.tensor([local], dtype=torch.float64, device=device)
    if dist.is_initialized():     # dist, not comm: kept out of the ledger and its formulas
        dist.all_reduce(t)
    # ÷ tp: each tp rank holds the whole loss; ÷ dp·ep: the replicas' means are averaged.
    # cp ranks hold partial sums and pp ranks different parts (the cross-entropy on the last
    # stage, each stage its layers' balance-loss share): those add up, undivided.
    return t.item() / (layout.tp * layout.dp * layout.ep)


def train_step(shard, layout, optimizer, batch, grad_clip, timeline):
    """One optimizer step of this rank: forward and backward of its microbatches (through
    the pipeline schedule when pp > 1), sum/average the gradients, clip, AdamW.
    Returns (the loss this rank saw, the global gradient norm)."""
    xs, ys = microbatches_for(shard, layout, *batch)
    optimizer.zero_grad(set_to_none=True)
    local = forward_backward(shard, layout, xs, ys, timeline)
    # clip after the sync (the norm of the global gradient), the bias after the step
    # (DeepSeek-V3 moves it at the end of each step, by that step's loads)
    sync_gradients(shard, layout)
    norm = clip_gradients(shard, layout, grad_clip)
    optimizer.step()
    balance_experts(shard)
    return local, norm


def balance_experts(shard):
    """Loss-free balancing after the optimizer step (DeepSeek-V3; moe.Router.update_bias):
    each MoE layer this rank holds moves its bias by the step's loads, which its forwards
    already summed over the data ranks -- identical on every rank, nothing more sent."""
    for moe in shard.expert_layers:   # no bias under aux-loss balancing; None: not our stage
        if moe.load_seen is not None and moe.router.expert_bias is not None:
            moe.router.update_bias(moe.load_seen, shard.model.config.moe_bias_rate)


def expert_imbalance(shard):
    """-> (max/mean tokens per expert, max/mean rows each ep rank receives) in the last
    step, averaged over this rank's MoE layers; None without experts. The all-to-all moves
    the same rows however they are routed; the busiest rank's share is what waits."""
    ran = [m.load_seen for m in shard.expert_layers if m.load_seen is not None]
    if not ran:
        return None
    e = shard.groups["ep"].size()
    # experts are contiguous per ep rank: row r of view(e, E/e) sums what rank r receives
    per_rank = [load.view(e, -1).sum(1) for load in ran]
    return (sum(float(load.max() / load.mean()) for load in ran) / len(ran),
            sum(float(load.max() / load.mean()) for load in per_rank) / len(ran))


def log_line(step, loss, norm, lr, seconds, args, shard, optimizer, imbalance):
    """step | loss | grad norm | lr | tok/s | state per rank | sent per step [| experts]"""
    # state: this rank's parameters, gradients and AdamW moments -- what tp, pp and ep
    # divide; sent: its wire bytes (meters.CommMeter's ring formulas) per step so far
    held = parallel_check.state_bytes(shard, optimizer)["total"]
    line = (f"step {step:4d} | loss {loss:.4f} | grad norm {norm:.3f} | lr {lr:.2e} | "
            f"{args.batch_size * args.seq_len / seconds / 1e3:.1f}k tok/s | state "
            f"{fmt_bytes(held)}/rank | sent {fmt_bytes(comm.total_wire / (step + 1))}/step")
    if imbalance:
        line += (f" | max/mean tokens per expert {imbalance[0]:.2f}, per ep rank "
                 f"{imbalance[1]:.2f}")
    return line


def balance_summary(balance, cfg):
    """The run's mean of the per-step (per expert, per ep rank) max/mean loads."""
    per_expert = sum(b[0] for b in balance) / len(balance)
    per_rank = sum(b[1] for b in balance) / len(balance)
    return (f"experts ({cfg.moe_balance}): max/mean tokens per expert {per_expert:.3f}, "
            f"rows per ep rank {per_rank:.3f}, mean over {len(balance)} steps")


def start_run(args, rt, layout, cfg):
    """Every rank checks the layout (one clear error, never a hang), then loads the corpus
    and builds its shard: -> (corpus, shard)."""
    if not rt.distributed:
        raise UserError(f"parallel.py trains under torchrun: torchrun --standalone "
                        f"--nproc_per_node={layout.world} parallel.py ... (dp·ep·pp·cp·tp "
                        f"processes)")
    check_layout(layout, cfg, rt.world_size, args.batch_size, args.seq_len)
    seed_everything(args.seed)  # global RNGs; the weights come from GPT's own seed-0 generator
    corpus = data.load_corpus(args.data, vocab_size=cfg.vocab_size)
    shard = build_shard(cfg, layout, build_mesh(layout, rt.device), args.seq_len, rt.device)
    return corpus, shard


def print_summary(args, rt, layout, cfg, shard, optimizer, pipeline_run, balance, elapsed):
    """After the last step: the ledger (bytes each group sent, checked against the formulas
    under --check), the last step's pipeline timeline (pipeline_run: its records and their
    common zero), the expert balance, the time."""
    print0(parallel_check.ledger(shard, layout, cfg, args, rt, optimizer))
    if args.check:
        parallel_check.check_traffic(shard, layout, cfg, args)
    if layout.pp > 1:           # the last step, as each pipeline rank of this column ran it
        timeline, t_pipe = pipeline_run
        timelines = pipeline.gather_timelines(timeline, t_pipe, shard.groups["pp"])
        print0(pipeline.format_timeline(timelines, layout.schedule, layout.microbatches))
    if balance:
        print0(balance_summary(balance, cfg))
    print0(f"trained {args.steps} steps in {elapsed:.1f} s")


def train(args, rt):
    """The run: this rank's shard trained args.steps steps, a log line each (checked against
    one process under --check), then the summary. -> figures the tests compare."""
    layout, cfg = layout_from(args), model_config(args)
    corpus, shard = start_run(args, rt, layout, cfg)
    optimizer = make_optimizer([p for _, p in shard.params], args)
    optimizers = [optimizer]
    if args.check:              # one process, same seed and batches (parallelism/parallel_check.py)
        ref = parallel_check.build_reference(cfg, rt.device)
        ref_optimizer = make_optimizer(list(ref.parameters()), args)
        optimizers.append(ref_optimizer)
    print0(f"model {args.preset}: {GPT(cfg, seed=None).num_params():,} params | layout "
           f"{layout} on {rt.world_size} ranks ({rt.backend}) | rank 0 holds "
           f"{sum(p.numel() for _, p in shard.params):,} | batch {args.batch_size}×"
           f"{args.seq_len} tokens | corpus {corpus.name}")
    if layout.pp > 1 and args.print_schedule:
        print0(pipeline.format_schedule(
            pipeline.build_schedule(layout.schedule, layout.pp, layout.microbatches)))
    comm.reset()                # the ledger counts the training steps' collectives only
    timeline, t_pipe, balance, elapsed = [], None, [], 0.0
    for step in range(args.steps):
        lr = learning_rate(step, args)
        for group in (g for opt in optimizers for g in opt.param_groups):
            group["lr"] = lr
        # the same global batch on every rank (seeded by (seed, step), rank left at 0): each
        # rank takes its share in microbatches_for, and no data is ever sent
        batch = data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed, step,
                               device=rt.device)
        timeline.clear()
        if layout.pp > 1:       # a common zero for the timeline (bookkeeping, unmetered)
            dist.barrier(group=shard.groups["pp"])
            t_pipe = time.perf_counter()
        # StepTimer waits for the GPU's queued kernels: the clock stops when they are done
        with StepTimer(rt.device) as clock:
            local, norm = train_step(shard, layout, optimizer, batch, args.grad_clip,
                                     timeline)
        elapsed += clock.seconds
        loss = global_loss(local, layout, rt.device)
        imbalance = expert_imbalance(shard)
        if imbalance:
            balance.append(imbalance)
        print0(log_line(step, loss, norm, lr, clock.seconds, args, shard, optimizer,
                        imbalance))
        if args.check:
            parallel_check.check_step(step, shard, layout, ref, ref_optimizer, batch,
                                      (loss, norm), args.grad_clip, lr, optimizer)
    print_summary(args, rt, layout, cfg, shard, optimizer, (timeline, t_pipe), balance,
                  elapsed)
    return dict(loss=loss, activation_bytes=shard.activation_bytes,
                state_bytes=parallel_check.state_bytes(shard, optimizer)["total"],
                seconds=elapsed)


# ----------------------------------------------------------------------------------------
# bench-tp: this file's tensor parallelism next to PyTorch's DTensor TP. parallel.py builds
# its own split model and loss; parallelism/parallel_check.py builds DTensor's, runs and
# compares both.

def bench_tp(args, rt, conditions=None):
    """Hand TP vs DTensor TP (parallelism/parallel_check.py times and prints both), then
    one warning line when core.runtime.TimingConditions (None: the machine's own) finds
    the machine too loaded to trust the step times."""
    conditions = conditions or TimingConditions()
    if not rt.distributed:
        raise UserError("bench-tp compares tensor-parallel runs: launch it with torchrun "
                        "--standalone --nproc_per_node=T parallel.py bench-tp")
    cfg = model_config(args)
    layout = Layout(tp=rt.world_size)       # every rank in one tp group, nothing else
    check_layout(layout, cfg, rt.world_size, args.batch_size, args.seq_len)
    mesh = build_mesh(layout, rt.device)
    tp_group = mesh.get_group("tp")
    hand = GPT(cfg, seed=0).to(rt.device)
    apply_tensor_parallel(hand, tp_group)

    def hand_loss(x, y):        # GPT.forward gives this rank's vocabulary slice of logits
        logits, _ = hand(x)
        start = hand.tok_embeddings.start
        # the mean over tokens, as F.cross_entropy under DTensor's loss_parallel() computes
        return VocabParallelCrossEntropy.apply(logits, y, start, tp_group).mean()

    corpus = data.load_corpus(args.data, vocab_size=cfg.vocab_size)
    # steps + 1 batches: the first step of each side is an untimed warm-up (allocations,
    # DTensor's caches), see parallel_check._time_steps
    batches = [data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed, s,
                              device=rt.device) for s in range(args.steps + 1)]
    # the load only: parallel_check keeps its per-step times to itself, so no spread here
    with conditions:
        parallel_check.bench_against_dtensor(hand, hand_loss, cfg, mesh["tp"], batches,
                                             rt.device)
    conditions.report(out=print0)


# ----------------------------------------------------------------------------------------
# Command line: every knob once, a row each (flag, default, help; core/cli.py makes the
# flags). The layout's knobs become a Layout, the model's overrides a config.

def layout_from(args):
    return Layout(dp=args.dp, ep=args.ep, pp=args.pp, cp=args.cp, tp=args.tp, sp=args.sp,
                  zigzag=args.cp_layout == "zigzag", schedule=args.schedule,
                  microbatches=args.microbatches)


def model_config(args):
    """The preset with the overrides given (CONFIG_KNOBS); the RoPE table (and the check
    on positions) must cover --seq-len."""
    return get_config(args.preset, **given(args, CONFIG_KNOBS),
                      block_size=max(args.seq_len, get_config(args.preset).block_size))


MODE_KNOBS = [
    knob("mode", "train", "train (default) or bench-tp", nargs="?",
         choices=("train", "bench-tp")),
]

LAYOUT_KNOBS = [
    knob("--dp", 1, "data-parallel replicas"),
    knob("--ep", 1, "expert parallelism: ranks the MoE experts are spread over (each also "
         "takes its own share of the batch, like dp)"),
    knob("--pp", 1, "pipeline stages (parallelism/pipeline.py)"),
    knob("--cp", 1, "context parallelism (ring attention)"),
    knob("--tp", 1, "tensor parallelism (Megatron)"),
    knob("--sp", False, "sequence parallelism inside the tp group (norms on sequence shards)"),
    knob("--cp-layout", "zigzag", "how the sequence is cut for cp: zigzag (rank r holds chunks "
         "r and 2C-1-r: balanced causal work) or plain contiguous chunks",
         choices=("zigzag", "plain")),
    knob("--schedule", "1f1b", "pipeline schedule when --pp > 1", choices=pipeline.SCHEDULES),
    knob("--microbatches", int, "microbatches per step; when not given: 2·pp (1 without a "
         "pipeline)"),
    knob("--print-schedule", False, "print each pipeline rank's action list before training"),
]

# the model settings get_config takes as overrides of --preset (None: the preset's own)
CONFIG_KNOBS = [
    knob("--n-layer", int, "override the preset's layer count"),
    knob("--n-head", int, "override the preset's attention heads"),
    knob("--n-kv-head", int, "override the preset's KV heads"),
    knob("--n-embd", int, "override the preset's width"),
    knob("--vocab-size", int, "override the preset's tokenizer vocabulary (a BPE of that "
         "size is trained once and cached)"),
    knob("--n-expert", int, "override the preset's expert count"),
    knob("--n-shared-expert", int, "override the preset's always-on shared experts "
         "(DeepSeekMoE)"),
    knob("--moe-score", None, "override the preset's router affinities",
         choices=("softmax", "sigmoid")),
    knob("--moe-balance", None, "override the preset's balancing: Switch aux loss, or "
         "DeepSeek-V3's routing bias", choices=("aux", "loss_free")),
    knob("--moe-bias-rate", float, "override γ of the loss-free bias"),
    knob("--moe-aux-coef", float, "override the balance loss's weight"),
    knob("--n-extra-heads", int, "override the preset's extra (MTP) next-token heads"),
]

MODEL_AND_DATA_KNOBS = [
    knob("--preset", "small", "model preset from model.py"),
    *CONFIG_KNOBS,
    knob("--data", None, "a UTF-8 text file, documents separated by <|endoftext|>; when not "
         "given: the built-in corpus (see core/data.py)"),
    knob("--batch-size", 8, "global batch, in sequences"),
    knob("--seq-len", 64, "tokens per sequence"),
]

TRAINING_KNOBS = [
    knob("--steps", 20, "optimizer steps"),
    knob("--lr", 1e-3, "AdamW peak learning rate"),
    knob("--warmup-steps", 5, "linear warm-up steps"),
    knob("--weight-decay", 0.1, "AdamW weight decay (matrices only)"),
    knob("--grad-clip", 1.0, "clip the global gradient norm (0 = off)"),
    knob("--seed", 1337, "data seed (weights: seed 0)"),
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--check", False, "also run one process on the same batches and assert that loss, "
         "every gradient and every weight match at every step"),
]

KNOBS = {None: MODE_KNOBS, "layout (world size = dp·ep·pp·cp·tp)": LAYOUT_KNOBS,
         "model and data": MODEL_AND_DATA_KNOBS, "training": TRAINING_KNOBS}


def parse_args(argv=None):
    p = ArgumentParser(
        prog="parallel.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train the shared GPT split along a (dp, ep, pp, cp, tp) DeviceMesh, by "
                    "hand; --check compares every step with one process. Other modes: "
                    "`parallel.py bench-tp` (hand TP vs DTensor TP, under torchrun) and "
                    "`python parallel.py plan --help` (layout planner).")
    for title, knobs in KNOBS.items():
        add_knobs(p, knobs, title)
    args = p.parse_args(argv)
    if args.microbatches is None:   # M = 2P: 1F1B idles (P-1)/(3P-1) of the step, under 1/3
        args.microbatches = 1 if args.pp == 1 else 2 * args.pp
    require_at_least_one(args, ("steps", "batch_size", "seq_len", "microbatches",
                                "warmup_steps"))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:                # arithmetic only: parallelism/planner.py, no torchrun
        p = ArgumentParser(prog="parallel.py plan", description=(
            "Per-GPU memory and communication of candidate (tp, cp, pp, dp) layouts for a "
            "big model, and the three-step cheat sheet that picks one."))
        planner.add_plan_arguments(p)
        print(planner.plan(p.parse_args(argv[1:])))
        return
    args = parse_args(argv)
    with setup_runtime(args.device) as rt:
        if args.mode == "bench-tp":
            return bench_tp(args, rt)
        return train(args, rt)


if __name__ == "__main__":
    run_cli(main)
