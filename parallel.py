"""
parallel.py -- when data parallelism is not enough: split the model itself, along five axes.

One DeviceMesh with named dimensions (dp, ep, pp, cp, tp) -- world = dp·ep·pp·cp·tp -- and
the shared GPT split along each of them, by hand:

  tp  tensor parallelism (Megatron-LM, Shoeybi et al. 2019): inside a layer. wq/wk/wv and
      w1/w3 split by output columns (heads and KV heads per rank), wo and w2 by input
      rows, so each attention/MLP needs ONE all-reduce forward and one backward: the "f"
      and "g" conjugate operators below. The embedding and the output head are split by
      vocabulary; the cross-entropy is computed on the vocabulary shards and never
      gathers the (b·s·V) logits.
      saves: weights, grads, optimizer states ÷ t; the activations inside the regions
             ÷ t (measured ×0.63 overall at t=2: norms, residual, embeddings stay whole).
      adds:  per layer 4 all-reduces of b·s·h activations (2 forward, 2 backward), on the
             critical path (nothing to overlap them with): keep tp inside a node.
  sp  sequence parallelism (Korthikanti et al. 2022), on top of tp: the norms and the
      residual stream are split along the sequence; each all-reduce becomes a
      reduce-scatter + all-gather of the same total volume.
      saves: the activations tp left replicated, ÷ t (measured ×0.50 overall at t=2).
      adds:  2 all-gathers per layer in backward (the inputs saved as shards are gathered
             again); norm-weight gradients all-reduced over tp once per step.
  cp  context parallelism (ring_attention.py, next door; Liu et al. 2023): the sequence
      split across ranks everywhere, attention computed block by block while K/V travel
      round a ring.
      Zigzag sharding balances the causal triangle. saves: activations ÷ c (long context).
      adds:  per layer (c−1)/c of K and V sent forward, twice that backward.
  pp  pipeline parallelism (pipeline.py, next door): the layers split into stages.
      saves: weights/grads/optimizer ÷ p.  adds: a bubble of idle time, P2P activations.
  ep  expert parallelism (GShard, Lepikhin et al. 2020): the MoE experts spread over
      ranks, tokens sent to their experts and back with all-to-all (uneven splits).
      saves: expert weights ÷ e.  adds: 2 all-to-alls forward and 2 backward per layer.
  dp  data parallelism: whatever is left replicates the model and averages gradients.

Every technique is checked against one process running the same model on the same global
batch (`--check`, tests/test_parallel.py): loss, every gradient (each rank its slices), the
weights after the optimizer step. Every collective goes through plumbing.comm, so the ledger prints
the bytes each group sent per step next to the formulas.

    torchrun --standalone --nproc_per_node=4 parallel.py --tp 2 --cp 2 --sp --check
    torchrun --standalone --nproc_per_node=8 parallel.py --dp 2 --pp 2 --tp 2 --schedule 1f1b
    torchrun --standalone --nproc_per_node=2 parallel.py bench-tp     (hand TP vs DTensor)
    python parallel.py plan --params 405B --layers 126 --hidden 16384 --seq 8192 --gpus 16384
"""
import argparse
import math
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import data
import pipeline
import planner
from ring_attention import cp_positions, cp_shard, make_ring_attn_fn, ring_traffic_formula
from model import GPT, MoE, get_config
from plumbing import (ActivationMeter, UserError, comm, fmt_bytes, model_state_bytes, print0,
                      require_at_least_one, run_cli, seed_everything, setup_runtime)

DIMS = ("dp", "ep", "pp", "cp", "tp")     # outermost to innermost: tp talks the most,
                                          # so its ranks are neighbours (same node)


# ----------------------------------------------------------------------------------------
# The layout and its mesh

@dataclass
class Layout:
    dp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False          # sequence parallelism inside the tp group
    zigzag: bool = True       # context parallelism: zigzag (balanced) or plain chunks
    schedule: str = "1f1b"
    microbatches: int = 1

    @property
    def world(self):
        return self.dp * self.ep * self.pp * self.cp * self.tp

    def __str__(self):
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
    for d in DIMS:
        if getattr(L, d) < 1:
            raise UserError(f"--{d} must be at least 1, got {getattr(L, d)}")
    if L.world != world:
        raise UserError(f"the layout {' × '.join(f'{d} {getattr(L, d)}' for d in DIMS)} "
                        f"needs {L.world} processes, but {world} were launched")
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
    if cfg.n_extra_heads:
        raise UserError("extra next-token heads are not split by parallel.py")
    if cfg.tie_embeddings and (L.tp > 1 or L.pp > 1):
        raise UserError("tied embeddings would live on two tp slices / pipeline stages: "
                        "parallel.py splits untied models only")
    chunks = L.cp * (2 if L.zigzag and L.cp > 1 else 1)
    if seq_len % chunks:
        raise UserError(f"--seq-len {seq_len} is not divisible into {chunks} equal chunks "
                        f"(context parallelism {'zigzag 2·' if L.zigzag else ''}cp)")
    if L.sp and (seq_len // L.cp) % L.tp:
        raise UserError(f"--sp: each rank's {seq_len // L.cp} tokens do not split evenly "
                        f"over tp={L.tp}")
    replicas = L.dp * L.ep
    if batch_size % (replicas * L.microbatches):
        raise UserError(f"--batch-size {batch_size} is not divisible into {replicas} data "
                        f"replicas × {L.microbatches} microbatches")
    if L.pp > 1:
        pipeline.split_layers(cfg.n_layer, L.pp * (2 if L.schedule == "dualpipev" else 1))
        pipeline.build_schedule(L.schedule, L.pp, L.microbatches)   # raises if M too small


def build_mesh(layout, device):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, tuple(getattr(layout, d) for d in DIMS),
                            mesh_dim_names=DIMS)
    comm.name_mesh(mesh)
    return mesh


