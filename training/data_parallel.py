"""
training/data_parallel.py -- one GPU -> many: every rank trains the same model on different data.
A part of train.py (`--dp MODE`), imported one way: who holds which bytes of the model
state, and what that costs in communication; train.py keeps the loop and the one-process
memory techniques.

Ψ = parameters, N = data-parallel ranks, K = optimizer bytes per parameter (Adam: 8 in fp32)
The ledger of each mode, per rank (fp32; ZeRO paper, Rajbhandari et al. 2020, Fig. 1):

  mode    params  grads   optimizer  sent per step (ring)       how
  ddp     4Ψ      4Ψ      KΨ         all-reduce grads   2Ψ·4 B  buckets all-reduced while
                                                                 backward still runs
  zero1   4Ψ      4Ψ      KΨ/N       reduce-scatter Ψ + all-gather Ψ   each rank updates 1/N
  zero2   4Ψ      4Ψ/N    KΨ/N       same 2Ψ                    + grads reduce-scattered
                                                                 as they appear, then freed
  zero3   4Ψ/N    4Ψ/N    KΨ/N       all-gather Ψ (fwd) + Ψ (bwd)   + params gathered per
                                     + reduce-scatter Ψ = 3Ψ    block just in time, freed
  fsdp    = zero3, done by PyTorch's `fully_shard` (FSDP2): the reference we test against.

What each costs: DDP replicates everything (memory), ZeRO-1/2 cost nothing extra in
communication (a reduce-scatter + all-gather IS an all-reduce), ZeRO-3 adds 50% more
communication and puts an all-gather on the critical path of every block's forward and
backward (prefetching the next block hides part of it).

The sharding layout (ZeRO and FSDP1's "flat parameter"): the parameters of one unit (the
embedding, each block, the final norm, the head) are concatenated into one flat buffer,
padded to a multiple of N; rank r owns the contiguous slice [r·S, (r+1)·S). The optimizer
steps that slice, cut at parameter boundaries into pieces so weight decay still applies
per parameter (matrices decay, norms do not) -- AdamW is elementwise, so each rank updating
its slice is exactly the update a single process would make.

Checkpoints are sharded the same way: each rank writes the flat ranges it owns, and a
resume with any world size (or any mode) reads the ranges it now needs -- resharding.
"""
import errno
import math
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from core.cli import fmt_bytes
from core.errors import UserError
from core.files import atomic_save, load_checkpoint
from core.meters import comm, model_state_bytes, tensor_bytes
from core.recipe import decay_groups
from core.runtime import print0

MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
# The elementwise optimizer state a sharded checkpoint carries: Adam's moments, Muon's
# momentum (both shard like the parameter they follow)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
# ZeRO-3 gathers the embedding before its backward like every other unit (as FSDP does),
# though an embedding's backward needs only the token ids; torch warns about that hook.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")


def units_of(model):
    """The modules sharded (and, in ZeRO-3, gathered) together: FSDP's wrapping policy."""
    return [model.tok_embeddings, *model.layers, model.norm, model.output, *model.extra_heads]


# ----------------------------------------------------------------------------------------
# The interface every mode shares (see wrap), and the world of one: train.py's step and
# loop call the same methods whether one process trains or N do, so they have no "if dp".

class OneProcess:
    """One process, no communication: the gradients are already whole and final. params:
    what the optimizer steps (the model's parameters, or train.py's fp32 master copies in
    mixed precision); grads are those params' .grad."""

    def __init__(self, model, params):
        self.model = model
        self.params = list(params)

    def set_sync(self, sync):
        pass

    def finish_grads(self):
        pass

    def grads(self):
        return [p.grad for p in self.params if p.grad is not None]

    def clip_grads(self, max_norm):
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def after_step(self):
        pass

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def optimizer_groups(self, weight_decay):
        return decay_groups([(p, p.dim()) for p in self.params], weight_decay)

    def state_bytes(self, optimizer):
        own = {id(p) for p in self.model.parameters()}
        master = [p for p in self.params if id(p) not in own]   # fp32 copies, if any
        rows = model_state_bytes(self.model, optimizer, master)
        return {k: v for k, v in rows.items() if k != "total"}


