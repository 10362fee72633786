"""
lora.py -- fine-tune the shared GPT cheaply: LoRA, LoRA+, QLoRA (NF4), VeRA, DoRA, each
measured against full fine-tuning on the same task for what it saves, adds and sacrifices.

Run:  python lora.py --method lora --rank 8     # fine-tune out/ckpt.pt, evaluate, ledger
      python lora.py compare                    # every method, same steps, one table
      python lora.py --method vera --save out/lora/vera.pt     # write the adapter file
      python lora.py --load out/lora/vera.pt --steps 100        # continue training it
      python lora.py eval --load out/lora/vera.pt --export out/lora/merged.pt  # merge it
      python serve.py --checkpoint out/lora/merged.pt           # a plain GPT: serve it
      python -m scripts.lora_estimate 65B       # QLoRA's "65B on one 48 GB GPU", by arithmetic
      torchrun --standalone --nproc_per_node=2 lora.py --method qlora    # data parallel

The task: the base `small` model learnt Python source only; here it learns core/data.py's
arithmetic ("3+5=" -> "8\\n"), a new task. Loss on the answer tokens only; quality = exact
match of greedy answers on held-out problems, and the answer-token loss. (1-digit operands
by default: the BPE splits 2-digit numbers irregularly, and in this step budget 2-digit
exact match stays near 0% even for full fine-tuning while the answer loss falls 4.3 -> 2.)

Full fine-tuning (Ψ params, fp32, AdamW): 4Ψ weights + 4Ψ grads + 8Ψ Adam = 16 B/param,
and data parallelism all-reduces 4Ψ bytes of gradients every step.
  - LoRA (Hu et al. 2021): freeze W0, learn ΔW = (α/r)·B·A, A: r×in random, B: out×r zero
    (training starts exactly at the base). r·(in+out) trainable per layer instead of
    in·out: grads, Adam state and the data-parallel all-reduce shrink by that ratio.
    Adds two thin matmuls per layer; costs: rank(ΔW) ≤ r. rsLoRA (Kalajdzievski 2023)
    scales by α/√r so large ranks still learn. Merging W0 += ΔW makes inference free.
  - LoRA+ (Hayou et al. 2024): B's learning rate λ× A's (λ≈16). Same memory and compute;
    only the optimizer changes, for faster convergence.
  - QLoRA (Dettmers et al. 2023): frozen W0 in 4-bit NormalFloat, blocks of 64 with one
    absmax each, the absmax constants themselves quantized to 8 bits: 4.127 bits/param
    instead of 32. Adds: dequantize on the fly in forward AND backward (no fp32 copy kept).
    Costs: the base is perturbed by quantization error; merging needs a full-precision W.
  - VeRA (Kopiczko et al. 2024): ONE frozen random pair A, B shared by all layers (stored
    once); each layer learns two vectors, d (r) and b (out): ΔW = diag(b)·B·diag(d)·A.
    10-100× fewer trainable parameters than LoRA; costs: a random, not learnt, subspace.
  - DoRA (Liu et al. 2024): W' = m ⊙ (W0 + sBA)/‖W0 + sBA‖_row, a learnt magnitude per
    output row and a LoRA-updated direction. Adds out parameters per layer and, every step,
    the full W0 + sBA and its row norms (detached, Sec. 4.3). Costs: compute, activations.
NF4 here: the 7 block linears (embedding, head stay fp32). Each run ends with its ledger.

An adapter outlives its run as a file (`--save`): method, hyper-parameters, the adapter
tensors (VeRA: with its shared frozen pair) and the base model's identity (sha256 of its
weights: ΔW is a difference from ONE W0). `--load` checks all of it and refuses a mismatch;
`merge_and_unload` folds ΔW into a plain GPT whose checkpoint (train.py's format) every
script reads -- inference at exactly the base model's cost, the adapter no longer swappable.
"""
import copy
import math
import statistics
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from core import data
from core import scores
from core.adapter_file import (ADAPTER_FORMAT, ADAPTER_TENSORS, ADAPTER_VERSION, VERA_PAIR,
                               base_fingerprint, read_adapter)
from core.checkpoint import load_model
from model import GPT, get_config, PRESETS
from compression.nf4 import NF4Matmul, NF4Weight, nf4_bits_report
from core.cli import command_line, fmt_bytes, fmt_count, knob, require_at_least_one
from core.distributed import all_reduce_flat, Runtime, setup_runtime
from core.errors import UserError
from core.files import atomic_save
from core.meters import ActivationMeter, comm, model_state_bytes, StepTimer, tensor_bytes
from core.recipe import warmup_cosine
from core.runtime import print0, Progress, run_cli, seed_everything, TimingConditions

METHODS = ("full", "lora", "loraplus", "qlora", "vera", "dora")
# Per-method default learning rates (--lr 0 picks these). Full fine-tuning moves every
# pretrained weight: 10x below train.py's pretraining peak (3e-3), to keep what the base
# knows. Adapters change W only through a ΔW that starts at 0: the pretraining-sized 3e-3.
# VeRA's d and b each scale a whole row or rank of a FIXED random B·A: so few knobs that
# they need 5e-2. LoRA+ starts lower as its B group runs at lr·λ (1e-3·16 = 1.6e-2).
DEFAULT_LR = {"full": 3e-4, "lora": 3e-3, "loraplus": 1e-3, "qlora": 3e-3, "vera": 5e-2,
              "dora": 3e-3}
# Every linear of every block (attention wq wk wv wo, SwiGLU w1 w2 w3), not only the LoRA
# paper's usual wq,wv: QLoRA (Dettmers et al. 2023) found adapters on all block linears
# were needed to match full fine-tuning. The embedding and the head stay frozen fp32;
# 'output' is a valid target too (--targets output adapts the head).
ALL_LINEARS = "wq,wk,wv,wo,w1,w2,w3"

# ----------------------------------------------------------------------------------------
# The adapted linear layers. One base class holds the frozen W0 (fp32, or NF4 for QLoRA)
# and the merge machinery; subclasses change only the adapter path.

def kaiming(rows, cols, gen, a=math.sqrt(5)):
    """Kaiming-uniform: U(±gain·√(3/fan_in)), gain = √(2/(1+a²)), fan_in = cols.
    a=√5 (nn.Linear's and peft's LoRA A): bound 1/√fan_in.
    a=0 (ReLU gain √2): √(6/fan_in)."""
    return nn.init.kaiming_uniform_(torch.empty(rows, cols), a=a, generator=gen)


