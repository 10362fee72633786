"""
optim.py -- how a gradient becomes an update: SGD → momentum → RMSProp → Adam → AdamW →
Muon, each written by hand in a few lines and tested equal to torch.optim; then Muon on
sharded state. (MuonClip's QK-clip, the guard the loop applies after Muon's step, is
training/qk_clip.py.)

Run:  python optim.py compare      # AdamW vs Muon on the same GPT, tokens to a target loss
      python optim.py bench        # state bytes/param and step time of each, vs torch's

What each optimizer keeps per parameter (fp32 state) and what it adds to a step:
  SGD 0 B/param · momentum 4 (one buffer) · RMSProp 4 (running mean of g²) · Adam and
  AdamW 8 (m and v: with the fp32 master weights, the "12" of ZeRO's 2+2+12) · Muon 4
  (momentum), on hidden matrices only (embeddings, head and norms stay on AdamW at 8),
  plus Newton–Schulz: 5 × (4m²n + 2m³) FLOPs per m×n matrix (m ≤ n) = 30·d³ for d×d,
  against 6·d²·tokens for its forward+backward: ≈ 5·d/(tokens per step) more -- large at
  nano scale (d=128, 2k tokens: ~30%), < 1% in real runs (d=4096, millions of tokens).
Muon under sharding (the design choice): Newton–Schulz needs the WHOLE matrix, so Muon
cannot step ZeRO's flat 1/N slices the way elementwise AdamW does. Two forms, both tested
with torchrun against one process:
  - whole matrices per rank (Muon/MuonAdamW with rank, world_size): each rank owns whole
    matrices (balanced by size), keeps their momentum (4/N B/param), orthogonalises only
    those and broadcasts them: Ψ_muon bytes per step in all;
  - on sharded state (ShardedMuonAdamW, section 8: train.py --optimizer muon --dp
    zero1|2|3|fsdp): the momentum is updated on each rank's pieces, one
    all-to-all gathers every matrix at its owner, and a second returns the update's
    pieces: 2 × 2 B × Ψ_muon(N−1)/N² per rank and step (bf16), NS FLOPs split ≈ 1/N per
    rank. Moonlight's "Distributed Muon" (Liu et al. 2025) all-gathers instead and runs
    NS on every rank: N× the FLOPs, no scatter.

References: Robbins & Monro 1951 (SGD); Polyak 1964, Nesterov 1983, Sutskever et al. 2013
(momentum); Hinton's lecture 6e 2012 (RMSProp); Kingma & Ba 2015 (Adam); Reddi et al. 2018
(AMSGrad); Loshchilov & Hutter 2019 (AdamW); Keller Jordan 2024, "Muon: an optimizer for
hidden layers" (kellerjordan.github.io/posts/muon); Liu et al. 2025, "Muon is Scalable for
LLM Training" (Moonlight); Kimi Team 2025, "Kimi K2" (MuonClip / QK-clip).
"""
import math
import time

import torch
import torch.distributed as dist

from core import data
from model import GPT, get_config
from core.cli import command_line, fmt_bytes, given, knob, require_at_least_one
from core.errors import UserError
from core.meters import comm, model_state_bytes, StepTimer
from core.recipe import warmup_cosine
from core.runtime import pick_device, run_cli, TimingConditions

# (a, b, c) of p(X) = aX + b(XXᵀ)X + c(XXᵀ)²X (newton_schulz). The textbook cubic
# (1.5, -0.5, 0.0) converges to exactly 1 but grows a small σ only 1.5× per step (5 steps:
# ~7.6×); this quintic's slope 3.4445 gives ~485× (while σ is still small), landing in a
# band around 1 instead of on it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic


# ----------------------------------------------------------------------------------------
# The shared loop: every optimizer below is `update(p, g, state, group)` for one tensor.

class HandOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer does the bookkeeping (param groups, state, state_dict); each
    subclass supplies `update`. `owner` (Muon under sharding) maps a parameter to the rank
    that updates it; the others receive it by broadcast after the step."""

    def __init__(self, params, defaults):
        # list(): model.parameters() is a generator, always truthy -- the check needs a list
        params = list(params)
        if not params:
            raise UserError("the optimizer got an empty parameter list")
        # Checked on the defaults (what every constructor below passes); values set in an
        # explicit param-group dict (build_optimizer's groups) are not checked here.
        for key in ("lr", "eps", "weight_decay"):
            if key in defaults and not defaults[key] >= 0:
                raise UserError(f"{key} must be >= 0, got {defaults[key]}")
        for key, v in [(k, defaults.get(k, 0.0)) for k in ("momentum", "alpha")] + [
                ("betas", b) for b in defaults.get("betas", ())]:
            if not 0.0 <= v < 1.0:
                raise UserError(f"{key} must lie in [0, 1), got {defaults[key]}")
        super().__init__(params, defaults)
        # owner: {parameter: rank}, filled by shard() for sharded Muon only; empty means
        # every rank updates every parameter (one process, or replicated AdamW)
        self.owner, self.rank = {}, 0

    # no_grad: the updates are in-place ops on leaves that require grad, which autograd
    # refuses ("a leaf Variable that requires grad is being used in an in-place operation")
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:           # torch's protocol (LBFGS re-evaluates the loss)
            with torch.enable_grad():
                loss = closure()
        if self.owner and not dist.is_initialized():
            raise UserError("a sharded optimizer (world_size > 1) needs torchrun")
        # Only the owner computes; a non-owner never touches self.state[p], so a matrix's
        # momentum lives on one rank: Muon's ZeRO-1, 4/N B/param.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self.owner.get(p, self.rank) == self.rank:
                    self.update(p, p.grad, self.state[p], group)
        # The dict's order is shard()'s insertion order, the same on every rank (same params,
        # same stable sort): collectives must be issued in the same order everywhere, or
        # they pair up wrongly and hang. One broadcast per matrix; a real implementation
        # buckets them. Parameters are contiguous, as a collective needs.
        for p, src in self.owner.items():       # sharded Muon: owners send their matrices
            comm.broadcast(p.data, src=src)
        return loss

    def shard(self, rank, world_size, params):
        """Give each of `params` (whole matrices) one owner rank (balance_by_size): rank r then
        holds state for ≈ 1/world of them. world_size 1: no owners at all, so step()
        broadcasts nothing and needs no process group."""
        self.rank = rank
        if world_size > 1:
            self.owner = dict(zip(params, balance_by_size([p.numel() for p in params],
                                                          world_size)))


def balance_by_size(sizes, world_size):
    """-> the owner rank of each item: largest first onto the least-loaded rank (LPT,
    Graham 1969: within 4/3 of the best possible largest load). The same `sizes` in the
    same order give the same owners on every rank -- no communication needed."""
    owners, load = [0] * len(sizes), [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):     # stable: ties by order
        owners[i] = min(range(world_size), key=lambda r: load[r])
        load[owners[i]] += sizes[i]
    return owners


# ----------------------------------------------------------------------------------------
# 1. SGD: w ← w − lr·g. The gradient of one mini-batch is a noisy estimate, and in a
#    ravine (steep across, shallow along) a step big enough to move along it oscillates
#    across it. Coupled weight decay = an L2 penalty folded into the gradient.
#
# 2. Momentum (Polyak): b ← μ·b + (1−dampening)·g, step along b. Averages out the
#    oscillation across the ravine and accumulates speed along it (≈ 1/(1−μ)× longer
#    steps). Nesterov: step along g + μ·b, i.e. look at where momentum is taking us.
#    torch's convention, followed here: the first buffer is g itself.

def sgd_update(p, g, state, group):
    lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    if wd:                  # coupled: g + wd·p, so the decay goes through momentum as well
        g = g.add(p, alpha=wd)
    if mu:
        buf = state.get("momentum_buffer")
        if buf is None:
            # a copy: without decay g IS p.grad, which zero_grad or the next backward
            # changes in place
            buf = state["momentum_buffer"] = g.detach().clone()
        else:
            buf.mul_(mu).add_(g, alpha=1 - group["dampening"])
        g = g.add(buf, alpha=mu) if group["nesterov"] else buf
    p.add_(g, alpha=-lr)


class SGD(HandOptimizer):
    """= torch.optim.SGD (momentum, dampening, nesterov, coupled weight_decay)."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise UserError("Nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    update = staticmethod(sgd_update)


# 3. RMSProp: one learning rate for all weights is wrong when gradients differ by orders
#    of magnitude between weights (embedding rows of rare tokens vs common ones, the head
#    vs a norm gain). Divide each coordinate by the root of its running mean square:
#    s ← α·s + (1−α)·g², w ← w − lr·g/(√s + ε). Every coordinate moves ≈ lr per step.
#    Centered: divide by the running standard deviation instead (s − ḡ²).

def rmsprop_update(p, g, state, group):
    lr, alpha, eps, mu = group["lr"], group["alpha"], group["eps"], group["momentum"]
    # Lazily on the first step (torch's Optimizer hands in an empty dict until then). s
    # starts at 0 with no bias correction: step 1 divides g by √((1−α)·g²) = 0.1·|g| at
    # α = 0.99, a step of 10·lr per coordinate -- the start-up kick Adam's correction removes.
    if not state:
        state["square_avg"] = torch.zeros_like(p)
        if mu > 0:
            state["momentum_buffer"] = torch.zeros_like(p)
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(p)
    if group["weight_decay"]:
        g = g.add(p, alpha=group["weight_decay"])
    sq = state["square_avg"]
    sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    if group["centered"]:
        g_avg = state["grad_avg"]
        g_avg.lerp_(g, 1 - alpha)
        avg = sq.addcmul(g_avg, g_avg, value=-1).sqrt_()   # √(s − ḡ²), a fresh tensor
    else:
        avg = sq.sqrt()
    # ε outside the root, as torch does (some libraries add it under the root: the same
    # name, a different number to tune)
    avg.add_(eps)
    if mu > 0:              # torch's form: momentum over the normalised step g/(√s + ε)
        buf = state["momentum_buffer"]
        buf.mul_(mu).addcdiv_(g, avg)
        p.add_(buf, alpha=-lr)
    else:
        p.addcdiv_(g, avg, value=-lr)


