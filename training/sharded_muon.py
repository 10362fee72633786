"""
training/sharded_muon.py -- Muon on sharded state: `train.py --optimizer muon --dp
zero1|zero2|zero3|fsdp`. A part of train.py's data parallelism, imported one way: it joins
optim.py's Muon (the update) with training/data_parallel.py's layouts (who holds what).

What it teaches
- Why Muon does not shard like AdamW. ZeRO gives each rank a flat 1/N slice of every unit,
  cut wherever the slice ends, so a matrix may be split between ranks; FSDP2 gives each
  rank a block of rows. Elementwise steps run on those pieces as they are -- AdamW, and
  Muon's momentum m ← μ·m + (1−μ)·g -- but Newton–Schulz orthogonalises the WHOLE matrix:
  every entry of U Vᵀ depends on every entry of the momentum.
- The recipe (nanochat's and Essential AI's distributed Muon):
    1. each rank updates the momentum of the pieces it holds (state sharded: 4/N B/param);
    2. ONE all-to-all sends every piece of (Nesterov) momentum to its matrix's owner
       (whole matrices spread over the ranks by size, optim.balance_by_size);
    3. each owner assembles its matrices and orthogonalises them: NS FLOPs ≈ 1/N each;
    4. a second all-to-all returns to each rank its pieces of the update;
    5. every rank applies decay + update to its pieces (optim.muon_apply).
  AdamW keeps its per-piece update for the embedding, the head and the norms.

What it costs
- sends: both exchanges move bf16 -- newton_schulz casts its input to bf16 first and
  returns bf16, so nothing is rounded that one process would not round. Per rank and step
  ≈ 2 exchanges × 2 B × Ψ_m(N−1)/N² (it holds Ψ_m/N, of which (N−1)/N belongs to matrices
  others own): small next to ZeRO's own 2 × 4 B × Ψ(N−1)/N.
- saves: Muon's momentum ÷N like Adam's moments, and Newton–Schulz's FLOPs ÷N (each
  matrix orthogonalised once, on its owner).
- sacrifices: nothing in the numbers (tests/dist_train_check.py: bit for bit equal to
  whole-matrix Muon given the same gradients); on the clock, the two all-to-alls sit on
  the step's critical path, and an uneven assignment makes every rank wait for the
  busiest owner. The alternative, Moonlight's "Distributed Muon" (Liu et al. 2025),
  all-gathers each momentum to every rank and runs Newton–Schulz N times over: Ψ_m·4 B
  more gathered, N× the FLOPs, no scatter.
"""
import math

import torch
import torch.distributed as dist

from core.cli import fmt_bytes
from core.meters import comm
from optim import (HandOptimizer, adam_update, balance_by_size, muon_apply, muon_momentum,
                   newton_schulz, ns_flops, optimizer_groups)


EXCHANGE_DTYPE = torch.bfloat16      # = newton_schulz's dtype: what it reads and returns


def local(t):
    """A DTensor's (FSDP2) local rows as a plain tensor sharing its storage; else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_to_all(send, recv_sizes, device):
    """One all-to-all: send[r] (a list of 1-D tensors) goes to rank r. -> received[r]:
    rank r's tensors to us, cut by recv_sizes[r] (the lengths we expect, in its order)."""
    flat = [t.reshape(-1).to(EXCHANGE_DTYPE) for ts in send for t in ts]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=EXCHANGE_DTYPE, device=device)
    out_splits = [sum(sizes) for sizes in recv_sizes]
    out = torch.empty(sum(out_splits), dtype=EXCHANGE_DTYPE, device=device)
    comm.all_to_all_single(out, inp, out_splits, [sum(t.numel() for t in ts) for ts in send])
    return [list(chunk.split(sizes)) for chunk, sizes in zip(out.split(out_splits),
                                                             recv_sizes)]