class LoRALinear(nn.Module):
    """y = W0 x + (α/r)·B A dropout(x). Dropout is on the adapter's input only (LoRA
    paper / peft): the frozen path sees the clean x."""

    def __init__(self, base, rank, alpha=16.0, rslora=False, dropout=0.0, nf4=None,
                 gen=None, **kw):
        super().__init__()
        self.in_features, self.out_features, self.rank = base.in_features, base.out_features, rank
        w0 = base.weight.detach()  # W0 is data from here on: autograd never tracks it
        # QLoRA: the NF4 codes become the ONLY copy of W0 (a submodule, so its buffers are in the
        # state_dict at ~4.127 bits/param); the fp32 W0 dies with the replaced nn.Linear.
        # Otherwise a frozen Parameter, not a buffer, so the ledger counts it as frozen params;
        # clone() so merge's in-place copy_ never writes into the caller's nn.Linear.
        self.qweight = NF4Weight(w0, **nf4) if nf4 else None
        self.weight = None if nf4 else nn.Parameter(w0.clone(), requires_grad=False)
        # α/r (Hu et al. 2021, Sec. 4.1): with α fixed, changing r needs no learning-rate retune.
        # rsLoRA's α/√r (Kalajdzievski 2023): with α/r the update shrinks as r grows, so large
        # ranks learn no better than small ones. r=4, α=16: 4.0 vs 8.0 (tests/test_lora.py).
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.merged = False  # True: self.weight holds W0 + ΔW
        self.init_adapter(gen, **kw)  # kw: a subclass's extras (VeRA)

    def init_adapter(self, gen):
        # peft's init: A kaiming-uniform(a=√5) = U(±1/√in), B = 0 -> ΔW = 0 at step 0.
        # Why B = 0 and not A: ∂L/∂B = s·g·(Ax)ᵀ ≠ 0 with A random, so B moves from step 1 (and A
        # once B ≠ 0: ∂L/∂A = s·Bᵀg·xᵀ). Zero both and both gradients stay 0 forever; random both
        # and step 0 is no longer the base model (test_zero_update_equals_base fails).
        self.lora_A = nn.Parameter(kaiming(self.rank, self.in_features, gen))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank))

    def base_weight(self):
        # W0 (out×in, fp32): the Parameter, or (QLoRA) a fresh dequantization the caller owns --
        # 4·out·in bytes that live only as long as the caller holds them.
        return self.weight if self.qweight is None else self.qweight.dequantize()

    def base_forward(self, x):
        q = self.qweight
        # QLoRA: NF4Matmul dequantizes in forward and again in backward (grad_x = grad_y·W0), so
        # autograd saves neither x nor an fp32 W0: 0 activation bytes for the frozen path.
        return F.linear(x, self.weight) if q is None else NF4Matmul.apply(x, q)

    def delta_weight(self):
        # The full out×in ΔW = (s·B) @ A (* and @ bind equally, left to right): built only to
        # merge and for DoRA's norm; a LoRA training step never forms it (adapter_forward).
        return self.scale * self.lora_B @ self.lora_A

    def adapter_forward(self, dropped):
        # B(A x) on the dropped-out input (forward applies the dropout): two thin matmuls,
        # r·(in+out) multiply-adds per token, never the out×in ΔW. Saved for backward:
        # dropout(x) (for A's gradient) and A x (r per token, for B's) -- about what full FT
        # saves (x, for W's): LoRA saves state, not activations.
        return self.scale * F.linear(F.linear(dropped, self.lora_A), self.lora_B)

    def forward(self, x):
        # Merged: one matmul, the adapter's cost gone. Do not train a merged layer: forward skips
        # A and B, so they would get no gradient while W silently carries the old ΔW.
        if self.merged:
            return F.linear(x, self.weight)
        return self.base_forward(x) + self.adapter_forward(self.dropout(x))

    # Hooks the subclasses override (DoRA rescales rows, VeRA has its own ΔW); merge, unmerge
    # and merge_and_unload are shared and call only these.
    def merged_weight(self, w0):
        return w0 + self.delta_weight()

    def unmerged_weight(self, w):
        return w - self.delta_weight()

    @torch.no_grad()
    def merge(self):
        """Fold the adapter into one plain matrix: inference then costs exactly the base
        model's. QLoRA: 4 bits cannot absorb ΔW exactly, so an fp32 W is materialised."""
        if not self.merged:
            # QLoRA: self.weight was None; it becomes an fp32 W0 = deq(NF4), +4 B/param until
            # unmerge. Then copy_ in place (no_grad): the Parameter object itself stays the same.
            if self.qweight is not None:
                self.weight = nn.Parameter(self.qweight.dequantize(), requires_grad=False)
            self.weight.copy_(self.merged_weight(self.weight))
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        """Undo merge. QLoRA: exactly (drop the fp32 W; the codes were kept); the fp32 path
        subtracts ΔW again: W0 back up to fp32 rounding (the test allows 1e-6)."""
        if self.merged:
            if self.qweight is not None:
                self.weight = None              # the NF4 codes were never touched
            else:
                self.weight.copy_(self.unmerged_weight(self.weight))
            self.merged = False