class RMSprop(HandOptimizer):
    """= torch.optim.RMSprop (alpha, eps, weight_decay, momentum, centered)."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered))

    update = staticmethod(rmsprop_update)


# 4. Adam = momentum (first moment m) + RMSProp (second moment v), with bias correction:
#    both start at 0, so early averages are too small by (1−β^t); dividing by it fixes the
#    first steps. w ← w − lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε). AMSGrad: divide by the
#    running max of v (v never shrinks, so the step never grows: Reddi et al.'s fix for
#    Adam's non-convergence examples).
#
# 5. AdamW: in Adam, an L2 penalty added to g is divided by √v like everything else, so
#    weights with large gradients are barely decayed. Decouple it: w ← w·(1 − lr·wd)
#    before the Adam step (Loshchilov & Hutter). Same state, same cost as Adam.

def adam_update(p, g, state, group):
    (beta1, beta2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
    if not state:
        # a Python int; torch keeps a 0-dim tensor per parameter: the "opt_scalars" that
        # train.py's ledger reports apart from the 8 B/param of m and v
        state["step"] = 0
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    # AdamW, with torch's parametrisation: × (1 − lr·wd) with this step's lr, so the decay
    # follows the schedule and wd is relative to lr (the paper multiplies its λ by the
    # schedule multiplier η_t only). lr = 3e-3, wd = 0.1: weights shrink 3e-4 per step.
    if wd and group["decoupled_weight_decay"]:
        p.mul_(1 - lr * wd)
    elif wd:
        g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - beta1)                                # m ← β1·m + (1−β1)·g
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)        # v ← β2·v + (1−β2)·g²
    if group["amsgrad"]:    # out=: the running max is updated in place, in the state
        v = torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
    # Bias corrections as scalars, in torch's single-tensor order of float ops: 1/(1−β1^t)
    # folded into the step size, √(1−β2^t) into the denominator, ε added after it (so ε
    # is in gradient units). The same ops in the same order is why the tests can demand
    # bit equality with torch.optim (tests/test_optim.py, atol=0).
    denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))


class Adam(HandOptimizer):
    """= torch.optim.Adam (coupled L2 weight_decay, amsgrad)."""
    decoupled = False       # AdamW flips it; adam_update reads it from the group

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, amsgrad=amsgrad,
                                      weight_decay=weight_decay,
                                      decoupled_weight_decay=self.decoupled))

    update = staticmethod(adam_update)


class AdamW(Adam):
    """= torch.optim.AdamW: Adam with decoupled weight decay (default 0.01)."""
    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


# ----------------------------------------------------------------------------------------
# 6. Muon. Adam is elementwise: it cannot see that a weight MATRIX's momentum is nearly
#    low-rank -- a few directions dominate (`compare` prints its stable rank), so most
#    of the update goes into directions the model already uses and rare directions barely
#    move. Muon replaces the momentum M = U S Vᵀ by its nearest semi-orthogonal matrix
#    U Vᵀ: every direction of the update gets the same size. The SVD is too slow on GPUs,
#    so Newton–Schulz iterations approximate it with matmuls only.

def newton_schulz(G, steps=5, coefficients=NS_COEFFICIENTS, eps=1e-7, dtype=torch.bfloat16):
    """≈ U Vᵀ for G = U S Vᵀ, by iterating the odd polynomial p(X) = aX + b(XXᵀ)X + c(XXᵀ)²X,
    which acts on each singular value alone: σ ← aσ + bσ³ + cσ⁵ (same U, V). Dividing by
    ‖G‖_F first puts every σ in [0, 1]; the coefficients (3.4445, −4.7750, 2.0315) make
    the slope at 0 as steep as possible (a = 3.4, so small σ grow ~3.4× per step) at the
    price of not converging to exactly 1: after 5 steps σ lands in roughly (0.7, 1.2) --
    Keller Jordan found that this does not hurt. bf16 is enough (the result is only a
    direction) and is what the reference does. Equal, op for op, to torch.optim.Muon's."""
    if G.dim() != 2:
        raise UserError(f"Newton–Schulz needs a matrix, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)   # iterate on the wide side: X Xᵀ is the smaller Gram
    X = G.to(dtype).T if tall else G.to(dtype)
    # ‖X‖_F ≥ σ_max, so every σ lands in [0, 1], where the polynomial's band holds. The
    # clamp: a zero matrix (a weight whose gradients were all 0) stays 0 instead of 0/0.
    X = X / X.norm().clamp(min=eps)      # (Keller's reference: X / (‖X‖ + eps))
    # Per step for X m×n (m ≤ n): X Xᵀ 2m²n FLOPs, A·A 2m³, B·X 2m²n: the header's
    # 4m²n + 2m³. ns_steps is the knob: fewer leave the smallest σ below the band, more
    # cost linearly (10 steps: 2× the FLOPs).
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)      # b·A + c·A², one fused op
        X = torch.addmm(X, B, X, beta=a)               # a·X + B·X
    return X.T if tall else X