def group_over(mesh, dims, name):
    """The process group spanning several mesh dimensions (e.g. dp and cp: the ranks whose
    gradients must be summed) that contains this rank. new_group must be called by every
    rank for every such group, in the same order, so we enumerate them all."""
    names = mesh.mesh_dim_names
    keep = [names.index(d) for d in dims]
    grid = mesh.mesh.permute([i for i in range(len(names)) if i not in keep] + keep)
    mine = None
    for ranks in grid.reshape(-1, math.prod(grid.shape[len(names) - len(keep):])).tolist():
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    comm.name_group(mine, name)
    return mine


# ----------------------------------------------------------------------------------------
# Tensor parallelism: the conjugate operators (Megatron-LM, Sec. 3, Fig. 3).
#
#   f = CopyToTP:    forward identity,   backward all-reduce   (enters a tp region)
#   g = ReduceFromTP: forward all-reduce, backward identity     (leaves a tp region)
# With sequence parallelism the pair becomes
#   GatherSequence:        forward all-gather along the sequence, backward reduce-scatter
#   ReduceScatterSequence: forward reduce-scatter along the sequence, backward all-gather
# (all-reduce = reduce-scatter + all-gather, so the bytes are the same; what changes is
# that the activations between the regions exist only as sequence shards.)

def _summed(t, group):
    """A copy of t summed over the group's ranks (the all-reduce of f, g and the MoE
    statistics below)."""
    t = t.contiguous().clone()
    comm.all_reduce(t, group=group)
    return t


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x, group):
    """(B, T/t, D) shards -> (B, T, D). The collectives concatenate along dim 0, so the
    sequence goes first for the call (Megatron keeps activations as (s, b, h) for this)."""
    n = dist.get_world_size(group)
    x_sbh = x.transpose(0, 1).contiguous()
    out = torch.empty((x_sbh.shape[0] * n, *x_sbh.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x_sbh, group=group)
    return out.transpose(0, 1).contiguous()   # so the matmuls save it, not a copy of it


def _reduce_scatter_seq(x, group):
    """(B, T, D) partial sums -> (B, T/t, D) summed shards."""
    n = dist.get_world_size(group)
    x_sbh = x.transpose(0, 1).contiguous()
    out = torch.empty((x_sbh.shape[0] // n, *x_sbh.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, x_sbh, group=group)
    return out.transpose(0, 1)


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        full = _gather_seq(x, group)
        key = full.untyped_storage().data_ptr()
        _GATHERED[key] = _Gathered(weakref.ref(full), x.detach(), group, [None])
        weakref.finalize(full, _GATHERED.pop, key, None)
        return full

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


# What makes sequence parallelism save memory: wq/wk/wv (w1/w3, the head) save their input
# for backward, and under sp that input is the all-gathered (b, s, h) tensor -- as big as
# without sp. Megatron-LM keeps only this rank's (b, s/t, h) shard and all-gathers again in
# backward (Korthikanti et al. 2022, Sec. 4.2.2: one more all-gather per region, hidden
# behind the weight-gradient matmul on a GPU). Here: autograd's saved-tensor hooks swap a
# gathered tensor for its shard when it is saved and gather it again when backward needs
# it; the three projections that saved it share one re-gather.
_GATHERED = {}        # storage of a live gathered tensor -> _Gathered


@dataclass
class _Gathered:
    full: weakref.ref     # the gathered tensor, while it lives
    shard: torch.Tensor   # this rank's piece: all that backward needs to keep
    group: object
    again: list           # [the re-gathered tensor], shared by everyone who saved it


class _Regather:
    """Stands in, inside the autograd graph, for a saved view of a gathered tensor."""

    def __init__(self, gathered, t):
        self.gathered, self.view = gathered, (t.size(), t.stride(), t.storage_offset())

    def tensor(self):
        g = self.gathered
        if g.again[0] is None:
            g.again[0] = _gather_seq(g.shard, g.group)        # the backward all-gather
        return torch.as_strided(g.again[0], *self.view)


class SavedActivations(ActivationMeter):
    """The activation meter (plumbing.ActivationMeter: counts what autograd keeps), which
    also applies the sp swap above. Wraps every pipeline stage's forward."""

    def __init__(self, model):
        super().__init__(model)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        g = _GATHERED.get(t.untyped_storage().data_ptr())
        if g is None or g.full() is None:
            return super()._pack(t)
        super()._pack(g.shard)                                # what is really kept
        return _Regather(g, t)

    def _unpack(self, packed):
        return packed.tensor() if isinstance(packed, _Regather) else packed


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r·V/t, (r+1)·V/t) of the embedding table. Each rank looks up the
    ids it owns (zeros elsewhere) and the partial results are summed: an all-reduce, or a
    reduce-scatter that also leaves the output sharded along the sequence (sp)."""

    def __init__(self, full: nn.Embedding, group, sequence_parallel):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        rows = full.weight.shape[0] // t
        self.start, self.end = r * rows, (r + 1) * rows
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())
        self.weight.tp_dim = 0
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, ids):
        mine = (ids >= self.start) & (ids < self.end)
        local = F.embedding((ids - self.start) * mine, self.weight) * mine[..., None]
        if self.sequence_parallel:
            return ReduceScatterSequence.apply(local, self.group)
        return ReduceFromTP.apply(local, self.group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary (Megatron-LM, Sec. 3): three
    all-reduces of ONE number per token (max, Σexp, the target's logit) instead of
    gathering b·s·V logits. Per-token losses, fp32. Backward: softmax − one-hot, local."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        comm.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)  # stability only
        shifted = logits - max_logit[..., None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group=group)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target * mine
        target_logit = shifted.gather(-1, local_target[..., None]).squeeze(-1) * mine
        comm.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp / sum_exp[..., None], local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target[..., None], -mine[..., None].to(grad.dtype))
        return grad * grad_loss[..., None], None, None, None


def _slice_linear(linear, dim, group):
    """Keep this rank's 1/t of an nn.Linear's weight: dim 0 (output features) =
    column-parallel, dim 1 (input features) = row-parallel. Heads are contiguous blocks
    of rows in wq/wk/wv, so slicing rows hands each rank whole heads (and the KV heads
    its query heads share: q head j uses KV head j // (n_head/n_kv_head))."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    w = linear.weight.detach()
    size = w.shape[dim] // t
    linear.weight = nn.Parameter(w.narrow(dim, r * size, size).clone())
    linear.weight.tp_dim = dim
    linear.out_features, linear.in_features = linear.weight.shape


def _enter_hook(group, sp):
    op = GatherSequence if sp else CopyToTP
    return lambda module, inputs, output: op.apply(output, group)


def _exit_hook(group, sp):
    op = ReduceScatterSequence if sp else ReduceFromTP
    return lambda module, inputs, output: op.apply(output, group)


def apply_tensor_parallel(model, group, sequence_parallel):
    """Turn the full model (the same on every rank, same seed) into this rank's tp shard,
    in place: slice the weights, and put f (or the sp all-gather) after each norm that
    feeds a parallel region and g (or the sp reduce-scatter) after each row-parallel
    matmul, as forward hooks -- Attention.forward and FeedForward.forward run unchanged on
    the local heads and the local slice of the MLP. Parameter names do not change."""
    for block in model.layers:
        attn, ffn = block.attention, block.feed_forward
        for linear in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
            _slice_linear(linear, 0, group)                      # column-parallel
        for linear in (attn.wo, ffn.w2):
            _slice_linear(linear, 1, group)                      # row-parallel
            linear.register_forward_hook(_exit_hook(group, sequence_parallel))
        for norm in (block.attention_norm, block.ffn_norm):
            norm.register_forward_hook(_enter_hook(group, sequence_parallel))
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group,
                                                  sequence_parallel)
    model.norm.register_forward_hook(_enter_hook(group, sequence_parallel))
    _slice_linear(model.output, 0, group)                        # vocabulary-parallel head
    if sequence_parallel:
        # norms now see only their sequence shard: their weight gradients are partial
        # sums over the tp ranks (summed once per step, before the optimizer)
        for p in model.parameters():
            if p.dim() == 1:
                p.sequence_partial = True


# ----------------------------------------------------------------------------------------
# Expert parallelism: the MoE layer with its experts spread over the ep ranks.

class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        comm.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits,
                               group=ctx.group)
        return out, None, None, None


class AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x; every rank's loss uses y, so ∂/∂x = Σ_ranks ∂loss_r/∂y."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class AttachAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also sends `scale` into the aux loss: the MoE balance
    loss joins the backward pass wherever its layer runs (inside a pipeline stage too)
    without threading it through every return value (the trick Megatron-LM uses)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


class ExpertParallelMoE(nn.Module):
    """model.MoE with experts [r·E/e, (r+1)·E/e) on ep rank r. Dropless: every token goes
    to its top-k experts however unbalanced the routing (no capacity factor, nothing
    dropped; the price is uneven all-to-all sizes, exchanged first).

    The router is replicated. Its balance loss needs the fraction of tokens per expert and
    the mean router probability over the WHOLE microbatch, which is spread over the data
    ranks (dp, ep, cp): both are summed over `stats_group`, so the loss equals one
    process's exactly."""

    def __init__(self, moe: MoE, ep_group, stats_group, aux_scale):
        super().__init__()
        e, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self.n_expert, self.top_k = len(moe.experts), moe.top_k
        self.local = self.n_expert // e
        self.first = r * self.local
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + self.local])
        for p in self.experts.parameters():
            p.expert = True
        self.ep_group, self.stats_group, self.aux_scale = ep_group, stats_group, aux_scale
        self.aux_loss, self.aux_seen, self.idle_experts = None, 0.0, 0

    def forward(self, x):
        B, T, D = x.shape
        x_flat = x.reshape(-1, D)
        # routing: the same arithmetic as model.MoE.route
        probs = torch.softmax(self.router(x_flat).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x_flat)
        counts = torch.zeros(self.n_expert, device=x.device).index_add_(
            0, ids.flatten(), torch.ones(ids.numel(), device=x.device))
        n_tokens = torch.tensor([float(x_flat.shape[0])], device=x.device)
        stats = torch.cat([counts, n_tokens])
        comm.all_reduce(stats, group=self.stats_group)            # no gradient through f_i
        prob_sum = AllReduceSum.apply(probs.sum(0), self.stats_group)
        fraction, mean_prob = stats[:-1] / (stats[-1] * self.top_k), prob_sum / stats[-1]
        aux = self.n_expert * (fraction * mean_prob).sum()
        self.aux_loss = aux.detach()
        self.aux_seen += self.aux_scale * aux.item()   # its share of the logged loss
        self.idle_experts += int((stats[:-1] == 0).sum())   # experts that got no token

        # dispatch: (token, slot) pairs sorted by expert = grouped by destination rank
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k
        per_expert = torch.bincount(flat_ids, minlength=self.n_expert)
        e = self.n_expert // self.local
        send_counts = per_expert.view(e, self.local)              # [dest rank, its expert]
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all_single(recv_counts, send_counts, group=self.ep_group)  # sizes first
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = AllToAll.apply(x_flat[token_of], send_splits, recv_splits, self.ep_group)

        # run the local experts: received rows are [source rank][local expert] blocks
        expert_of_row = torch.arange(self.local, device=x.device).repeat(e).repeat_interleave(
            recv_counts.flatten())
        out_rows = torch.zeros_like(received)
        for j, expert in enumerate(self.experts):
            rows = (expert_of_row == j).nonzero(as_tuple=True)[0]
            if rows.numel():                      # an expert may receive no token at all
                out_rows = out_rows.index_add(0, rows, expert(received[rows]))
        returned = AllToAll.apply(out_rows, recv_splits, send_splits, self.ep_group)

        # combine: weight each expert output by its gate and add it to its token
        gate = weights.flatten()[order][:, None]
        out = torch.zeros_like(x_flat).index_add(0, token_of, returned * gate)
        out = AttachAuxLoss.apply(out, aux, self.aux_scale)
        return out.view(B, T, D)