class DoRALinear(LoRALinear):
    """DoRA's Eq. (5): W' = m ⊙ (W0 + sBA)/‖W0 + sBA‖_c, norms per output row (the rows of
    W, out×in). m starts at ‖W0‖ so W' = W0 at step 0. The norm is detached (DoRA Sec. 4.3):
    gradient flows to m and, through V = W0 + sBA, to A and B, but not through ‖V‖ -- it
    saves keeping V's graph alive. Computed as (m/‖V‖)·(W0 x + sBA x): x never meets V.
    With adapter dropout in training the paper says nothing; we follow peft, which drops
    the input of everything the adapter adds to the frozen path W0 x:
        y = W0 x + (m/‖V‖ - 1)·W0 drop(x) + (m/‖V‖)·sBA drop(x)
    (= W' x when drop is the identity: eval mode or dropout 0)."""

    def init_adapter(self, gen):
        super().init_adapter(gen)
        # m = ‖W0‖ per output row (out values, trainable): since B = 0, V = W0 and
        # W' = m·V/‖V‖ = W0 at step 0, as for LoRA.
        self.magnitude = nn.Parameter(self.base_weight().norm(dim=1))

    def weight_norm(self):
        with torch.no_grad():            # = .detach(): a constant in backward
            # The compute DoRA adds: the full out×in V = W0 + sBA (r·in·out multiply-adds) and
            # its row norms, every forward; no_grad, so V is freed at once, not kept for backward.
            return (self.base_weight() + self.delta_weight()).norm(dim=1)

    def forward(self, x):
        if self.merged:
            return F.linear(x, self.weight)
        # (out,) factors: m/‖V‖ broadcasts over y's last dim, rescaling each output row; with
        # m = ‖V‖ it is exactly 1 and DoRA is LoRA (test_dora_with_magnitude_at_the_norm_is_lora).
        scale = self.magnitude / self.weight_norm()
        base = self.base_forward(x)
        if not (self.training and self.dropout.p > 0):  # eval, or no dropout: W' x
            return scale * (base + self.adapter_forward(self.dropout(x)))
        dropped = self.dropout(x)                    # ONE mask for both adapter terms
        return base + (scale - 1) * self.base_forward(dropped) + \
            scale * self.adapter_forward(dropped)

    def merged_weight(self, w0):
        # W' = (m/‖V‖)[:, None]·V, each row of V rescaled to norm m. ‖V‖ is stored: after merging
        # only W' is left, whose rows have norm m, so ‖V‖ cannot be recomputed to unmerge.
        v = w0 + self.delta_weight()
        self.merged_norm = v.norm(dim=1)          # kept to unmerge exactly (as peft does)
        return (self.magnitude / self.merged_norm)[:, None] * v

    def unmerged_weight(self, w):
        # W'·‖V‖/m = V, then V - ΔW = W0 (inverse of merged_weight, up to fp32 rounding)
        return w * (self.merged_norm / self.magnitude)[:, None] - self.delta_weight()


class VeRAShared(nn.Module):
    """The frozen random pair all VeRA layers share, sized for the largest layer (each uses
    a top-left slice). Registered ONCE on the model: one copy, whatever the layer count."""

    def __init__(self, rank, max_in, max_out, gen):
        super().__init__()
        # Kaiming-uniform with the ReLU gain, bound √(6/fan_in), as peft's VeRA
        # (tuners/vera `_kaiming_init`: gain √2, bound √3·gain/√fan_in), NOT LoRA's
        # 1/√fan_in: the VeRA paper (Sec. 3) picks Kaiming init so that BA keeps the same
        # variance at every rank; and the same learnt d and b then move W as far as they do
        # in peft (√6 times more than with LoRA's bound, per matrix).
        # Buffers, not Parameters: frozen, moved by .to(), saved once in the state_dict (and in the
        # adapter file: VERA_PAIR). r·(max_in + max_out) floats in all, vs LoRA's r·(in+out) PER
        # layer; drawn before any layer, so the pair is a function of the seed alone.
        self.register_buffer("A", kaiming(rank, max_in, gen, a=0))
        self.register_buffer("B", kaiming(max_out, rank, gen, a=0))


class VeRALinear(LoRALinear):
    """y = W0 x + b ⊙ B(d ⊙ A dropout(x)); trainable d (r, init 0.1) and b (out, init 0)."""

    def init_adapter(self, gen, shared=None, d_init=0.1):
        # __dict__ bypasses nn.Module.__setattr__, which would register the pair as a
        # submodule of EVERY layer: 14 copies of its keys in the state_dict and the file
        # (test_vera_shared_pair_is_stored_once fails). A plain reference: stored once.
        self.__dict__["shared"] = shared
        self.scale = 1.0                           # VeRA has no α/r: d and b carry the scale
        # b = 0 makes ΔW = 0 at step 0 (LoRA's B = 0); d ≠ 0 so that b's gradient, ∝ B(d ⊙ A x),
        # is not 0 from the start (d's own gradient is ∝ b, so 0 until b moves).
        self.vera_d = nn.Parameter(torch.full((self.rank,), d_init))
        self.vera_b = nn.Parameter(torch.zeros(self.out_features))

    def frozen_pair(self):
        # Top-left slices: views, no copy (the test compares data_ptr). Layers of one shape share
        # the SAME A and B: only their d and b tell them apart.
        return self.shared.A[:, :self.in_features], self.shared.B[:self.out_features]

    def delta_weight(self):
        A, B = self.frozen_pair()
        # diag(b)·B·diag(d)·A as scalings: b scales B's rows, d scales A's rows (equivalently
        # B's columns); no diagonal matrix is built.
        return (self.vera_b[:, None] * B) @ (self.vera_d[:, None] * A)

    def adapter_forward(self, dropped):
        A, B = self.frozen_pair()
        # The FLOPs of a LoRA of rank r: VeRA saves parameters, not compute -- and its default r
        # is the largest the layers allow, far above LoRA's 8 (--vera-rank lowers it).
        return self.vera_b * F.linear(self.vera_d * F.linear(dropped, A), B)


ADAPTER_CLASS = {"dora": DoRALinear, "vera": VeRALinear}     # LoRA, LoRA+, QLoRA: LoRALinear


def target_names(targets):
    """'wq,wv' or ['wq', 'wv'] -> ['wq', 'wv']: peft's target_modules takes either."""
    if isinstance(targets, str):
        targets = targets.split(",")
    elif isinstance(targets, (set, frozenset)):
        targets = sorted(targets)  # a set has no order: fix one
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise UserError(f"targets must be a comma-separated string or a list of layer names, "
                        f"got {targets!r}")
    names = [t.strip() for t in targets if t.strip()]
    if not names:
        raise UserError("no targets: name the linear layers to adapt (e.g. wq,wv)")
    return names


def target_linears(model, targets):
    """(name, nn.Linear) whose qualified name equals a target or ends with '.' + target:
    'wq' picks every layer's query projection, 'layers.0.attention.wq' only layer 0's.
    A target that matches nothing is refused (peft too): a typo would adapt less, silently."""
    wanted = target_names(targets)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    # endswith('.' + t), not endswith(t): target 'w1' must not also pick a module named 'xw1'
    hits = lambda t: [(n, m) for n, m in linears if n == t or n.endswith("." + t)]
    unknown = [t for t in wanted if not hits(t)]
    if unknown:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
        raise UserError(f"unknown target(s) {', '.join(map(repr, unknown))}: the linear layers "
                        f"are {', '.join(names)} (or a full name such as {linears[0][0]})")
    # In the model's module order, each linear once even if two targets name it: the spec's
    # 'targets' list, which load_adapter compares, never depends on how the user typed them.
    return [(n, m) for n, m in linears if any(n == t or n.endswith("." + t) for t in wanted)]