def ns_flops(shape, steps=5):
    """newton_schulz's cost for an m×n matrix (m ≤ n): steps × (4m²n + 2m³) FLOPs."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def muon_lr_scale(shape, adjust_lr_fn):
    """U Vᵀ of an A×B matrix has min(A,B) unit singular values, so its RMS entry is
    1/√max(A,B): wide or tall matrices would get smaller steps. "original" (Keller):
    × √max(1, A/B) (A = fan-out); "match_rms_adamw" (Moonlight): × 0.2·√max(A,B), an RMS
    of 0.2 like a typical AdamW update, so Muon can reuse AdamW's lr and weight decay."""
    A, B = shape[:2]         # nn.Linear's weight is (out, in): A = fan-out, B = fan-in
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    raise UserError(f"unknown adjust_lr_fn {adjust_lr_fn!r}: original or match_rms_adamw")


def muon_momentum(g, state, group):
    """m ← μ·m + (1−μ)·g, elementwise (so it runs on a shard as well as on the whole
    matrix); -> what Newton–Schulz orthogonalises: m, or Nesterov's (1−μ)·g + μ·m."""
    # Starts at 0, no bias correction (torch.optim.Muon's convention): step 1's buffer is
    # (1−μ)·g, 20× too small at μ = 0.95 -- harmless, Newton–Schulz divides the scale away.
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(g)
    buf, mu = state["momentum_buffer"], group["momentum"]
    buf.lerp_(g, 1 - mu)                                 # m ← μ·m + (1−μ)·g
    return g.lerp(buf, mu) if group["nesterov"] else buf


def muon_apply(p, o, shape, group):
    """w ← (1 − lr·wd)·w − lr·scale(shape)·O: decoupled decay with the plain lr, and the
    shape factor on the orthogonal update only. p and o may be pieces of the matrix; shape
    is the whole matrix's."""
    lr = group["lr"]
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(o, alpha=-lr * muon_lr_scale(shape, group["adjust_lr_fn"]))


def muon_update(p, g, state, group):
    if g.dim() != 2:
        raise UserError(f"Muon updates 2-D matrices only, got shape {tuple(g.shape)}")
    u = muon_momentum(g, state, group)
    o = newton_schulz(u, group["ns_steps"], group["ns_coefficients"], group["eps"])
    muon_apply(p, o, p.shape, group)


def _muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                   adjust_lr_fn):
    """One Muon group's settings, checked: shared by Muon and build_optimizer's hybrid, so
    both fail the same way on a bad name or step count."""
    muon_lr_scale((1, 1), adjust_lr_fn)                 # validates the name
    if ns_steps < 1:
        raise UserError(f"ns_steps must be at least 1, got {ns_steps}")
    return dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn)


class Muon(HandOptimizer):
    """= torch.optim.Muon (same defaults). rank/world_size > 1: each rank owns whole
    matrices, updates only those and broadcasts them (see the header); gradients must
    already be averaged across ranks (DDP)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                 rank=0, world_size=1):
        super().__init__(params, _muon_defaults(lr, weight_decay, momentum, nesterov,
                                                ns_coefficients, eps, ns_steps, adjust_lr_fn))
        # read back from the groups: `params` may have been a list of group dicts
        params = [p for g in self.param_groups for p in g["params"]]
        if any(p.dim() != 2 for p in params):
            raise UserError(f"Muon takes 2-D matrices only, got shapes "
                            f"{[tuple(p.shape) for p in params if p.dim() != 2]}: give those "
                            f"to AdamW (build_optimizer does)")
        self.shard(rank, world_size, params)

    update = staticmethod(muon_update)


# 7. The hybrid used in practice (Keller's MuonWithAuxAdam, Moonlight, Kimi K2): Muon for
#    hidden matrices; AdamW for the embedding (a lookup table whose rows are updated only
#    when their token appears), the output head (worse with Muon, per Keller), norms.

class MuonAdamW(HandOptimizer):
    """One optimizer, groups with algo "muon" or "adamw": one step(), one state_dict()."""

    def __init__(self, groups, rank=0, world_size=1):
        # the defaults only fill keys a group lacks; build_optimizer's groups carry their own
        super().__init__(groups, dict(lr=1e-3, weight_decay=0.0))
        self.shard(rank, world_size, [p for g in self.param_groups if g["algo"] == "muon"
                                      for p in g["params"]])

    def update(self, p, g, state, group):
        # One optimizer, two algorithms by group: one step(), one state_dict() to save and
        # resume (tests/test_optim.py), one set_lr for the loop.
        (muon_update if group["algo"] == "muon" else adam_update)(p, g, state, group)


def is_hidden_matrix(name, p):     # Muon's share: 2-D maps from hidden state to hidden state
    # By name: the extra heads' output.weight is excluded too; every other 2-D weight is
    # "hidden", an MoE router.weight (n_expert × d) and MLA's latent projections included.
    # p: the parameter, or its shape (a sharded piece is flat: its layout knows the shape)
    shape = getattr(p, "shape", p)
    return len(shape) == 2 and not name.endswith(("tok_embeddings.weight", "output.weight"))


def build_optimizer(named_params, name="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95),
                    eps=1e-8, momentum=0.95, muon_lr=None, adjust_lr_fn="match_rms_adamw",
                    nesterov=True, rank=0, world_size=1):
    """named_params: (name, tensor) pairs (the model's, or train.py's fp32 master copies
    zipped with the model's names). "adamw": decay on matrices, none on norms (1-D).
    "muon": the hybrid; muon_lr defaults to lr (right with match_rms_adamw; with
    "original" Keller uses ~0.02). Groups carry lr_scale = their lr / lr for set_lr."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    groups = optimizer_groups(named, name, lr, weight_decay, betas, eps, momentum, muon_lr,
                              adjust_lr_fn, nesterov)
    return AdamW(groups) if name == "adamw" else MuonAdamW(groups, rank, world_size)