# ----------------------------------------------------------------------------------------
# The model on this rank: the full GPT built from the same seed everywhere, then cut down
# to this rank's share along every dimension of the mesh.

@dataclass
class Shard:
    model: GPT                # the (sliced) model; only `params` are this rank's to train
    stages: dict              # pipeline stage id -> pipeline.Stage held by this rank
    params: list              # (name in the full model, parameter) trained by this rank
    groups: dict              # "tp", "cp", "pp", "ep", "data", "expert_data" -> ProcessGroup
    coords: dict              # this rank's index along each mesh dimension
    positions: torch.Tensor   # global positions of this rank's tokens (context parallel)

    @property
    def activation_bytes(self):
        """Kept for backward by one microbatch's forward through this rank's stages."""
        return sum(stage.activation_bytes for stage in self.stages.values())


def build_shard(cfg, layout, mesh, seq_len, device):
    coords = {d: mesh.get_local_rank(d) for d in DIMS}
    groups = {d: mesh.get_group(d) for d in DIMS}
    groups["data"] = group_over(mesh, ("dp", "ep", "cp"), "data")     # dense gradients
    groups["expert_data"] = group_over(mesh, ("dp", "cp"), "dp·cp")  # expert gradients
    model = GPT(cfg, seed=0).to(device)
    if layout.tp > 1:
        apply_tensor_parallel(model, groups["tp"], layout.sp)
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
    cos, sin = model.rope(positions)
    loss_fn = make_loss_fn(layout, groups, model)
    stages = pipeline.build_stages(model, layout.schedule, layout.pp, coords["pp"], loss_fn,
                                   cos, sin)
    for stage in stages.values():
        measure_and_keep_shards(stage, model)
    held = {id(p) for stage in stages.values() for p in stage.parameters()}
    params = [(_full_name(n, model), p) for n, p in model.named_parameters() if id(p) in held]
    for p in model.parameters():
        if id(p) not in held:   # another pipeline stage's: built only so that every rank
            p.data = torch.empty(0, device=device)   # draws the same weights; freed now
    return Shard(model, stages, params, groups, coords, positions)