# ----------------------------------------------------------------------------------------
# DDP by hand: gradients bucketed, each bucket all-reduced as soon as all its gradients
# exist, while backward continues on earlier layers (overlap). Li et al. 2020 (PyTorch DDP).

class WholeParameters:
    """What DDP and FSDP2 share: the optimizer steps the model's own parameters (whole in
    DDP, DTensor shards in FSDP2), so gradients live in p.grad and nothing is left to do
    after the step."""

    def grads(self):
        return [p.grad for p in self.params if p.grad is not None]

    def clip_grads(self, max_norm):
        return clip_grad_norm(self, max_norm)

    def after_step(self):
        pass

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class DDP(WholeParameters):
    def __init__(self, model, world, bucket_mb=1.0):
        self.model, self.world = model, world
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Gradients appear roughly in reverse order of the parameters: bucket in that order.
        self.buckets, current, size = [], [], 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_mb * 1e6:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.sync, self.ready, self.pending, self.launched = True, [0] * len(self.buckets), [], 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if not self.sync:           # a gradient-accumulation micro-step: no communication
            return
        self.ready[self.bucket_of[p]] += 1
        # Launch in bucket order only: every rank must issue the same collectives in the
        # same order, even if its gradients arrive in a different order.
        while (self.launched < len(self.buckets) and
               self.ready[self.launched] == len(self.buckets[self.launched])):
            self._launch(self.launched)

    def _launch(self, b):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                          for p in self.buckets[b]])
        self.pending.append((b, flat, comm.all_reduce(flat, async_op=True)))
        self.launched += 1

    def set_sync(self, sync):
        self.sync = sync

    def optimizer_groups(self, weight_decay):
        return decay_groups([(p, p.dim()) for p in self.params], weight_decay)

    def finish_grads(self):
        """Wait for every bucket's all-reduce; write the averaged gradients back."""
        while self.launched < len(self.buckets):   # buckets with an unused parameter
            self._launch(self.launched)
        for b, flat, work in self.pending:
            work.wait()
            flat /= self.world
            offset = 0
            for p in self.buckets[b]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending, self.ready, self.launched = [], [0] * len(self.buckets), 0

    def grad_norm_sq(self):
        return sum(p.grad.float().pow(2).sum() for p in self.params if p.grad is not None)

    def state_bytes(self, optimizer):
        return dict(params=tensor_bytes(self.params), grads=tensor_bytes(self.grads()),
                    optimizer=optimizer_bytes(optimizer))

    def owned_ranges(self, rank):
        """Checkpoint layout: rank 0 owns every parameter whole."""
        if rank != 0:
            return []
        return [(name, p, 0, p.numel(), p) for name, p in self.model.named_parameters()]


def optimizer_bytes(optimizer):
    return tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                        if torch.is_tensor(t) and t.dim() > 0)


# ----------------------------------------------------------------------------------------
# ZeRO by hand: one flat buffer per unit, rank r owns slice r.