def optimizer_groups(named, name, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8,
                     momentum=0.95, muon_lr=None, adjust_lr_fn="match_rms_adamw",
                     nesterov=True, shape_of=lambda p: p.shape):
    """build_optimizer's parameter groups. shape_of: a tensor's parameter shape (a sharded
    piece is flat: build_sharded passes its layout's shape)."""
    if not lr > 0 or (muon_lr is not None and not muon_lr > 0):
        raise UserError(f"learning rates must be > 0, got lr={lr} muon_lr={muon_lr}")
    decay = [p for n, p in named if len(shape_of(p)) >= 2]
    no_decay = [p for n, p in named if len(shape_of(p)) < 2]
    adam = dict(algo="adamw", lr=lr, lr_scale=1.0, betas=tuple(betas), eps=eps, amsgrad=False,
                decoupled_weight_decay=True)
    if name == "adamw":
        groups = [dict(adam, params=decay, weight_decay=weight_decay),
                  dict(adam, params=no_decay, weight_decay=0.0)]
        return [g for g in groups if g["params"]]
    hidden = [p for n, p in named if is_hidden_matrix(n, shape_of(p))]
    rest = [p for n, p in named if len(shape_of(p)) >= 2 and not is_hidden_matrix(n, shape_of(p))]
    muon_lr = lr if muon_lr is None else muon_lr
    muon = dict(_muon_defaults(muon_lr, weight_decay, momentum, nesterov, NS_COEFFICIENTS,
                               1e-7, 5, adjust_lr_fn),
                algo="muon", params=hidden, lr_scale=muon_lr / lr)
    groups = [muon, dict(adam, params=rest, weight_decay=weight_decay),
              dict(adam, params=no_decay, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


OPTIMIZERS = ("adamw", "muon")


def set_lr(optimizer, lr):
    """The schedule's lr for this step, times each group's lr_scale (Muon's own lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# ----------------------------------------------------------------------------------------
# 8. Muon on sharded state (train.py --optimizer muon --dp zero1|zero2|zero3|fsdp). ZeRO
#    gives each rank a flat 1/N slice of every unit, cut wherever the slice ends (a matrix
#    may be split between ranks); FSDP2 gives it a block of rows. Elementwise steps run on
#    those pieces as they are -- AdamW, and Muon's momentum -- but Newton–Schulz needs the
#    whole matrix. So, as nanochat's and Essential AI's distributed Muon do:
#      1. each rank updates the momentum of its pieces (state sharded: 4/N B/param);
#      2. ONE all-to-all sends every piece of (Nesterov) momentum to its matrix's owner
#         (whole matrices spread over the ranks by size, balance_by_size);
#      3. each owner assembles its matrices and orthogonalises them: NS FLOPs ≈ 1/N each;
#      4. a second all-to-all returns to each rank its pieces of the update;
#      5. every rank applies decay + update to its pieces (muon_apply).
#    Both exchanges move bf16: newton_schulz casts its input to bf16 first and returns
#    bf16, so nothing is lost. Per rank and step ≈ 2 exchanges × 2 B × Ψ_m·(N−1)/N² bytes
#    (it holds Ψ_m/N, of which (N−1)/N belongs to matrices others own) -- small next to
#    ZeRO's 2 × 4 B × Ψ·(N−1)/N. The alternative, Moonlight's "Distributed Muon" (Liu et
#    al. 2025), all-gathers each momentum to every rank and runs NS N times over: Ψ_m·4 B
#    more gathered, N× the FLOPs, no scatter.

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
    """MuonAdamW over pieces. `layout` maps every tensor the optimizer steps to (name, the
    whole parameter's shape, start, end): the piece is [start, end) of the flattened
    parameter. The groups are optimizer_groups' (build_sharded)."""

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


def build_sharded(pieces, rank, world_size, **settings):
    """The hybrid over a data-parallel wrapper's pieces: `pieces` as its owned_ranges give
    them, (name, parameter, start, end, tensor the optimizer steps). settings: those of
    build_optimizer (lr, weight_decay, muon_lr, betas, ...)."""
    layout = {t: (name, tuple(p.shape), a, b) for name, p, a, b, t in pieces}
    groups = optimizer_groups([(name, t) for name, _, _, _, t in pieces], "muon",
                              shape_of=lambda t: layout[t][1], **settings)
    return ShardedMuonAdamW(groups, layout, rank, world_size)


# (MuonClip / QK-clip, Kimi K2's guard on the attention logits Muon can grow, is applied by
# the training loop after each step: training/qk_clip.py.)


# ----------------------------------------------------------------------------------------
# Why Muon: the spectrum of a momentum matrix vs of the update Muon makes from it.

def spectrum(M):
    """stable rank ‖M‖_F²/σ_max² (how many directions carry the energy; at most min(m,n)),
    and σ_max/σ_median (the spread)."""
    s = torch.linalg.svdvals(M.float())       # descending: s[0] = σ_max
    return (s.pow(2).sum() / s[0] ** 2).item(), (s[0] / s.median()).item()


def ascii_plot(curves, width=64, height=14, xlabel="tokens"):
    """curves: {marker: [(x, y), ...]} -> a character plot; '*' where curves overlap."""
    xs, ys = zip(*[p for c in curves.values() for p in c])
    (x0, x1), (y0, y1) = (min(xs), max(xs)), (min(ys), max(ys))
    grid = [[" "] * width for _ in range(height)]
    for mark, c in curves.items():
        for x, y in c:
            col = round((x - x0) / max(x1 - x0, 1e-12) * (width - 1))
            row = round((y1 - y) / max(y1 - y0, 1e-12) * (height - 1))
            grid[row][col] = "*" if grid[row][col] not in (" ", mark) else mark
    lines = [f"{y1 - (y1 - y0) * i / (height - 1):7.3f} |" + "".join(r)
             for i, r in enumerate(grid)]
    return "\n".join(lines + [" " * 8 + "+" + "-" * width,
                              " " * 9 + f"{x0:.0f}".ljust(width - 12) + f"{x1:.0f} {xlabel}"])


# ----------------------------------------------------------------------------------------
# compare: AdamW vs the Muon hybrid on the same GPT, same tokens, same seed

def lr_factor(step, args):
    """Linear warmup, then cosine to 10% (the same schedule for every run)."""
    return warmup_cosine(step, args.steps, args.warmup_steps, 1.0, 0.1)


@torch.no_grad()
def evaluate(model, corpus, args, device):
    model.eval()
    losses = [model(*data.get_batch(corpus.val, args.batch_size, args.seq_len, args.seed + 1,
                                    i, device=device))[1].item() for i in range(args.eval_iters)]
    model.train()
    return sum(losses) / len(losses)


def train_run(cfg, corpus, args, device, name, lr, muon_lr=None):
    """One run: (step, val loss) curve, wall seconds, and the model and optimizer at the end."""
    # The same --seed for every run: the same initial weights and (below) the same batches,
    # so two runs differ in their optimizer only -- a paired comparison.
    model = GPT(cfg, seed=args.seed).to(device)
    opt = build_optimizer(model.named_parameters(), name, lr=lr, muon_lr=muon_lr,
                          weight_decay=args.weight_decay, adjust_lr_fn=args.adjust_lr_fn)
    curve, t0 = [(0, evaluate(model, corpus, args, device))], time.time()
    for step in range(args.steps):
        set_lr(opt, lr * lr_factor(step, args))
        x, y = data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed, step,
                              device=device)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # (after the step: a NaN loss has already poisoned the weights; recording inf makes
        # min() in compare rank the run last instead of crashing the sweep)
        if not math.isfinite(loss.item()):                # diverged: stop, rank it last
            curve.append((step + 1, float("inf")))
            break
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, corpus, args, device)))
    seconds = time.time() - t0
    label = f"adamw lr {lr:g}" if muon_lr is None else f"muon lr {muon_lr:g} (adamw {lr:g})"
    print(f"  {label}: final val {curve[-1][1]:.4f} ({seconds:.0f} s)", flush=True)
    return dict(name=name, label=label, lr=lr, muon_lr=muon_lr, curve=curve,
                final=curve[-1][1], seconds=seconds, model=model, opt=opt)