def measure_and_keep_shards(stage, model):
    """Every forward of the stage runs under SavedActivations: sp keeps shards only, and
    the bytes autograd keeps for one microbatch are recorded on the stage."""
    forward = stage.forward
    stage.activation_bytes = 0

    def forward_keeping_shards(*args, **kwargs):
        with SavedActivations(model) as saved:
            out = forward(*args, **kwargs)
        stage.activation_bytes = saved.bytes
        return out
    stage.forward = forward_keeping_shards


def _full_name(name, model):
    """Local expert j on ep rank r is expert r·E/e + j of the full model."""
    parts = name.split(".")
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
            start = model.tok_embeddings.start
            per_token = VocabParallelCrossEntropy.apply(logits, targets, start, groups["tp"])
        else:
            per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                        reduction="none")
        return per_token.sum() / (targets.numel() * layout.cp)
    return loss_fn


def microbatches_for(shard, layout, x, y):
    """This rank's part of the global batch: its data replica's rows (dp·ep replicas),
    cut into M microbatches, and its context-parallel slice of each sequence."""
    replicas = layout.dp * layout.ep
    replica = shard.coords["dp"] * layout.ep + shard.coords["ep"]
    rows = x.shape[0] // replicas
    mb = rows // layout.microbatches
    xs, ys = [], []
    for m in range(layout.microbatches):
        sl = slice(replica * rows + m * mb, replica * rows + (m + 1) * mb)
        xi, yi = x[sl], y[sl]
        if layout.cp > 1:
            xi = cp_shard(xi, 1, shard.coords["cp"], layout.cp, layout.zigzag)
            yi = cp_shard(yi, 1, shard.coords["cp"], layout.cp, layout.zigzag)
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
    for moe in moes:
        moe.aux_seen = 0.0
    return _forward_backward(shard, layout, xs, ys, timeline) + sum(m.aux_seen for m in moes)