def apply_adapters(model, method, targets=ALL_LINEARS, rank=8, alpha=16.0, rslora=False,
                   dropout=0.0, seed=0, quant_block=64, double_quant=True, dq_block=256,
                   vera_rank=0, vera_d_init=0.1):
    """Freeze the model and swap the target nn.Linear layers for adapted ones, in place.
    'full' trains everything and swaps nothing. Same seed -> same A on every rank.
    -> the adapter's spec (plain dict): method, hyper-parameters as resolved, the adapted
    layers' names and the base's identity, which save_adapter writes into the file."""
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    # A second pass would fingerprint the adapted model (A, B included) as its "base" and stack
    # ΔWs that no adapter file can describe.
    if adapters(model):
        raise UserError("this model already carries adapters: adapt a fresh base model")
    spec = dict(method=method, base_sha256=base_fingerprint(model), targets=[])  # of W0 alone
    if method == "full":
        model.requires_grad_(True)  # all Ψ trainable
        return spec
    found = target_linears(model, targets)
    if method == "vera":   # default rank: the largest every target layer allows
        rank = vera_rank or min(min(m.in_features, m.out_features) for _, m in found)
    # Validate every layer before swapping any: a refusal leaves the model as it was.
    # rank(BA) ≤ min(in, out) anyway, so a larger r would only waste parameters.
    for name, m in found:
        if rank < 1 or rank > min(m.in_features, m.out_features):
            raise UserError(f"rank {rank} is impossible for {name} ({m.out_features}×"
                            f"{m.in_features}): use 1..{min(m.in_features, m.out_features)}")
        if method == "qlora" and m.weight.numel() % quant_block:  # blocks tile W
            raise UserError(f"QLoRA: {name} has {m.weight.numel()} weights, not a multiple "
                            f"of the NF4 block ({quant_block})")
    # The settings as resolved, in apply_adapters' own keywords: load_adapter calls
    # apply_adapters(**hparams) and gets the same shapes. (VeRA: `rank` records the number;
    # vera_rank, kept as given, recomputes it, on the same base since the hash is checked.)
    spec.update(targets=[n for n, _ in found], hparams=dict(
        targets=target_names(targets), rank=rank, alpha=alpha, rslora=rslora, dropout=dropout,
        seed=seed, quant_block=quant_block, double_quant=double_quant, dq_block=dq_block,
        vera_rank=vera_rank, vera_d_init=vera_d_init))
    # Freeze everything (embeddings, norms, head too); the adapter Parameters built below are
    # requires_grad=True by default, which makes them, and only them, trainable.
    model.requires_grad_(False)
    # One CPU generator consumed in module order: every rank draws the same A's (no broadcast
    # needed), on any device, and load_adapter can rebuild them from the seed.
    gen = torch.Generator().manual_seed(seed)
    kw = dict(rank=rank, alpha=alpha, rslora=rslora, dropout=dropout, gen=gen)
    if method == "qlora":
        kw["nf4"] = dict(block=quant_block, double_quant=double_quant, dq_block=dq_block)
    if method == "vera":
        model.vera_shared = VeRAShared(rank, max(m.in_features for _, m in found),
                                       max(m.out_features for _, m in found), gen)
        model.vera_shared.to(found[0][1].weight.device)       # Module.to moves in place
        kw.update(shared=model.vera_shared, d_init=vera_d_init)
    # Swap in place: 'layers.0.attention.wq' -> parent 'layers.0.attention', child 'wq'; the
    # block's forward now calls the adapted layer unchanged. QLoRA: the replaced fp32 nn.Linear
    # is freed once nothing refers to it (after this function returns).
    for name, m in found:
        parent, _, child = name.rpartition(".")
        new = ADAPTER_CLASS.get(method, LoRALinear)(m, **kw).to(m.weight.device)
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return spec


def adapters(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]  # DoRA, VeRA included


def merge_all(model, merge=True):                 # merge=False: unmerge
    for m in adapters(model):
        m.merge() if merge else m.unmerge()


# ----------------------------------------------------------------------------------------
# An adapter outside its run: a file complete enough to rebuild the adapted model, checked
# on load; merge-and-unload into a plain GPT that every other script reads.

def adapter_state(model):
    """What an adapter file holds: each layer's adapter tensors and, for VeRA, the shared
    frozen pair (without it, d and b scale random matrices nobody can rebuild)."""
    # Full state_dict names ('layers.0.attention.wq.lora_A'): load_state_dict(strict=False)
    # puts each back; .cpu() so the file loads on a machine without a GPU.
    return {n: t.detach().cpu() for n, t in model.state_dict().items()
            if n in VERA_PAIR or n.rsplit(".", 1)[-1] in ADAPTER_TENSORS}


def save_adapter(model, spec, path, training=None):
    """One file, plain types only (loads with torch.load(weights_only=True)): the spec
    apply_adapters returned, the adapter tensors, the base config; written atomically."""
    if spec["method"] == "full":
        raise UserError("full fine-tuning changes every weight: there is no adapter to save; "
                        "write the model with --export instead")
    # Plain types only (dicts, lists, strings, numbers, tensors): torch.load(weights_only=True)
    # reads it without unpickling code. `training` is for the reader; load ignores it.
    payload = dict(format=ADAPTER_FORMAT, version=ADAPTER_VERSION, method=spec["method"],
                   hparams=spec["hparams"], targets=spec["targets"],
                   base=dict(sha256=spec["base_sha256"], config=asdict(model.config)),
                   tensors=adapter_state(model), training=training or {})
    atomic_save(payload, path)