class Unit:
    def __init__(self, module, prefix, rank, world):
        self.module, self.rank, self.world = module, rank, world
        self.named = [(f"{prefix}.{n}", p) for n, p in module.named_parameters()]
        self.params = [p for _, p in self.named]
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        total = sum(self.numels)
        self.shard_size = math.ceil(total / world)            # S
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.flat = None            # the full flat parameter buffer the parameters view
        self.materialized = False   # ZeRO-3: does that buffer hold memory right now?
        self.grad_shard = None      # this rank's slice of the averaged gradient
        self.flat_grad = None       # ZeRO-1 only: the full gradient buffer
        self.done = 0               # parameters whose gradient arrived this micro-step

    def pieces(self, base):
        """(name, param, start, end, view) for every parameter overlapping this rank's
        slice; `view` is the matching part of `base`, a tensor laid out like the slice."""
        out = []
        for (name, p), off, n in zip(self.named, self.offsets, self.numels):
            a, b = max(off, self.lo), min(off + n, self.hi)
            if a < b:
                out.append((name, p, a - off, b - off, base[a - self.lo:b - self.lo]))
        return out

    def flatten(self, tensors):
        flat = torch.zeros(self.shard_size * self.world, dtype=self.dtype, device=self.device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:sum(self.numels)])
        return flat

    def point_params_at(self, flat):
        """Make every parameter a view into `flat` (no copy)."""
        self.flat, self.materialized = flat, True
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = flat[off:off + n].view(shape)

    def free_params(self):
        """Release the full buffer's memory but keep the tensor: autograd has saved views of
        these weights for backward, and they must see the weights again once gathered
        (shrinking the storage, as FSDP does, frees memory; dropping our reference would
        not, since the saved views would keep the whole buffer alive)."""
        self.flat.untyped_storage().resize_(0)
        self.materialized = False

    def all_gather(self, shard):
        """Fill the full buffer (re-allocated in place) with every rank's slice."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        comm.all_gather_into_tensor(self.flat, shard)
        self.materialized = True


class ZeRO:
    def __init__(self, model, stage, rank, world):
        self.model, self.stage, self.rank, self.world = model, stage, rank, world
        names = {m: n for n, m in model.named_modules()}
        self.units = [Unit(m, names[m], rank, world) for m in units_of(model)]
        # remembered now: ZeRO-3 frees the parameters, and an empty tensor is 1-D
        self.ndim = {name: p.dim() for u in self.units for name, p in u.named}
        self.numel = {name: p.numel() for u in self.units for name, p in u.named}
        for u in self.units:
            full = u.flatten([p.detach() for p in u.params])
            # The shard of the parameters this rank updates. Stages 1-2 keep the full
            # buffer and update their slice of it in place; stage 3 keeps only the slice.
            u.point_params_at(full)
            if stage == 3:
                u.shard = full[u.lo:u.hi].clone()
                u.free_params()
                u.module.register_forward_pre_hook(lambda m, a, u=u: self._gather(u))
                u.module.register_forward_hook(lambda m, a, o, u=u: u.free_params())
                u.module.register_full_backward_pre_hook(lambda m, g, u=u: self._gather(u))
            else:
                u.shard = full[u.lo:u.hi]
            if stage >= 2:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_ready(u))
            u.opt_pieces = u.pieces(u.shard)   # the tensors the optimizer steps
        self.pieces = [piece for u in self.units for piece in u.opt_pieces]

    def _gather(self, u):
        if not u.materialized:
            u.all_gather(u.shard)

    def _grad_ready(self, u):
        u.done += 1
        if u.done == len(u.params):
            self._reduce_scatter(u)

    def _reduce_scatter(self, u):
        """Sum the unit's gradients over ranks, keep only this rank's slice (÷N), free the
        full gradients (stages 2-3). Runs once per micro-step in stages 2-3: with gradient
        accumulation the shard accumulates, the full gradient never does."""
        u.done = 0
        def grad_or_zeros(p, shape):
            if p.grad is not None:
                return p.grad
            return torch.zeros(shape, dtype=u.dtype, device=u.device)
        grads = [grad_or_zeros(p, shape) for p, shape in zip(u.params, u.shapes)]
        flat = u.flatten(grads)
        shard = torch.empty(u.shard_size, dtype=u.dtype, device=u.device)
        comm.reduce_scatter_tensor(shard, flat)
        shard /= self.world
        if self.stage == 1:      # keep the full buffer (that is stage 1's cost), fill our part
            flat[u.lo:u.hi] = shard
            u.flat_grad, u.grad_shard = flat, flat[u.lo:u.hi]
        else:
            u.grad_shard = shard if u.grad_shard is None else u.grad_shard.add_(shard)
        for p in u.params:
            p.grad = None
        if self.stage == 3:
            u.free_params()       # backward of this unit is over: drop the gathered weights

    def set_sync(self, sync):
        # Stages 2-3 must reduce-scatter every micro-step (the full gradient is not kept);
        # stage 1 communicates once, after the last micro-step (finish_grads). Nothing to
        # switch, so `sync` is ignored.
        pass

    def optimizer_groups(self, weight_decay):
        return decay_groups([(view, self.ndim[name]) for name, *_, view in self.pieces],
                            weight_decay)

    def finish_grads(self):
        if self.stage == 1:
            for u in self.units:
                self._reduce_scatter(u)
        for u in self.units:
            if self.stage >= 2 and u.done:          # a unit with some unused parameters
                self._reduce_scatter(u)
            grad = u.grad_shard if u.grad_shard is not None else torch.zeros_like(u.shard)
            for (*_, view), (*_, g) in zip(u.opt_pieces, u.pieces(grad)):
                view.grad = g

    def grad_norm_sq(self):
        """Each rank holds a disjoint slice of the gradient: the global norm² is the sum."""
        local = sum(view.grad.float().pow(2).sum() for *_, view in self.pieces)
        local = torch.as_tensor(local, dtype=torch.float32, device=self.units[0].device)
        comm.all_reduce(local)
        return local

    def grads(self):
        return [view.grad for *_, view in self.pieces]

    def clip_grads(self, max_norm):
        return clip_grad_norm(self, max_norm)

    def after_step(self):
        """Stages 1-2: every rank needs the whole updated model for the next forward:
        all-gather the updated slices into the flat buffers the parameters view."""
        if self.stage < 3:
            for u in self.units:
                comm.all_gather_into_tensor(u.flat, u.shard.clone())

    def zero_grad(self):
        for u in self.units:
            u.grad_shard, u.flat_grad, u.done = None, None, 0
            for p in u.params:
                p.grad = None
        for *_, view in self.pieces:
            view.grad = None

    def state_bytes(self, optimizer):
        params = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        if self.stage < 3:
            params = sum(u.flat.numel() * u.flat.element_size() for u in self.units)
        grads = sum((u.flat_grad if u.flat_grad is not None else u.grad_shard).numel() *
                    u.dtype.itemsize for u in self.units
                    if u.flat_grad is not None or u.grad_shard is not None)
        return dict(params=params, grads=grads, optimizer=optimizer_bytes(optimizer))

    def owned_ranges(self, rank):
        return self.pieces


# ----------------------------------------------------------------------------------------
# FSDP2: PyTorch's ZeRO-3 (`fully_shard`, per block then the root), the reference. Its
# collectives run inside PyTorch, so the comm meter does not see them.

class FSDP2(WholeParameters):
    def __init__(self, model, world):
        from torch.distributed.fsdp import fully_shard
        self.model, self.world = model, world
        for module in units_of(model)[1:len(model.layers) + 1]:
            fully_shard(module)
        fully_shard(model, reshard_after_forward=True)  # the root too: like our zero3
        self.params = list(model.parameters())

    def set_sync(self, sync):
        self.model.set_requires_gradient_sync(sync)

    def optimizer_groups(self, weight_decay):
        return decay_groups([(p, p.dim()) for p in self.params], weight_decay)

    def finish_grads(self):
        pass                     # FSDP2 reduce-scattered the gradients during backward

    def grad_norm_sq(self):
        local = sum(p.grad.to_local().float().pow(2).sum() for p in self.params
                    if p.grad is not None)
        local = torch.as_tensor(local, dtype=torch.float32)
        comm.all_reduce(local)
        return local

    def state_bytes(self, optimizer):
        local = lambda ts: sum(t.to_local().numel() * t.element_size() for t in ts)
        opt = [t for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0]
        return dict(params=local(self.params), grads=local(self.grads()), optimizer=local(opt))

    def owned_ranges(self, rank):
        """FSDP2 shards dim 0 in chunks of ceil(rows/N): a contiguous flat range."""
        self.model.reshard()     # a forward under no_grad may have left them gathered
        out = []
        for name, p in self.model.named_parameters():
            local = p.to_local()
            rows = math.ceil(p.shape[0] / self.world)
            a = min(rank * rows, p.shape[0]) * (p.numel() // p.shape[0])
            out.append((name, p, a, a + local.numel(), p))
        return out


def wrap(model, mode, rt, bucket_mb=1.0):
    """The model's data-parallel wrapper for `mode`; all share one small interface:
    set_sync / finish_grads / grad_norm_sq / grads / after_step / zero_grad /
    optimizer_groups / state_bytes / owned_ranges."""
    if mode not in MODES:
        raise UserError(f"unknown --dp mode {mode!r}: use one of {', '.join(MODES)}")
    if model.config.n_expert and mode in ("zero2", "zero3"):
        raise UserError(f"--dp {mode} needs every parameter to get a gradient on every rank "
                        "each micro-step; an MoE model's unused experts do not: use ddp, "
                        "zero1 or fsdp")
    if mode == "ddp":
        return DDP(model, rt.world_size, bucket_mb)
    if mode == "fsdp":
        return FSDP2(model, rt.world_size)
    return ZeRO(model, int(mode[-1]), rt.rank, rt.world_size)


def clip_grad_norm(dp, max_norm):
    """Global-norm clipping when each rank holds a part of the gradient: the squared norms
    of the parts add up (one scalar all-reduce)."""
    total = dp.grad_norm_sq() ** 0.5
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in dp.grads():
            g.mul_(coef)
    return float(total)


def formula_bytes(mode, n_params, world, k=8, b=4, muon_params=0):
    """ZeRO paper's per-rank model state in bytes (fp32: b = 4 bytes per value, K = 8).
    muon_params: the hidden matrices under Muon keep one buffer (K = 4 there)."""
    n = world
    state = k * n_params - 4 * muon_params
    return {"ddp": dict(params=b * n_params, grads=b * n_params, optimizer=state),
            "zero1": dict(params=b * n_params, grads=b * n_params, optimizer=state / n),
            "zero2": dict(params=b * n_params, grads=b * n_params / n, optimizer=state / n),
            "zero3": dict(params=b * n_params / n, grads=b * n_params / n,
                          optimizer=state / n)}["zero3" if mode == "fsdp" else mode]


def expected_wire_bytes(mode, n_params, world, b=4, muon_params=0):
    """Bytes one rank sends per step with ring collectives: 2Ψ (all-reduce = reduce-scatter
    + all-gather) for ddp/zero1/zero2, 3Ψ for zero3 (one more all-gather in backward).
    Sharded Muon adds its two bf16 all-to-alls: 2 × 2 B × Ψ_m(N−1)/N² (optim.py, 8.)."""
    ring = (world - 1) / world * b * n_params
    muon = 2 * 2 * muon_params * (world - 1) / world ** 2 if mode != "ddp" else 0
    return (3 * ring if mode in ("zero3", "fsdp") else 2 * ring) + muon


def ledger(mode, rt, state, n_params, sent_per_step, muon_params=0):
    """Every rank's measured model state and bytes sent, next to the ZeRO formulas."""
    rows = [None] * rt.world_size
    mine = dict(state, sent=sent_per_step)
    if rt.distributed:
        # bookkeeping, outside the meter on purpose
        torch.distributed.all_gather_object(rows, mine)
    else:
        rows = [mine]
    formula = formula_bytes(mode, n_params, rt.world_size, muon_params=muon_params)
    expected = expected_wire_bytes(mode, n_params, rt.world_size, muon_params=muon_params)
    muon = f", Muon K = 4 on Ψ_m = {muon_params:,}" if muon_params else ""
    print0(f"ledger --dp {mode}, N = {rt.world_size}, Ψ = {n_params:,} (fp32, Adam K = 8"
           f"{muon}):")
    print0(f"  {'rank':<6}{'params':>12}{'grads':>12}{'optimizer':>12}{'sent/step':>12}")
    for r, row in enumerate(rows):
        print0(f"  {r:<6}" + "".join(f"{fmt_bytes(row[k]):>12}" for k in
                                     ("params", "grads", "optimizer", "sent")))
    print0(f"  {'formula':<6}" + "".join(f"{fmt_bytes(formula[k]):>12}" for k in
                                        ("params", "grads", "optimizer")) +
           f"{fmt_bytes(expected):>12}")
    if mode == "fsdp":
        print0("  (fsdp: its collectives run inside PyTorch; the meter sees only ours)")
    return dict(rows=rows, formula=formula, expected_sent=expected)