def _forward_backward(shard, layout, xs, ys, timeline):
    if layout.pp > 1:
        P = layout.pp
        actions = pipeline.build_schedule(layout.schedule, P, layout.microbatches)
        T_local = xs[0].shape[1] // (layout.tp if layout.sp else 1)
        shape = (xs[0].shape[0], T_local, shard.model.config.n_embd)
        loss = pipeline.run_schedule(shard.stages, actions[shard.coords["pp"]], xs, ys,
                                     shard.groups["pp"], shape, torch.float32,
                                     xs[0].device, timeline)
        return loss or 0.0
    stage = shard.stages[0]
    total = 0.0
    for x, y in zip(xs, ys):
        loss = stage(x, y)
        (loss / layout.microbatches).backward()
        total += loss.item() / layout.microbatches
    return total


def _all_reduce_flat(tensors, group, scale=1.0):
    """One all-reduce for a list of gradients (one bucket), then copy back."""
    if not tensors:
        return
    flat = torch.cat([t.flatten() for t in tensors])
    if dist.get_world_size(group) > 1:
        comm.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def sync_gradients(shard, layout):
    """Sum what is partial, average what is replicated:
    - sequence-parallel norm weights saw 1/t of the tokens each: sum over tp;
    - every parameter saw 1/cp of each sequence and 1/(dp·ep) of the batch: sum over the
      data ranks, divide by the number of replicas dp·ep (the loss is a mean per replica);
    - an expert lives on one ep rank and already received the tokens of every ep rank:
      sum over dp and cp only, divide by dp·ep all the same."""
    for _, p in shard.params:       # an expert that received no token has no gradient:
        if p.grad is None:          # zeros, so every rank's bucket has the same layout
            p.grad = torch.zeros_like(p)
    grads = [(p, p.grad) for _, p in shard.params]
    _all_reduce_flat([g for p, g in grads if getattr(p, "sequence_partial", False)],
                     shard.groups["tp"])
    replicas = layout.dp * layout.ep
    _all_reduce_flat([g for p, g in grads if not getattr(p, "expert", False)],
                     shard.groups["data"], 1.0 / replicas)
    _all_reduce_flat([g for p, g in grads if getattr(p, "expert", False)],
                     shard.groups["expert_data"], 1.0 / replicas)


def clip_gradients(shard, layout, max_norm):
    """torch.nn.utils.clip_grad_norm_ over a model that no rank holds whole: each rank adds
    ‖g‖² of its parameters divided by the number of ranks holding an identical copy, and
    one all-reduce over the world gives the global norm."""
    local = torch.zeros((), dtype=torch.float64, device=shard.positions.device)
    for _, p in shard.params:
        if p.grad is None:
            continue
        copies = layout.dp * layout.cp * (1 if getattr(p, "expert", False) else layout.ep)
        copies *= 1 if hasattr(p, "tp_dim") else layout.tp
        local += p.grad.double().pow(2).sum() / copies
    comm.all_reduce(local)
    norm = local.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for _, p in shard.params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def make_optimizer(params, args):
    """AdamW, decay on matrices only (as train.py). AdamW is elementwise, so each rank
    updating its slices equals one process updating the whole tensors."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def learning_rate(step, args):
    """Linear warm-up, then cosine decay to lr/10 (as train.py)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------------------
# The single-process reference (--check): the same model, seed, global batch and
# microbatches on one rank, with model.py's own code (dense MoE computation, full softmax
# attention, full vocabulary), then the same clipping and AdamW.

def reference_step(ref, layout, x, y):
    """Microbatch m of the reference = microbatch m of every data replica together."""
    replicas, M = layout.dp * layout.ep, layout.microbatches
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
    tensor_of(p) picks the parameter itself or its gradient."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in shard.params:
        full = tensor_of(ref_params[name])
        if hasattr(p, "tp_dim"):
            size = p.shape[p.tp_dim]
            full = full.narrow(p.tp_dim, shard.coords["tp"] * size, size)
        mine = tensor_of(p)
        if mine is None and full is None:
            continue
        if not torch.allclose(mine, full, atol=atol, rtol=rtol):
            raise AssertionError(f"{what} of {name} differs from one process: max |diff| "
                                 f"{(mine - full).abs().max().item():.3e}")
        worst = max(worst, (mine - full).abs().max().item())
    return worst


# ----------------------------------------------------------------------------------------
# Training