def load_adapter(model, ad, path="adapter"):
    """Rebuild the adapted model on `model` (the base) from read_adapter's dict, in place.
    Refused, in one line: another base, a tensor missing, extra or reshaped, and a VeRA
    pair that is missing or is not the one its seed makes. -> the spec."""
    # The base first: a ΔW learnt on another W0 fits its shapes and loads without error, and
    # is noise. One pass over the base's weights buys that refusal.
    mine, theirs = base_fingerprint(model), ad["base"]["sha256"]
    if mine != theirs:
        raise UserError(f"adapter {path!r} was trained on another base model (weights sha256 "
                        f"{theirs[:12]}…, this base {mine[:12]}…): load it on its own base")
    try:
        # Rebuild the empty adapters exactly as training began (A from the seed, B = 0); the
        # file's tensors overwrite them below. Our own UserErrors pass through unchanged.
        spec = apply_adapters(model, ad["method"], **ad["hparams"])
    except UserError:
        raise
    except (TypeError, ValueError) as e:      # settings of the wrong type in the file
        raise UserError(f"adapter file {path!r} has unusable settings: {e}") from None
    want, got = adapter_state(model), ad["tensors"]
    if ad["method"] == "vera":                 # the frozen pair: present, and the right one
        if not all(k in got for k in VERA_PAIR):
            raise UserError(f"VeRA adapter {path!r} lacks its shared frozen pair "
                            f"({', '.join(VERA_PAIR)}): its d and b cannot be used without it")
        # The pair is re-drawn from the file's seed and must equal the stored one exactly: another
        # pair (another seed, another torch RNG) would pair d and b with the wrong random matrices.
        for k in VERA_PAIR:
            if got[k].shape != want[k].shape or not torch.equal(got[k], want[k]):
                raise UserError(f"VeRA adapter {path!r}: {k} is not the pair that seed "
                                f"{spec['hparams']['seed']} makes ({tuple(want[k].shape)})")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = [k for k in want if k in got and got[k].shape != want[k].shape]  # e.g. other r
    if missing or extra or bad or spec["targets"] != ad["targets"]:
        raise UserError(f"adapter {path!r} does not fit: missing {missing[:3]}, unexpected "
                        f"{extra[:3]}, other shape {bad[:3]}")
    # Copies into the existing Parameters, so apply_adapters' requires_grad flags stay: a
    # --load run continues training the adapter.
    model.load_state_dict(got, strict=False)   # strict=False: the base's keys are not in it
    return spec


@torch.no_grad()
def merge_and_unload(model):
    """-> a plain GPT (no adapter module, no adapter tensor) whose adapted weights are the
    merged W0 + ΔW: its checkpoint is train.py's, read by load_model, serve.py, every
    script. `model` is left as it was (merged or not: it can still unmerge). QLoRA: the
    merged W is fp32 (4 bits cannot hold W0 + ΔW)."""
    # seed=None skips init_weights: every tensor is overwritten by the strict load below.
    plain = GPT(model.config, seed=None).to(model.output.weight.device)
    have = model.state_dict()
    # A plain GPT's keys, taken from the adapted model (embeddings, norms, head, unadapted
    # weights); each adapted 'X.weight' (W0, or absent for QLoRA) is set in the loop.
    state = {k: have[k] for k in plain.state_dict() if k in have}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            # merged: m.weight already is W0 + ΔW; else computed without changing m's weights
            # (DoRA's merged_weight records merged_norm, which only unmerge reads)
            state[name + ".weight"] = m.weight if m.merged else m.merged_weight(m.base_weight())
    plain.load_state_dict(state)               # strict: exactly a plain GPT's keys
    return plain.train(model.training)  # the source's train/eval mode


def export_checkpoint(plain, enc, path, spec):
    """train.py's checkpoint format (config, model, tokenizer) + where it came from."""
    ckpt = dict(config=asdict(plain.config), tokenizer=data.encoding_to_state(enc),
                model={k: v.detach().cpu() for k, v in plain.state_dict().items()},
                merged_from=dict(method=spec["method"], base_sha256=spec["base_sha256"],
                                 targets=spec["targets"]))  # provenance, for the reader
    atomic_save(ckpt, path)


def make_optimizer(model, method, lr, loraplus_ratio=16.0, weight_decay=0.0):
    """AdamW over the trainable parameters. LoRA+: the B matrices in their own group with
    lr·λ (Hayou et al. 2024: B's optimal step is ~λ× A's when the width is large)."""
    # Only trainable tensors reach AdamW, so m and v (8 B/param) exist for the adapter alone:
    # the 16 B/param of full fine-tuning becomes 4 (frozen W0) + 16 per trainable param.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    is_b = lambda n: method == "loraplus" and n.endswith("lora_B")
    # base_lr: finetune sets lr = base_lr·schedule each step, so LoRA+'s ratio λ survives
    # warmup and decay (a single shared lr would erase it).
    groups = [{"params": [p for n, p in named if not is_b(n)], "lr": lr, "base_lr": lr}]
    if method == "loraplus":
        groups.append({"params": [p for n, p in named if is_b(n)], "lr": lr * loraplus_ratio,
                       "base_lr": lr * loraplus_ratio})
    # Decoupled weight decay on A and B pulls ΔW toward 0, i.e. toward the BASE model; on
    # full fine-tuning it pulls the weights themselves toward 0. Default off (--weight-decay).
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=weight_decay)


# ----------------------------------------------------------------------------------------
# The task: core/data.py's arithmetic problems, loss on the answer tokens only.

def collate(pairs, device="cpu"):
    """(inputs, targets) of prompt + answer rows (data.pack_answers): targets -1 (ignored)
    on the prompt and the padding, so the loss is on the answer tokens only."""
    seq, mask = data.pack_answers([p for p, _ in pairs], [a for _, a in pairs])
    # Next-token shift: position t predicts token t+1, on the (N, L-1) grid the mask is on.
    # -1 = answer_loss's ignore_index: prompt and padding give neither loss nor gradient.
    x = seq[:, :-1]
    y = seq[:, 1:].masked_fill(~mask, -1)
    return x.to(device), y.to(device)


def task_batch(pairs, batch_size, seed, step, rank=0, world=1, device="cpu"):
    """The global batch (batch_size·world rows) is a function of (seed, step); rank r takes
    its slice. So 2 ranks × b rows see exactly what 1 process × 2b rows sees."""
    # A generator per step from (seed, step): step k's batch does not depend on what ran
    # before, and every rank draws the same global batch. Drawn with replacement. A --load run
    # restarts at step 0, so with the same --seed it replays the first run's batches.
    rng = np.random.default_rng([seed, step])
    rows = rng.integers(0, len(pairs), size=batch_size * world)  # the global batch
    # rank r: global rows r·b .. (r+1)·b - 1; the ranks' slices together = the b·world batch
    return collate([pairs[i] for i in rows[rank * batch_size:(rank + 1) * batch_size]], device)


def answer_loss(model, x, y):
    """Mean over rows of each row's mean answer-token cross-entropy (nats). Per-row first,
    so averaging equal-sized rank shards gives exactly the global batch's loss."""
    logits, _ = model(x)
    # .float(): the log-sum-exp over the vocabulary in fp32 even under bf16 (8 significant bits);
    # reduction="none" and .view: per-token NLL back on (N, L-1), to average row by row.
    nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1,
                          reduction="none").view(y.shape)
    mask = (y >= 0).float()
    # No row has 0 answer tokens (the answer's "\n" at least), so no 0 division. A token mean
    # over the whole batch would weigh long answers more, and one over a rank's tokens would
    # make 2 ranks differ from 1 process when the ranks' token counts differ.
    return ((nll * mask).sum(1) / mask.sum(1)).mean()