# ----------------------------------------------------------------------------------------
# Sharded checkpoints with resharding: each rank writes the flat ranges [a, b) of each
# parameter (and of its Adam moments) that it owns; a resume, at any world size and in any
# mode, assembles whatever ranges it owns now.

def local_flat(t):
    return (t.to_local() if hasattr(t, "to_local") else t).reshape(-1)


def save_shards(directory, dp, optimizer, rank, meta):
    """This rank's ranges into directory/shard-{rank}.pt, each shard stamped with the save's
    identity (meta["save_id"]: run, step, attempt) so that a folder mixing two saves is
    refused at load; rank 0 also writes meta.pt."""
    os.makedirs(directory, exist_ok=True)
    entries = {}
    ranges = dp.owned_ranges(rank) if not isinstance(dp, DDP) or rank == 0 else []
    for name, p, a, b, key in ranges:
        st = optimizer.state.get(key, {})
        entries[name] = dict(start=a, end=b,
                             numel=dp.numel[name] if isinstance(dp, ZeRO) else math.prod(p.shape),
                             param=local_flat(key if not isinstance(dp, FSDP2) else p).clone(),
                             **{k: local_flat(v).clone() for k, v in st.items()
                                if torch.is_tensor(v) and v.dim() > 0},
                             step=float(st["step"]) if "step" in st else 0.0)
    identity = dict(save_id=meta["save_id"], rank=rank, world_size=meta["world_size"],
                    step=meta["step"])
    atomic_save(dict(identity=identity, ranges=entries),
                os.path.join(directory, f"shard-{rank}.pt"))
    if rank == 0:
        atomic_save(meta, os.path.join(directory, "meta.pt"))