class ShardedMuonAdamW(HandOptimizer):
    """optim.MuonAdamW over pieces. `layout` maps every tensor the optimizer steps to
    (name, the whole parameter's shape, start, end): the piece is [start, end) of the
    flattened parameter. The groups are optim.optimizer_groups' (see build)."""

    def __init__(self, groups, layout, rank, world_size):
        super().__init__(groups, dict(lr=1e-3, weight_decay=0.0))
        self.layout, self.rank, self.world = layout, rank, world_size
        self.muon = [(p, g) for g in self.param_groups if g["algo"] == "muon"
                     for p in g["params"]]
        # Every rank's pieces, exchanged once (the layout, not data): then each rank knows,
        # for every matrix, its shape and who holds which range, in one order everywhere.
        mine = [(name, tuple(shape), a, b) for p, _ in self.muon
                for name, shape, a, b in [layout[p]]]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        self.shape, self.ranges = {}, {}          # name -> shape; name -> {rank: (a, b)}
        for r, entries in enumerate(everyone):
            for name, shape, a, b in entries:
                self.shape[name] = shape
                self.ranges.setdefault(name, {})[r] = (a, b)
        names = list(self.shape)
        owners = balance_by_size([math.prod(self.shape[n]) for n in names], world_size)
        self.owner = dict(zip(names, owners))     # name -> rank (HandOptimizer's is unused)
        self.sent = 0                             # bytes the last step's exchange sent

    def span(self, name, rank):
        a, b = self.ranges[name].get(rank, (0, 0))
        return b - a

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        momenta = {}
        for group in self.param_groups:
            for p in group["params"]:
                if group["algo"] == "adamw" and p.grad is not None:
                    adam_update(p, p.grad, self.state[p], group)
                elif group["algo"] == "muon":    # every rank takes part in the exchange
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    momenta[p] = muon_momentum(g, self.state[p], group)
        wire_before = comm.total_wire
        updates = self.orthogonalize_at_owners(momenta)
        self.sent = comm.total_wire - wire_before       # measured by the meter: report()
        for p, group in self.muon:
            piece = local(p).view(-1)
            muon_apply(piece, updates[p].view_as(piece), self.layout[p][1], group)
        return loss

    def orthogonalize_at_owners(self, momenta):
        """Steps 2-4 of the recipe above -> {tensor: its piece of the orthogonal update}."""
        held = {self.layout[p][0]: p for p, _ in self.muon}       # name -> my piece
        names, group = list(self.shape), self.muon[0][1] if self.muon else None
        device = next(p.device for g in self.param_groups for p in g["params"])
        owned_by = [[n for n in names if self.owner[n] == r] for r in range(self.world)]
        # 2. my pieces to their owners; from each rank, its pieces of the matrices I own
        # (a list per rank, in `names` order on both sides, so sizes and order agree)
        to_owner = [[local(momenta[held[n]]) for n in owned_by[r] if n in held]
                    for r in range(self.world)]
        from_each = [[n for n in owned_by[self.rank] if r in self.ranges[n]]
                     for r in range(self.world)]
        got = all_to_all(to_owner, [[self.span(n, r) for n in from_each[r]]
                                    for r in range(self.world)], device)
        # 3. assemble each matrix I own from every rank's piece; orthogonalise it
        whole = {n: torch.empty(math.prod(self.shape[n]), dtype=EXCHANGE_DTYPE,
                                device=device) for n in owned_by[self.rank]}
        for r in range(self.world):
            for n, piece in zip(from_each[r], got[r]):
                a, b = self.ranges[n][r]
                whole[n][a:b] = piece
        back = [[] for _ in range(self.world)]
        for n in owned_by[self.rank]:
            o = newton_schulz(whole[n].view(self.shape[n]), group["ns_steps"],
                              group["ns_coefficients"], group["eps"]).reshape(-1)
            for r in range(self.world):
                if n in from_each[r]:
                    a, b = self.ranges[n][r]
                    back[r].append(o[a:b])
        # 4. every piece of the update back to the rank that holds it
        mine = [[n for n in owned_by[r] if n in held] for r in range(self.world)]
        got = all_to_all(back, [[self.span(n, self.rank) for n in mine[r]]
                                for r in range(self.world)], device)
        return {held[n]: piece for r in range(self.world) for n, piece in zip(mine[r], got[r])}

    def exchange_bytes(self):
        """Bytes this rank sends per step in the two all-to-alls (what stays here is not
        sent): its pieces of others' matrices, then others' pieces of its own."""
        size = torch.tensor([], dtype=EXCHANGE_DTYPE).element_size()
        out = sum(self.span(n, self.rank) for n in self.shape if self.owner[n] != self.rank)
        back = sum(self.span(n, r) for n in self.shape if self.owner[n] == self.rank
                   for r in self.ranges[n] if r != self.rank)
        return size * (out + back)


    def report(self):
        """What sharding Muon costs this rank: the all-to-alls' bytes per step (measured by
        the meter, and counted from the layout) and its share of Newton–Schulz's FLOPs."""
        steps = self.muon[0][1]["ns_steps"] if self.muon else 5
        total = sum(ns_flops(s, steps) for s in self.shape.values())
        here = sum(ns_flops(self.shape[n], steps) for n in self.shape
                   if self.owner[n] == self.rank)
        return (f"sharded Muon, rank {self.rank}: all-to-alls sent {fmt_bytes(self.sent)}/step "
                f"(layout: {fmt_bytes(self.exchange_bytes())}); Newton–Schulz {here / 1e6:.2f} "
                f"of one process's {total / 1e6:.2f} MFLOP/step ({100 * here / max(total, 1):.0f}%,"
                f" 1/N = {100 / self.world:.0f}%)")


def build(pieces, rank, world_size, **settings):
    """The hybrid over a data-parallel wrapper's pieces: `pieces` as its owned_ranges give
    them, (name, parameter, start, end, tensor the optimizer steps). settings: those of
    optim.build_optimizer (lr, weight_decay, muon_lr, betas, ...)."""
    layout = {t: (name, tuple(p.shape), a, b) for name, p, a, b, t in pieces}
    groups = optimizer_groups([(name, t) for name, _, _, _, t in pieces], "muon",
                              shape_of=lambda t: layout[t][1], **settings)
    return ShardedMuonAdamW(groups, layout, rank, world_size)