@torch.no_grad()
def evaluate(model, enc, problems):
    """-> (exact match of greedy answers, scored by data.score; answer-token loss): the
    definitions every script shares, in core/scores.py."""
    if not problems:
        return float("nan"), float("nan")
    return scores.exact_match(model, enc, problems), scores.answer_loss(model, enc, problems)


# ----------------------------------------------------------------------------------------
# The loop (data parallel when launched with torchrun)

def finetune(model, method, pairs, args, rt=Runtime(), log=True):
    """Train the trainable parameters for args.steps. -> what was measured: model state
    bytes (with gradients held), peak activation bytes, median step time."""
    lr = args.lr or DEFAULT_LR[method]  # --lr 0: the method's
    optimizer = make_optimizer(model, method, lr, args.loraplus_ratio, args.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]  # all-reduced, clipped
    model.train()  # adapter dropout on (the GPT has none)
    times, peak_act = [], 0
    # % of the steps and an eta, at most every 10 s (and at the end): the unit that moves
    progress = Progress(method, args.steps, unit="steps") if log else None
    for step in range(args.steps):          # linear warmup, then cosine decay to 10%
        f = warmup_cosine(step, args.steps, args.warmup, 1.0, 0.1)
        for g in optimizer.param_groups:  # f: 1/warmup → 1 → 0.1
            g["lr"] = g["base_lr"] * f
        x, y = task_batch(pairs, args.batch_size, args.seed, step, rt.rank, rt.world_size,
                          rt.device)
        # the meter sees what forward saves for backward (backward and step save nothing)
        with StepTimer(rt.device) as timer, ActivationMeter(model) as meter:
            loss_t = answer_loss(model, x, y)
            loss_t.backward()
            # the trainable gradients only, in one flat all-reduce: r·(in+out) per layer.
            # A per-rank mean loss + divide_by=world = the gradient of the global batch's
            # mean. Wire: 4 B × trainable per step (a ring sends 2(W-1)/W of that per
            # rank), vs 4Ψ for full fine-tuning.
            all_reduce_flat([p.grad for p in params], divide_by=rt.world_size)
            # Clip AFTER averaging: every rank sees the same global norm and scales alike. Same
            # grads, same start -> same update on every rank: no weight broadcast is ever needed.
            # (Adapter dropout > 0 breaks 2 ranks == 1 process: every rank seeds the same RNG, so
            # rank 1 repeats rank 0's masks, not the masks one process draws for those rows.)
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            optimizer.step()
        peak_act = max(peak_act, meter.bytes)
        state = model_state_bytes(model, optimizer)      # grads still held: counted
        optimizer.zero_grad(set_to_none=True)  # frees the grads
        times.append(timer.seconds)
        if log and ((step + 1) % args.log_interval == 0 or step + 1 == args.steps):
            print0(f"step {step + 1:4d} | {method} | answer loss {loss_t.item():.4f} | "
                   f"{timer.seconds * 1000:.0f} ms | state {fmt_bytes(state['total'])} | "
                   f"act {fmt_bytes(meter.bytes)} | sent {fmt_bytes(comm.total_wire)}")
        if progress:
            progress.update(step + 1)
    # median of steps 2..N: step 1 pays one-off costs (allocator warm-up, Adam state creation)
    return dict(state=state, act=peak_act, seconds=sum(times),
                step_ms=1000 * statistics.median(times[1:] or times))


# ----------------------------------------------------------------------------------------
# The ledger: what each method holds, measured from the tensors, next to the formula

def trainable_formula(model, method):
    """Trainable parameters by formula: LoRA Σ r(in+out), DoRA + Σ out, VeRA Σ (r + out)."""
    if method == "full":
        return sum(p.numel() for p in model.parameters())  # Ψ: embeddings, head, all
    def per_layer(r, i, o):
        if method == "vera":
            return r + o                    # the vectors d and b
        if method == "dora":
            return r * (i + o) + o          # A, B and the magnitude m
        return r * (i + o)                  # A and B
    return sum(per_layer(m.rank, m.in_features, m.out_features) for m in adapters(model))


def ledger_row(model, method, run, quality, base_quality):
    """Measured from the tensors: frozen = frozen parameters + persistent buffers (NF4
    codes, VeRA's shared pair), counted once each; grads/Adam from model_state_bytes."""
    # Persistent buffers only: state_dict leaves out the rope cos/sin tables (persistent=False,
    # recomputed, not stored). VeRA's pair is registered once, so it is counted once.
    keep = set(model.state_dict())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen += [b for n, b in model.named_buffers() if n in keep]
    trainable = [p for p in model.parameters() if p.requires_grad]
    st = run["state"]
    fb = tensor_bytes(frozen)
    tb = tensor_bytes(trainable)
    return dict(method=method, trainable=sum(p.numel() for p in trainable),
                formula=trainable_formula(model, method), frozen=fb, train_bytes=tb,
                grads=st["grads"], optim=st["optimizer"],
                total=fb + tb + st["grads"] + st["optimizer"],
                act=run["act"], step_ms=run["step_ms"], acc=quality[0], ans_loss=quality[1],
                base=base_quality, merge_err=run.get("merge_err", float("nan")))


def print_ledger(rows):
    ref = next((r for r in rows if r["method"] == "full"), rows[0])
    x = f"×{ref['method']}"                           # ratios against full fine-tuning when it ran
    cols = ("method", "trainable", "frozen", "train B", "grads", "Adam", "state", x,
            "act peak", x, "ms/step", x, "exact", "ans loss", "merge err")
    print0(" ".join(f"{c:>9}" for c in cols))
    for r in rows:
        print0(" ".join(f"{v:>9}" for v in (
            r["method"], fmt_count(r["trainable"]), *(fmt_bytes(r[k]) for k in (
                "frozen", "train_bytes", "grads", "optim", "total")),
            f"{r['total'] / ref['total']:.2f}", fmt_bytes(r["act"]), f"{r['act'] / ref['act']:.2f}",
            f"{r['step_ms']:.0f}", f"{r['step_ms'] / ref['step_ms']:.2f}", f"{r['acc']:.1%}",
            f"{r['ans_loss']:.3f}", f"{r['merge_err']:.1e}")))
    print0(f"{'base':>9} {'(no fine-tuning)':>{10 * 12 - 1}} {rows[0]['base'][0]:>9.1%} "
           f"{rows[0]['base'][1]:>9.3f}")
    # Measured vs formula: fp32 grads 4 B and Adam's m, v 8 B per trainable parameter. A
    # MISMATCH means a tensor trains that the formula does not know of (or the reverse).
    ok = all(r["trainable"] == r["formula"] and r["grads"] == 4 * r["trainable"]
             and r["optim"] == 8 * r["trainable"] for r in rows)
    print0(f"formulas: trainable = Σ r(in+out) (LoRA, LoRA+, QLoRA), + Σ out (DoRA), "
           f"Σ (r+out) (VeRA), Ψ (full); grads = 4 B × trainable; Adam m, v = 8 B × "
           f"trainable: {'every row matches' if ok else 'MISMATCH'}")