def tokens_to_target(curve, target, tokens_per_step):
    """Tokens at which the val loss first reaches target, linearly interpolated between
    evaluations; None if never."""
    # the first evaluation at or below target; frac: where the straight line from l0 to l1
    # crosses it (0 when l0 was already there)
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            frac = (l0 - target) / (l0 - l1) if l0 > target else 0.0
            return (s0 + frac * (s1 - s0)) * tokens_per_step
    return None


def model_config(args, vocab_size):
    # the shape knobs (SHAPE_KNOBS) on top of `small`; block_size = seq_len: the RoPE table
    # exactly as long as the training sequences
    return get_config("small", **given(args, SHAPE_KNOBS), block_size=args.seq_len,
                      vocab_size=vocab_size)


def compare(args, device):
    corpus = data.load_corpus(args.data, vocab_size=args.vocab_size)
    cfg, tps = model_config(args, corpus.enc.n_vocab), args.batch_size * args.seq_len
    probe = GPT(cfg, seed=None)           # only to count parameters: seed=None skips init
    n_hidden = sum(p.numel() for n, p in probe.named_parameters() if is_hidden_matrix(n, p))
    print(f"model: {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads / {cfg.n_kv_head} "
          f"kv, vocab {cfg.vocab_size}: {probe.num_params():,} params ({n_hidden:,} in hidden "
          f"matrices) | {args.steps} steps × {tps:,} tokens | warmup {args.warmup_steps}, "
          f"cosine to 10% | seed {args.seed} | {torch.get_num_threads()} thread(s)")
    with TimingConditions() as conditions:      # the load around the runs' wall times
        runs = [train_run(cfg, corpus, args, device, "adamw", lr) for lr in args.lrs]
        adamw = min(runs, key=lambda r: r["final"])
        for mlr in args.muon_lrs:   # Muon's matrices at mlr; the rest keeps AdamW's best lr
            runs.append(train_run(cfg, corpus, args, device, "muon", adamw["lr"], mlr))
    muon = min(runs[len(args.lrs):], key=lambda r: r["final"])
    # the worse of the two best final losses: a level both best runs reach, so "tokens to
    # target" is defined for both
    target = args.target or max(adamw["final"], muon["final"])
    print(f"\n{'run':<30} {'final val':>9} {'tokens to ' + format(target, '.3f'):>17}  wall s")
    for r in runs:
        t = tokens_to_target(r["curve"], target, tps)
        print(f"{r['label']:<30} {r['final']:9.4f} "
              f"{'never' if t is None else format(t, ',.0f'):>17} {r['seconds']:7.0f}"
              f"{' <- best' if r is adamw or r is muon else ''}")
    t_a, t_m = (tokens_to_target(r["curve"], target, tps) for r in (adamw, muon))
    ratio = t_a / t_m if t_a and t_m else float("nan")
    print(f"\nval loss {target:.3f}: AdamW needs {t_a or float('nan'):,.0f} tokens, Muon "
          f"{t_m or float('nan'):,.0f}: AdamW/Muon = {ratio:.2f}× (Moonlight: ≈2× at scale)\n"
          f"(wall times: Muon's Newton–Schulz is large at this d; the claim is about tokens)")
    conditions.report()               # one line when the machine was too busy to time
    print("\nval loss (A = AdamW, M = Muon, * = both):")
    print(ascii_plot({"A": [(s * tps, l) for s, l in adamw["curve"][1:]],
                      "M": [(s * tps, l) for s, l in muon["curve"][1:]]}))
    why(adamw, muon)
    return dict(target=target, adamw=t_a, muon=t_m, ratio=ratio, runs=runs)