def global_loss(local, layout, device):
    """The step's mean loss from the ranks' shares (bookkeeping, not metered as model
    traffic): last-stage ranks hold it, cp ranks partial sums, tp ranks copies."""
    t = torch.tensor([local], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.item() / (layout.tp * layout.dp * layout.ep)


def train(args, rt):
    layout = layout_from(args)
    cfg = model_config(args)
    if not rt.distributed:
        raise UserError(f"parallel.py trains under torchrun: torchrun --standalone "
                        f"--nproc_per_node={layout.world} parallel.py ... (dp·ep·pp·cp·tp "
                        f"processes)")
    check_layout(layout, cfg, rt.world_size, args.batch_size, args.seq_len)
    seed_everything(args.seed)
    corpus = data.load_corpus(args.data, vocab_size=cfg.vocab_size)
    mesh = build_mesh(layout, rt.device)
    shard = build_shard(cfg, layout, mesh, args.seq_len, rt.device)
    optimizer = make_optimizer([p for _, p in shard.params], args)
    ref = ref_optimizer = None
    if args.check:
        ref = GPT(cfg, seed=0).to(rt.device)
        for block in ref.layers:
            if cfg.n_expert:        # the obviously-right dense computation
                block.feed_forward.forward = block.feed_forward.forward_dense
        ref_optimizer = make_optimizer(list(ref.parameters()), args)
    n_params = sum(p.numel() for _, p in shard.params)
    print0(f"model {args.preset}: {GPT(cfg, seed=None).num_params():,} params | layout "
           f"{layout} on {rt.world_size} ranks ({rt.backend}) | rank 0 holds {n_params:,} "
           f"| batch {args.batch_size}×{args.seq_len} tokens | corpus {corpus.name}")
    if layout.pp > 1 and args.print_schedule:
        print0(pipeline.format_schedule(
            pipeline.build_schedule(layout.schedule, layout.pp, layout.microbatches)))
    comm.reset()
    timeline, elapsed = [], 0.0
    for step in range(args.steps):
        lr = learning_rate(step, args)
        for opt in (optimizer, ref_optimizer):
            for group in (opt.param_groups if opt else ()):
                group["lr"] = lr
        x, y = data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed, step,
                              device=rt.device)
        xs, ys = microbatches_for(shard, layout, x, y)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        timeline.clear()
        if layout.pp > 1:       # a common zero for the timeline (bookkeeping, unmetered)
            dist.barrier(group=shard.groups["pp"])
            t_pipe = time.perf_counter()
        local = forward_backward(shard, layout, xs, ys, timeline)
        sync_gradients(shard, layout)
        norm = clip_gradients(shard, layout, args.grad_clip)
        optimizer.step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        elapsed += seconds
        loss = global_loss(local, layout, rt.device)
        print0(f"step {step:4d} | loss {loss:.4f} | grad norm {norm:.3f} | lr {lr:.2e} | "
               f"{args.batch_size * args.seq_len / seconds / 1e3:.1f}k tok/s | state "
               f"{fmt_bytes(state_bytes(shard, optimizer)['total'])}/rank | sent "
               f"{fmt_bytes(comm.total_wire / (step + 1))}/step")
        if ref is not None:     # the same step on one process (.grad still holds ours)
            ref_optimizer.zero_grad(set_to_none=True)
            ref_loss = reference_step(ref, layout, x, y)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), args.grad_clip).item()
            grad_diff = compare(shard, ref, "gradient", lambda p: p.grad, atol=1e-6)
            ref_optimizer.step()
            weight_diff = compare(shard, ref, "weight", lambda p: p.detach(), atol=1e-5)
            if abs(loss - ref_loss) > 1e-5 or abs(norm - ref_norm) > 1e-4 * max(1, ref_norm):
                raise AssertionError(f"step {step}: loss {loss:.6f} / grad norm {norm:.6f} "
                                     f"vs one process {ref_loss:.6f} / {ref_norm:.6f}")
            idle = sum(m.idle_experts for m in shard.model.modules()
                       if isinstance(m, ExpertParallelMoE))
            print0(f"CHECK step {step} {layout}: loss {loss:.6f} = {ref_loss:.6f}, every "
                   f"gradient (max |diff| {grad_diff:.1e}) and weight ({weight_diff:.1e}) "
                   f"equal one process" + (f" ({idle} experts got no token so far)"
                                           if idle else ""))
    print0(ledger(shard, layout, cfg, args, rt, optimizer))
    if args.check:
        check_traffic(shard, layout, cfg, args)
    if layout.pp > 1:           # the last step, as each pipeline rank of this column ran it
        timelines = pipeline.gather_timelines(timeline, t_pipe, shard.groups["pp"])
        print0(pipeline.format_timeline(timelines, layout.schedule, layout.microbatches))
    print0(f"trained {args.steps} steps in {elapsed:.1f} s")
    return dict(loss=loss, activation_bytes=shard.activation_bytes,
                state_bytes=state_bytes(shard, optimizer)["total"], seconds=elapsed)