def read_generation(directory):
    """-> (meta, full): every shard of one save read and checked (readable, plain data, all
    present, all from the save meta.pt names) and assembled into whole flat tensors:
    {name: {numel, step, param, exp_avg, exp_avg_sq}}. Nothing is modified yet, so a caller
    may try an older generation when this one is unreadable. Each problem: one UserError
    naming the file."""
    meta = load_checkpoint(os.path.join(directory, "meta.pt"), what="sharded checkpoint meta")
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
        raise UserError(f"{directory}/meta.pt is not a sharded checkpoint's meta (no world_size)")
    full = {}
    for r in range(meta["world_size"]):
        path = os.path.join(directory, f"shard-{r}.pt")
        shard = load_checkpoint(path, what="checkpoint shard")
        identity = shard.get("identity") if isinstance(shard, dict) else None
        if not isinstance(identity, dict) or not isinstance(shard.get("ranges"), dict):
            raise UserError(f"{path} is not a checkpoint shard of this repo (no save identity)")
        if identity.get("save_id") != meta.get("save_id") or identity.get("rank") != r:
            raise UserError(f"{path} belongs to another save ({identity.get('save_id')}, rank "
                            f"{identity.get('rank')}) than {directory}/meta.pt "
                            f"({meta.get('save_id')}): refusing to mix them")
        try:
            for name, e in shard["ranges"].items():
                f = full.setdefault(name, {"numel": e["numel"], "step": e["step"]})
                for key in ("param", *STATE_KEYS):
                    if key in e:
                        f.setdefault(key, torch.zeros(e["numel"]))[e["start"]:e["end"]] = \
                            e[key][:e["end"] - e["start"]]
        except (KeyError, TypeError, RuntimeError, AttributeError) as err:
            raise UserError(f"{path}: a damaged range ({type(err).__name__}: {err})") from None
    return meta, full