# ----------------------------------------------------------------------------------------
# Building, running, comparing

def build_base(args, device="cpu"):
    """-> (model, tokenizer). --ckpt none: a random --preset model with a 256-byte
    tokenizer (no merges), so tests need no trained BPE, no corpus, no checkpoint."""
    if args.ckpt == "none":
        enc = data.make_encoding({bytes([i]): i for i in range(256)})
        cfg = get_config(args.preset, vocab_size=enc.n_vocab)
        return GPT(cfg, seed=args.seed).to(device), enc
    model, ckpt = load_model(args.ckpt, device)    # a missing file: one clear UserError
    return model, data.encoding_from_state(ckpt["tokenizer"])


def task_data(enc, args):
    """-> train (prompt ids, answer ids) pairs, test problems, test pairs. The pre-split
    cuts "=" from the digits, so encoding the halves apart = encoding the whole."""
    train = data.make_problems(args.n_train, args.seed, args.digits, args.ops, "train")
    test = data.make_problems(args.eval_problems, args.seed + 1, args.digits, args.ops,
                              "test") if args.eval_problems else []
    test = list(dict.fromkeys(test))       # drawn with replacement: score each problem once
    encode = lambda probs: [(enc.encode_ordinary(p.prompt),
                             enc.encode_ordinary(p.answer + data.TERMINATOR)) for p in probs]
    return encode(train), test, encode(test)


def adapter_kwargs(args):
    """The adapter flags as apply_adapters' keywords (so also the file's hparams)."""
    return dict(targets=args.targets, rank=args.rank, alpha=args.alpha, rslora=args.rslora,
                dropout=args.dropout, seed=args.seed, quant_block=args.quant_block,
                double_quant=not args.no_double_quant, dq_block=args.dq_block,
                vera_rank=args.vera_rank, vera_d_init=args.vera_d_init)


def adapt(model, method, args, loaded=None):
    """Adapt `model` in place: from the --load file (checked) or from the flags. -> spec."""
    if loaded is not None:
        return load_adapter(model, loaded, args.load)
    return apply_adapters(model, method, **adapter_kwargs(args))


def merge_error(model, pairs, device):
    """max |logits of merge_and_unload's plain GPT - logits of the adapted model|."""
    # eval(): no adapter dropout, so both compute the same function and the difference is
    # rounding: (W0 + ΔW)x in one matmul vs W0 x + B(Ax) in three. QLoRA's merged W is fp32.
    model.eval()
    with torch.no_grad():
        x, _ = collate(pairs, device)
        err = (merge_and_unload(model)(x)[0] - model(x)[0]).abs().max().item()
    model.train()
    return err


def write_outputs(model, spec, enc, args, rt):
    """--save: the adapter file; --export: the merged, unloaded model as a checkpoint."""
    # One writer: every rank holds the same adapter (identical all-reduced updates), so
    # rank 0's copy is everyone's.
    if not rt.is_main:
        return
    if args.save:
        steps = args.steps if args.mode == "train" else 0
        lr = args.lr or DEFAULT_LR[spec["method"]]
        training = dict(steps=steps, lr=lr, loraplus_ratio=args.loraplus_ratio,
                        loaded_from=args.load)
        save_adapter(model, spec, args.save, training=training)
        print0(f"adapter ({spec['method']}, {len(spec['targets'])} layers) written to {args.save}")
    if args.export:
        plain = model if spec["method"] == "full" else merge_and_unload(model)
        export_checkpoint(plain, enc, args.export, spec)
        print0(f"merged model (a plain GPT, train.py's checkpoint format) written to "
               f"{args.export}: python serve.py --checkpoint {args.export}")


def evaluate_loaded(args, rt, base, enc, loaded):
    """eval mode: the --load adapter on its base, evaluated, merge-checked, exported."""
    model = copy.deepcopy(base)
    spec = adapt(model, None, args, loaded)
    _, test, test_pairs = task_data(enc, args)
    acc, loss = evaluate(model, enc, test)
    err = merge_error(model, test_pairs, rt.device) if test_pairs else float("nan")
    print0(f"{args.load}: {spec['method']} adapter on {len(spec['targets'])} layers of "
           f"{args.ckpt} (base sha256 {spec['base_sha256'][:12]}…) | test exact match "
           f"{acc:.1%} | answer loss {loss:.3f} | merged-model logits differ by {err:.1e}")
    write_outputs(model, spec, enc, args, rt)


def fine_tune_method(method, base, enc, args, rt, loaded, task, base_quality):
    """One row of the ledger: adapt a copy of the base, fine-tune, evaluate, merge-check.
    task: task_data's (train pairs, test problems, test pairs). -> (model, spec, row)."""
    train_pairs, test, test_pairs = task
    model = copy.deepcopy(base)
    spec = adapt(model, method, args, loaded)
    seed_everything(args.seed)                 # same dropout masks for every method
    comm.reset()  # communication counters per method
    run = finetune(model, method, train_pairs, args, rt)
    quality = evaluate(model, enc, test)
    if method != "full" and test_pairs:        # the merged plain GPT == the adapter?
        run["merge_err"] = merge_error(model, test_pairs, rt.device)
    print0(f"{method}: trained {args.steps} steps in {run['seconds']:.1f} s | test exact match "
           f"{quality[0]:.1%} (base {base_quality[0]:.1%}) | answer loss "
           f"{quality[1]:.3f} (base {base_quality[1]:.3f})")
    if rt.world_size > 1:
        print0(comm.report(f"data-parallel communication, {method} (this rank)"))
    return model, spec, ledger_row(model, method, run, quality, base_quality)


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables)