# ----------------------------------------------------------------------------------------
# The ledger: what each group sent per step, measured by plumbing.comm, next to the
# formulas. Payload = the bytes handed to each call (the "message size" of the formulas).

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
    M, t, c = layout.microbatches, layout.tp, layout.cp
    b = batch_size // (layout.dp * layout.ep * M)
    s, h, f32 = seq_len // c, cfg.n_embd, 4
    act = b * s * h * f32
    held = sorted(shard.stages)
    n_stages = layout.pp * (2 if layout.schedule == "dualpipev" else 1)
    first, last = int(0 in held), int(n_stages - 1 in held)
    layers = sum(len(shard.stages[k].layers) for k in held)
    out = {}

    def add(op, group, calls, payload):
        if calls:
            old = out.get((op, group), (0, 0))
            out[(op, group)] = (old[0] + calls, old[1] + payload)

    if t > 1:
        if layout.sp:
            # + the backward re-gathers of the saved shards: 2 per layer, 1 for the head
            gathers = M * (4 * layers + first + last) + M * (2 * layers + last)
            add("all_gather", "tp", gathers, gathers * act // t)
            add("reduce_scatter", "tp", M * (4 * layers + first + last),
                M * (4 * layers + first + last) * act)
            norms = [p for _, p in shard.params if getattr(p, "sequence_partial", False)]
            add("all_reduce", "tp", 1, sum(p.numel() * f32 for p in norms))
        else:
            add("all_reduce", "tp", M * (4 * layers + first + last),
                M * (4 * layers + first + last) * act)
        add("all_reduce", "tp", 3 * M * last, 3 * M * last * b * s * f32)
    if c > 1:
        calls, payload = ring_traffic_formula(b, cfg.n_kv_head // t, s, cfg.head_dim, c)
        add("send", "cp", M * layers * calls, M * layers * payload)
        add("recv", "cp", M * layers * calls, M * layers * payload)
    if layout.pp > 1:
        where = pipeline.stage_ranks(layout.schedule, layout.pp)
        me, boundary = shard.coords["pp"], b * s * h * f32 // (t if layout.sp else 1)
        sends = sum((k + 1 < n_stages and where[k + 1] != me) + (k > 0 and where[k - 1] != me)
                    for k in held)
        add("send", "pp", M * sends, M * sends * boundary)
        add("recv", "pp", M * sends, M * sends * boundary)
    grads = [p for _, p in shard.params]
    if layout.dp * layout.ep * c > 1:
        dense = [p for p in grads if not getattr(p, "expert", False)]
        add("all_reduce", "data", 1, sum(p.numel() * f32 for p in dense))
    if layout.dp * c > 1 and cfg.n_expert:
        experts = [p for p in grads if getattr(p, "expert", False)]
        add("all_reduce", "dp·cp", 1, sum(p.numel() * f32 for p in experts))
    if cfg.n_expert and layout.dp * layout.ep * c > 1:   # balance-loss statistics
        add("all_reduce", "data", 3 * M * layers, M * layers * (3 * cfg.n_expert + 1) * f32)
    add("all_reduce", "world", 1, 8)                     # the global gradient norm
    return out


def state_bytes(shard, optimizer):
    holder = type("Held", (), {"parameters": lambda self: [p for _, p in shard.params]})()
    return model_state_bytes(holder, optimizer)


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
# Benchmark: the hand tensor parallelism next to PyTorch's DTensor TP (parallelize_module
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
    dispatcher) and the bytes handed to each: the same "payload" plumbing.comm counts."""

    def __init__(self):
        super().__init__()
        self.calls, self.payload = 0, 0

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


def bench_tp(args, rt):
    """Forward + backward of the same batches through both; losses and gradients must
    agree (asserted), then the step-time ratio and what each sent."""
    from torch.distributed.tensor.parallel import loss_parallel
    if not rt.distributed:
        raise UserError("bench-tp compares tensor-parallel runs: launch it with torchrun "
                        "--standalone --nproc_per_node=T parallel.py bench-tp")
    cfg = model_config(args)
    layout = Layout(tp=rt.world_size)
    check_layout(layout, cfg, rt.world_size, args.batch_size, args.seq_len)
    mesh = build_mesh(layout, rt.device)
    tp_group = mesh.get_group("tp")
    hand = GPT(cfg, seed=0).to(rt.device)
    apply_tensor_parallel(hand, tp_group, sequence_parallel=False)
    start = hand.tok_embeddings.start
    theirs = dtensor_tp_model(cfg, mesh["tp"], rt.device)
    corpus = data.load_corpus(args.data, vocab_size=cfg.vocab_size)
    batches = [data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed, s,
                              device=rt.device) for s in range(args.steps + 1)]

    def hand_step(x, y):
        logits = hand.output(hand.norm(_run_layers(hand, hand.tok_embeddings(x))))
        loss = VocabParallelCrossEntropy.apply(logits, y, start, tp_group).mean()
        loss.backward()
        return loss.item()

    def their_step(x, y):
        logits, _ = theirs(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        return loss.full_tensor().item()

    results = {}
    for name, step, model in (("hand", hand_step, hand), ("DTensor", their_step, theirs)):
        losses, seconds = [], 0.0
        for i, (x, y) in enumerate(batches):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            losses.append(step(x, y))
            if i:                   # the first step warms up (allocations, DTensor caches)
                seconds += time.perf_counter() - t0
        # one more step to count the collectives: ours with the meter, DTensor's as they
        # pass the dispatcher (counting would slow the timed steps down)
        comm.reset()
        with CollectivesSeen() as seen:
            model.zero_grad(set_to_none=True)
            step(*batches[-1])
        if name == "hand":
            seen.calls = sum(calls for _, _, calls, _, _ in comm.table())
            seen.payload = sum(payload for _, _, _, payload, _ in comm.table())
        results[name] = (losses, seconds / args.steps, seen.calls, seen.payload)
    for (a, b) in zip(results["hand"][0], results["DTensor"][0]):
        if abs(a - b) > 1e-5:
            raise AssertionError(f"hand TP loss {a:.6f} != DTensor TP loss {b:.6f}")
    for (name, p), q in zip(hand.named_parameters(), theirs.parameters()):
        theirs_local = q.grad
        if hasattr(q, "placements"):  # (DTensor may hand back the embedding's grad whole)
            theirs_local = q.grad.redistribute(q.device_mesh, q.placements).to_local()
        if not torch.allclose(p.grad, theirs_local, atol=1e-6, rtol=1e-4):
            raise AssertionError(f"gradient of {name}: hand TP differs from DTensor TP")
    hand_t, their_t = results["hand"][1], results["DTensor"][1]
    print0(f"CHECK hand TP = DTensor TP (tp={rt.world_size}): losses "
           f"{', '.join(f'{v:.5f}' for v in results['hand'][0])} and every gradient equal")
    print0(f"{'':10}{'step time':>12}{'collectives/step':>18}{'payload/step':>14}")
    for name, t in (("hand", hand_t), ("DTensor", their_t)):
        print0(f"{name:10}{t * 1e3:10.1f}ms{results[name][2]:18d}"
               f"{fmt_bytes(results[name][3]):>14}")
    print0(f"hand / DTensor step time: {hand_t / their_t:.2f}")


def _run_layers(model, x):
    cos, sin = model.rope(torch.arange(x.shape[1], device=x.device))
    for layer in model.layers:
        x = layer(x, cos, sin)
    return x


# ----------------------------------------------------------------------------------------
# Command line

def layout_from(args):
    return Layout(dp=args.dp, ep=args.ep, pp=args.pp, cp=args.cp, tp=args.tp, sp=args.sp,
                  zigzag=args.cp_layout == "zigzag", schedule=args.schedule,
                  microbatches=args.microbatches)


def model_config(args):
    return get_config(args.preset, n_layer=args.n_layer, n_head=args.n_head,
                      n_kv_head=args.n_kv_head, n_embd=args.n_embd, n_expert=args.n_expert,
                      block_size=max(args.seq_len, get_config(args.preset).block_size))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="parallel.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train the shared GPT split along a (dp, ep, pp, cp, tp) DeviceMesh, by "
                    "hand; --check compares every step with one process. Other modes: "
                    "`parallel.py bench-tp` (hand TP vs DTensor TP, under torchrun) and "
                    "`python parallel.py plan --help` (layout planner).")
    p.add_argument("mode", nargs="?", default="train", choices=("train", "bench-tp"),
                   help="train (default) or bench-tp")
    g = p.add_argument_group("layout (world size = dp·ep·pp·cp·tp)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: ranks the MoE experts are spread over (each "
                        "also takes its own share of the batch, like dp)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (pipeline.py)")
    g.add_argument("--cp", type=int, default=1, help="context parallelism (ring attention)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallelism (Megatron)")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism inside the tp group (norms on sequence shards)")
    g.add_argument("--cp-layout", choices=("zigzag", "plain"), default="zigzag",
                   help="how the sequence is cut for cp: zigzag (rank r holds chunks r and "
                        "2C-1-r: balanced causal work) or plain contiguous chunks")
    g.add_argument("--schedule", choices=pipeline.SCHEDULES, default="1f1b",
                   help="pipeline schedule when --pp > 1")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: 2·pp for dualpipev, pp·2 otherwise, "
                        "1 without pipeline)")
    g.add_argument("--print-schedule", action="store_true",
                   help="print each pipeline rank's action list before training")
    m = p.add_argument_group("model and data")
    m.add_argument("--preset", default="small", help="model preset from model.py")
    m.add_argument("--n-layer", type=int, help="override the preset's layer count")
    m.add_argument("--n-head", type=int, help="override the preset's attention heads")
    m.add_argument("--n-kv-head", type=int, help="override the preset's KV heads")
    m.add_argument("--n-embd", type=int, help="override the preset's width")
    m.add_argument("--n-expert", type=int, help="override the preset's expert count")
    m.add_argument("--data", default=None, help="text file or folder (default: built-in "
                   "corpus, see data.py)")
    m.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    m.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    o = p.add_argument_group("training")
    o.add_argument("--steps", type=int, default=20, help="optimizer steps")
    o.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    o.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay "
                   "(matrices only)")
    o.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm (0 = off)")
    o.add_argument("--seed", type=int, default=1337, help="data seed (weights: seed 0)")
    o.add_argument("--device", default="auto", help="auto, cpu or cuda")
    o.add_argument("--check", action="store_true",
                   help="also run one process on the same batches and assert that loss, "
                        "every gradient and every weight match at every step")
    args = p.parse_args(argv)
    if args.microbatches is None:
        args.microbatches = 1 if args.pp == 1 else 2 * args.pp
    require_at_least_one(args, ("steps", "batch_size", "seq_len", "microbatches",
                                "warmup_steps"))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:                # arithmetic only: planner.py, no torchrun
        p = argparse.ArgumentParser(prog="parallel.py plan", description=(
            "Per-GPU memory and communication of candidate (tp, cp, pp, dp) layouts for a "
            "big model, and the three-step cheat sheet that picks one."))
        planner.add_plan_arguments(p)
        print(planner.plan(p.parse_args(argv[1:])))
        return
    args = parse_args(argv)
    rt = setup_runtime(args.device)
    if args.mode == "bench-tp":
        return bench_tp(args, rt)
    return train(args, rt)


if __name__ == "__main__":
    run_cli(main)