def why(adamw, muon):
    """The momentum of a matrix is dominated by a few directions; Muon's update is not."""
    print("\nwhy: spectra at the end of training, middle layer (stable rank = ‖M‖²_F/σ²_max,"
          f" out of min(m, n) / spread = σ_max/σ_median)\n{'matrix':<32} {'shape':>10} "
          f"{'momentum':>16} {'Adam update':>16} {'Muon update':>16}")
    mid = len(muon["model"].layers) // 2
    for suffix in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2"):
        name = f"layers.{mid}.{suffix}.weight"
        pm, pa = (dict(r["model"].named_parameters())[name] for r in (muon, adamw))
        m, sa = muon["opt"].state[pm]["momentum_buffer"], adamw["opt"].state[pa]
        # Adam's update direction without the bias corrections: scalars, and both measures
        # (stable rank, σ_max/σ_median) ignore a matrix's overall scale
        adam_u = sa["exp_avg"] / (sa["exp_avg_sq"].sqrt() + 1e-8)
        cols = [spectrum(m), spectrum(adam_u), spectrum(newton_schulz(m))]
        print(f"{name:<32} {str(tuple(m.shape)):>10} " +
              " ".join(f"{r:7.1f} / {s:6.1f}" for r, s in cols))


# ----------------------------------------------------------------------------------------
# bench: what each optimizer holds and what its step costs, hand vs torch, same run