def apply_generation(full, directory, dp, optimizer, rank):
    """Copy the ranges this rank owns now (any world size, any mode) from read_generation's
    whole tensors into the wrapper's parameters and the optimizer's state."""
    ranges = dp.owned_ranges(rank) if not isinstance(dp, DDP) else \
        [(n, p, 0, p.numel(), p) for n, p in dp.model.named_parameters()]
    for name, p, a, b, key in ranges:
        numel = dp.numel[name] if isinstance(dp, ZeRO) else math.prod(p.shape)
        if name not in full or full[name]["numel"] != numel:
            raise UserError(f"checkpoint {directory} does not match this model "
                            f"(parameter {name})")
        f = full[name]
        with torch.no_grad():
            target = key if not isinstance(dp, FSDP2) else p
            local_flat(target)[:b - a].copy_(f["param"][a:b])
        state = {"step": torch.tensor(f["step"])}
        for k in STATE_KEYS:
            if k in f:
                t = torch.zeros_like(key)
                local_flat(t)[:b - a].copy_(f[k][a:b])
                state[k] = t
        if len(state) > 1:                    # a saved step had begun any optimizer state
            optimizer.state[key] = state
    dp.after_step()          # stages 1-2: gather the full parameters from the slices


def load_shards(directory, dp, optimizer, rank):
    """Assemble this rank's ranges from every shard file of the saved run. Every file is
    read with weights_only=True (data only: opening it cannot run code)."""
    meta, full = read_generation(directory)
    apply_generation(full, directory, dp, optimizer, rank)
    return meta