MODE_KNOBS = [
    knob("mode", "train", "train: one --method (or continue --load); compare: every method in "
         "--methods, one table; eval: evaluate (and --export) the --load adapter", nargs="?",
         choices=["train", "compare", "eval"]),
    knob("--method", "lora", f"one of {', '.join(METHODS)}"),
    knob("--methods", ",".join(METHODS), "compare: methods to run"),
]

ADAPTER_KNOBS = [
    knob("--targets", ALL_LINEARS, "linear layers to adapt (names)"),
    knob("--rank", 8, "LoRA/QLoRA/DoRA rank r"),
    knob("--alpha", 16.0, "LoRA scale α (ΔW = α/r·BA)"),
    knob("--rslora", False, "scale by α/√r (rsLoRA)"),
    knob("--dropout", 0.0, "dropout on the adapter input"),
    knob("--loraplus-ratio", 16.0, "LoRA+: lr_B / lr_A"),
    knob("--vera-rank", 0, "0 = the largest all layers allow"),
    knob("--vera-d-init", 0.1, "VeRA: initial d"),
    knob("--quant-block", 64, "QLoRA: NF4 block size"),
    knob("--dq-block", 256, "QLoRA: absmax block size"),
    knob("--no-double-quant", False, "QLoRA: fp32 absmax"),
]

TRAINING_KNOBS = [
    knob("--steps", 200, "optimizer steps per method"),
    knob("--batch-size", 32, "problems per step per rank"),
    knob("--lr", 0.0, f"0 = per method: {DEFAULT_LR}"),
    knob("--warmup", 10, "warmup steps, then cosine"),
    knob("--weight-decay", 0.0, "AdamW weight decay"),
    knob("--grad-clip", 1.0, "0 = off"),
    knob("--digits", 1, "digits per operand"),
    knob("--ops", "+-", "operators, from '+-*'"),
    knob("--n-train", 20000, "training problems"),
    knob("--eval-problems", 200, "held-out draws, 0 = none"),
]

RUN_KNOBS = [
    knob("--checkpoint --ckpt", "out/ckpt.pt", "the base model; 'none' = random --preset model "
         "(--ckpt: the old name)", dest="ckpt"),
    knob("--preset", "tiny", f"with --ckpt none: {', '.join(PRESETS)}"),
    knob("--seed", 0, "data, adapter init, dropout"),
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--threads", 1, "torch CPU threads (tiny matmuls)"),
    knob("--log-interval", 25, "steps between log lines"),
    knob("--save", "", "write the adapter file (method, settings, tensors, base identity) "
         "here, e.g. out/lora/adapter.pt"),
    knob("--load", "", "start from this adapter file: its method and settings replace the "
         "adapter flags; checked against --ckpt"),
    knob("--export", "", "write the merged, unloaded model here as a checkpoint that serve.py "
         "and every script read, e.g. out/lora/merged.pt"),
]

KNOBS = {None: MODE_KNOBS, "adapters": ADAPTER_KNOBS, "training and task": TRAINING_KNOBS,
         "run": RUN_KNOBS}


def check_args(args):
    require_at_least_one(args, ("steps", "batch_size", "warmup", "log_interval", "n_train",
                                "quant_block", "dq_block"))
    if not 0 <= args.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), got {args.dropout}")
    # --quant-block must also divide every adapted weight's size: apply_adapters checks that
    if args.quant_block % 2:
        raise UserError("--quant-block must be even (two 4-bit codes per byte)")
    if args.mode == "eval" and not args.load:
        raise UserError("eval mode evaluates an adapter file: give --load PATH")
    if args.mode == "compare" and (args.load or args.save or args.export):
        raise UserError("--load, --save and --export work on one adapter: "
                        "use train or eval mode")
    if args.method == "full" and args.save and not args.load:
        raise UserError("full fine-tuning has no adapter to --save: "
                        "write the model with --export")


def parse_args(argv=None):
    p = command_line("Fine-tune the base GPT on arithmetic with LoRA, LoRA+, QLoRA, VeRA, "
                     "DoRA or full fine-tuning, and print what each costs.", KNOBS)
    args = p.parse_args(argv)
    check_args(args)
    return args


def main(argv=None):
    args = parse_args(argv)
    with setup_runtime(args.device) as rt:
        torch.set_num_threads(args.threads)
        base, enc = build_base(args, rt.device)
        loaded = read_adapter(args.load) if args.load else None  # checked before anything slow
        if args.mode == "eval":
            return evaluate_loaded(args, rt, base, enc, loaded)
        methods = (args.methods.split(",") if args.mode == "compare" else
                   [loaded["method"] if loaded else args.method])
        for m in methods:                 # fail on bad flags or a bad file before any training
            adapt(copy.deepcopy(base), m, args, loaded)
        task = task_data(enc, args)
        train_pairs, test, _ = task
        # The base's own score on the held-out problems: every row's "before".
        t0 = time.perf_counter()
        base_quality = evaluate(base, enc, test)
        print0(f"base {args.ckpt}: {base.num_params():,} params | task: {args.digits}-digit "
               f"'{args.ops}', {len(train_pairs)} train / {len(test)} held-out problems | "
               f"{args.steps} steps × {args.batch_size * rt.world_size} rows, {rt.world_size} "
               f"rank(s) | base exact match {base_quality[0]:.1%}, answer loss "
               f"{base_quality[1]:.3f}")
        rows = []
        # one progress line as each method of a compare starts (minutes at the default
        # sizes); one method alone counts its steps (finetune's progress), not 0 of 1 methods
        progress = Progress("lora compare", len(methods), every=0)
        with TimingConditions() as conditions:   # the load around the ledger's ms/step
            for i, method in enumerate(methods):  # adapt a copy, fine-tune, evaluate, merge
                if len(methods) > 1:
                    progress.update(i, now_on=method)
                model, spec, row = fine_tune_method(method, base, enc, args, rt, loaded, task,
                                                    base_quality)
                rows.append(row)
        cmd = " ".join(["python lora.py", *(sys.argv[1:] if argv is None else argv)])
        print0(f"\nledger ({cmd}; {rt.world_size} rank(s), device {rt.device}):")
        print_ledger(rows)
        conditions.report(out=print0)            # one line when too busy to trust ms/step
        nf4_bits_report(target_linears(base, args.targets), args.quant_block, args.dq_block)
        print0(f"total {time.perf_counter() - t0:.0f} s")
        # The last method's model: train mode runs one, and compare refuses --save/--export
        write_outputs(model, spec, enc, args, rt)
        return rows


if __name__ == "__main__":
    run_cli(main)