def bench(args, device, conditions=None):
    """conditions: a core.runtime.TimingConditions (None: the machine's own), which judges
    the timings and prints the one warning line when they cannot be trusted."""
    conditions = conditions or TimingConditions()
    cfg = model_config(args, args.vocab_size)
    model = GPT(cfg, seed=args.seed).to(device)
    x = torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), device=device)
    # One forward+backward: its gradients feed every row below, so the rows time the
    # optimizer's update alone (x as its own target: random tokens, any loss will do).
    with StepTimer(device) as fwd_bwd:
        model(x, x)[1].backward()
    every = list(model.parameters())
    hidden = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    # foreach=False: torch's single-tensor loop, the algorithm the hand versions follow;
    # its default on GPUs, the foreach (multi-tensor) kernels, would time another code.
    T = torch.optim
    rows = [("SGD", every, lambda ps: SGD(ps), lambda ps: T.SGD(ps, 1e-3, foreach=False)),
            ("momentum (Nesterov)", every, lambda ps: SGD(ps, 1e-3, 0.9, nesterov=True),
             lambda ps: T.SGD(ps, 1e-3, 0.9, nesterov=True, foreach=False)),
            ("RMSProp", every, RMSprop, lambda ps: T.RMSprop(ps, foreach=False)),
            ("Adam", every, Adam, lambda ps: T.Adam(ps, foreach=False)),
            ("AdamW", every, AdamW, lambda ps: T.AdamW(ps, foreach=False)),
            ("Muon (hidden matrices)", hidden, Muon, T.Muon)]
    ns = sum(ns_flops(p.shape) for p in hidden)
    step_flops = model.flops_per_token(args.seq_len) * args.batch_size * args.seq_len
    print(f"bench: {model.num_params():,} params ({sum(p.numel() for p in hidden):,} in hidden"
          f" matrices), forward+backward of {args.batch_size}×{args.seq_len} tokens "
          f"{fwd_bwd.seconds * 1e3:.0f} ms; optimizer.step(): best of {args.bench_steps}, hand and "
          f"torch alternating, same gradients, {torch.get_num_threads()} thread(s)")
    print(f"{'optimizer':<24} {'state B/param':>13} {'hand ms':>8} {'torch ms':>9} hand/torch")
    repeats = {}                      # every timed step of every row: their spread is judged
    with conditions:                  # the load average as the timing starts and ends
        for label, ps, hand, ref in rows:
            # Hand and torch step the SAME tensors, alternately: the weights drift, which
            # the timing does not mind; the best of N (min) drops a busy machine's noise.
            opts, times = [hand(ps), ref(ps)], [[], []]
            for _ in range(args.bench_steps):
                for opt, ts in zip(opts, times):
                    t0 = time.perf_counter()
                    opt.step()
                    ts.append(time.perf_counter() - t0)
            state = model_state_bytes(None, opts[0])["optimizer"] / sum(p.numel() for p in ps)
            t_hand, t_ref = min(times[0]), min(times[1])
            print(f"{label:<24} {state:13.2f} {t_hand * 1e3:8.2f} {t_ref * 1e3:9.2f} "
                  f"{t_hand / t_ref:10.2f}")
            repeats.update({f"{label} hand": times[0], f"{label} torch": times[1]})
    print(f"Newton–Schulz: {ns / 1e6:.0f} MFLOP per step = {100 * ns / step_flops:.1f}%"
          f" of the step's {step_flops / 1e9:.2f} GFLOP forward+backward (≈ 5·d/tokens for the "
          f"hidden matrices)")
    # one line, only when the load or the spread says the times above cannot be trusted
    return conditions.report(repeats)


# ----------------------------------------------------------------------------------------
# Command line: every knob once, a row each (flag, default, help; core/cli.py makes the
# flags and --help).

def floats(text):            # "1e-3,3e-3" -> [0.001, 0.003] (argparse reports a bad one)
    return [float(v) for v in text.split(",")]


MODE_KNOBS = [
    knob("mode", "compare", "compare: AdamW vs Muon; bench: state and step time vs "
         "torch.optim", nargs="?", choices=("compare", "bench")),
]

# the shape model_config hands to get_config (on top of `small`)
SHAPE_KNOBS = [
    knob("--n-layer", 4, "layers"),
    knob("--n-embd", 128, "width"),
    knob("--n-head", 4, "attention heads"),
    knob("--n-kv-head", 2, "key/value heads (GQA)"),
]

MODEL_KNOBS = SHAPE_KNOBS + [
    knob("--vocab-size", 1024, "tokenizer vocabulary"),
    knob("--data", None, "a UTF-8 text file (not given: the built-in corpus)"),
]

TRAINING_KNOBS = [
    knob("--steps", 150, "optimizer steps per run"),
    knob("--batch-size", 16, "sequences per step"),
    knob("--seq-len", 128, "tokens per sequence"),
    knob("--warmup-steps", 15, "linear warmup steps"),
    knob("--lrs", "3e-4,1e-3,3e-3", "AdamW's lr sweep", type=floats),
    knob("--muon-lrs", "1e-3,3e-3,1e-2", "Muon's lr sweep (hidden matrices; the rest keeps "
         "AdamW's best lr)", type=floats),
    knob("--adjust-lr-fn", "match_rms_adamw", "Muon's shape scaling",
         choices=("original", "match_rms_adamw")),
    knob("--weight-decay", 0.1, "decoupled, both"),
    knob("--eval-interval", 10, "steps between val losses"),
    knob("--eval-iters", 4, "val batches per evaluation"),
    knob("--target", 0.0, "target val loss (0 = the worse of the two best runs' final loss)"),
    knob("--seed", 1337, "weights and batches"),
    knob("--bench-steps", 10, "timed steps per bench row"),
    knob("--threads", 1, "CPU threads (1: reproducible, and fastest on a shared machine; 0: "
         "as many as torch picks)"),
    knob("--device", "cpu", "cpu, cuda or auto"),
]

KNOBS = {None: MODE_KNOBS,
         "model (a custom config smaller than `small`, to fit 2 CPU cores)": MODEL_KNOBS,
         "training": TRAINING_KNOBS}


def parse_args(argv=None):
    args = command_line("Optimizers by hand; AdamW vs Muon.", KNOBS).parse_args(argv)
    require_at_least_one(args, ("steps", "batch_size", "seq_len", "warmup_steps",
                                "eval_interval", "eval_iters", "bench_steps", "n_layer",
                                "n_embd"))
    if min(args.lrs + args.muon_lrs) <= 0:
        raise UserError("learning rates must be > 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    return compare(args, device) if args.mode == "compare" else bench(args, device)


if __name__ == "__main__":
    run_cli(main)
