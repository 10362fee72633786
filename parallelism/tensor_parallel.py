"""
parallelism/tensor_parallel.py -- split inside a layer: Megatron-LM tensor parallelism and,
on top of it, sequence parallelism, by hand. A part of parallel.py: the layer-internal
split (parallel.py composes it with data, context, pipeline and expert parallelism on one
DeviceMesh and checks it against one process; parallelism/parallel_check.py compares it
with PyTorch's DTensor TP).

  tp  tensor parallelism (Megatron-LM, Shoeybi et al. 2019): wq/wk/wv and w1/w3 split by
      output columns (heads and KV heads per rank), wo and w2 by input rows, so each
      attention/MLP needs ONE all-reduce forward and one backward: the "f" and "g"
      conjugate operators below. The embedding and the output head are split by
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

Where the communication happens: apply_tensor_parallel registers forward hooks -- f (or
the sp all-gather) after each norm that feeds a parallel region, g (or the sp
reduce-scatter) after each row-parallel matmul -- so model.py's Attention and FeedForward
run unchanged on their local heads and slices. Those hooks, registered in that one
function, are the whole of TP's traffic besides the vocabulary-parallel embedding and loss.
"""
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from core.meters import ActivationMeter, comm


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

def summed_over(t, group):
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
        return summed_over(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return summed_over(x, group)

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
    """Forward all-gather along the sequence; the gathered tensor is remembered in
    `gathered` (a GatheredInputs, below) so that backward can keep only this rank's shard."""

    @staticmethod
    def forward(ctx, x, group, gathered):
        ctx.group = group
        full = _gather_seq(x, group)
        if gathered is not None:
            gathered.remember(full, x.detach(), group)
        return full

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None, None


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


@dataclass
class _Gathered:
    full: weakref.ref     # the gathered tensor, while it lives
    shard: torch.Tensor   # this rank's piece: all that backward needs to keep
    group: object
    again: list           # [the re-gathered tensor], shared by everyone who saved it


class GatheredInputs:
    """The live sp all-gathers of one model, by the storage of the gathered tensor. One per
    Shard (build_shard makes it): written by GatherSequence.forward, through the forward
    hooks apply_tensor_parallel registers; read by SavedActivations._pack while a stage's
    forward runs. An entry disappears with its gathered tensor (weakref.finalize)."""

    def __init__(self):
        self.live = {}

    def remember(self, full, shard, group):
        key = full.untyped_storage().data_ptr()
        self.live[key] = _Gathered(weakref.ref(full), shard, group, [None])
        weakref.finalize(full, self.live.pop, key, None)

    def lookup(self, t):
        """The _Gathered whose tensor t is a view of, or None."""
        g = self.live.get(t.untyped_storage().data_ptr())
        return None if g is None or g.full() is None else g


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
    """The activation meter (meters.ActivationMeter: counts what autograd keeps), which
    also applies the sp swap above. Every forward of a ShardedStage runs under one."""

    def __init__(self, model, gathered):
        super().__init__(model)
        self.gathered = gathered
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        g = self.gathered.lookup(t)
        if g is None:
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
    linear.out_features, linear.in_features = linear.weight.shape


def _enter_hook(group, gathered):
    """f after a norm that feeds a parallel region (with sp: the sequence all-gather)."""
    if gathered is None:
        return lambda module, inputs, output: CopyToTP.apply(output, group)
    return lambda module, inputs, output: GatherSequence.apply(output, group, gathered)


def _exit_hook(group, sp):
    """g after a row-parallel matmul (with sp: the sequence reduce-scatter)."""
    op = ReduceScatterSequence if sp else ReduceFromTP
    return lambda module, inputs, output: op.apply(output, group)


def apply_tensor_parallel(model, group, gathered=None):
    """Turn the full model (the same on every rank, same seed) into this rank's tp shard,
    in place: slice the weights, and put f (or the sp all-gather) after each norm that
    feeds a parallel region and g (or the sp reduce-scatter) after each row-parallel
    matmul. THIS is where tensor parallelism communicates: the four forward hooks per
    block registered here -- Attention.forward and FeedForward.forward (model.py) run
    unchanged on the local heads and the local slice of the MLP, and show no collective.
    gathered: a GatheredInputs for sequence parallelism, None for plain tp.
    Parameter names do not change. Returns {parameter name: the dim it was sliced along}."""
    sp = gathered is not None
    sliced = {}
    for i, block in enumerate(model.layers):
        attn, ffn = block.attention, block.feed_forward
        for name, linear, dim in (("attention.wq", attn.wq, 0), ("attention.wk", attn.wk, 0),
                                  ("attention.wv", attn.wv, 0), ("feed_forward.w1", ffn.w1, 0),
                                  ("feed_forward.w3", ffn.w3, 0),      # column-parallel
                                  ("attention.wo", attn.wo, 1),
                                  ("feed_forward.w2", ffn.w2, 1)):     # row-parallel
            _slice_linear(linear, dim, group)
            sliced[f"layers.{i}.{name}.weight"] = dim
        for linear in (attn.wo, ffn.w2):
            linear.register_forward_hook(_exit_hook(group, sp))
        for norm in (block.attention_norm, block.ffn_norm):
            norm.register_forward_hook(_enter_hook(group, gathered))
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sp)
    sliced["tok_embeddings.weight"] = 0
    model.norm.register_forward_hook(_enter_hook(group, gathered))
    _slice_linear(model.output, 0, group)                        # vocabulary-parallel head
    sliced["output.weight"] = 0
    return sliced


if __name__ == "__main__":
    print(__doc__.strip())
    print("\ntensor_parallel.py is a library: tensor parallelism runs as `torchrun "
          "--standalone --nproc_per_node=2 parallel.py --tp 2 --check` (see parallel.py --help).")