def latest_shards(root):
    """The folder `root/latest` points at (the last complete save), or None."""
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer, errors="replace") as f:
        return os.path.join(root, f.read().strip() or "(empty latest)")


def generations(root):
    """The saves in root, newest first: the one `latest` names, then every other step_K
    folder by decreasing K (the older generations --keep left; the fallbacks)."""
    first = latest_shards(root)
    steps = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("step_") and name[5:].isdigit():
                steps.append((int(name[5:]), os.path.join(root, name)))
    rest = [path for _, path in sorted(steps, reverse=True) if path != first]
    return ([first] if first else []) + rest


def all_or_nothing(rt, write, undo):
    """write() on every rank, then every rank learns whether every rank succeeded (one
    all-reduce of the worst errno): a save is all its files or none. On any failure undo()
    runs on rank 0 (it removes what the others wrote) and every rank raises the same
    OSError -- the failing rank's reason, "No space left on device" or "Read-only file
    system" -- which resume.save turns into one line. Collective: every rank calls it."""
    code = 0
    try:
        write()
    except (OSError, RuntimeError) as e:      # torch.save reports ENOSPC as RuntimeError
        code = next((x.errno for x in (e, e.__cause__, e.__context__)
                     if isinstance(x, OSError) and x.errno), errno.EIO)
    if rt.distributed:
        worst = torch.tensor([float(code)], device=rt.device)
        comm.all_reduce(worst, op=dist.ReduceOp.MAX)
        code = int(worst.item())
    if code:
        if rt.is_main:
            undo()
        if rt.distributed:
            comm.barrier()             # nobody raises before the folder is gone
        raise OSError(code, os.strerror(code))


def save_sharded_checkpoint(root, step, dp, optimizer, rt, meta, keep=2, before_commit=None):
    """Every rank writes its ranges into root/step_K/; before_commit() (the single-file
    export) runs next; only then rank 0 points `latest` at it and removes the saves beyond
    the newest `keep` of this run (meta["run_id"]) and every save of another run. A crash
    mid-save leaves `latest` on the previous complete checkpoint; a save that fails on any
    rank (a full disk) removes step_K/ entirely (all_or_nothing); an unreadable `latest`
    has `keep - 1` older ones to fall back on. Collective (barriers): every rank calls it."""
    folder = os.path.join(root, f"step_{step}")

    def undo():
        shutil.rmtree(folder, ignore_errors=True)
    all_or_nothing(rt, lambda: save_shards(folder, dp, optimizer, rt.rank, meta), undo)
    if before_commit is not None:
        all_or_nothing(rt, before_commit, undo)
    if rt.is_main:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        kept = 1
        for path in generations(root)[1:]:
            if kept < keep and os.path.abspath(path) != os.path.abspath(folder) and \
                    run_of(path) == meta["run_id"]:
                kept += 1
            elif os.path.abspath(path) != os.path.abspath(folder):
                shutil.rmtree(path, ignore_errors=True)
    return folder


def run_of(folder):
    """The run id a save's meta.pt records (None if unreadable: such a save is dropped)."""
    try:
        meta = load_checkpoint(os.path.join(folder, "meta.pt"))
    except UserError:
        return None
    return meta.get("run_id") if isinstance(meta, dict) else None


def full_state_dict(model, dp):
    """The whole fp32 model on every rank (for the single-file export): ZeRO-3 gathers one
    unit at a time, FSDP2 asks each DTensor for its full tensor."""
    if isinstance(dp, FSDP2):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}
    if isinstance(dp, ZeRO) and dp.stage == 3:
        out = {}
        for u in dp.units:
            dp._gather(u)
            out.update({name: p.detach().clone() for name, p in u.named})
            u.free_params()
        return out
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
