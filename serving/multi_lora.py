"""
serving/multi_lora.py -- many LoRA adapters served in ONE batch, never merged: S-LoRA
(Sheng et al. 2023) and Punica (Chen et al. 2023)'s batched gather matrix-vector (BGMV).

    python -m serving.multi_lora                     # small model: base vs k adapters vs merged
    python -m serving.multi_lora --adapters 1,16 --ranks 8 --shapes 64x1

What it teaches
- Merged (lora.py's merge_and_unload), an adapter costs nothing at inference: W0 + sBA is
  one matrix. But that model then serves ONE adapter: every other fine-tune needs its own
  copy of every weight, and a batch can only hold requests of one adapter.
- Unmerged, the adapter is a side path, y = x W0ᵀ + s·(x Aᵀ) Bᵀ, and W0 is the same for
  everybody. So one batch can mix requests of many adapters: every row i (a token, or a
  whole sequence) carries the index a(i) of its adapter and
        y_i = x_i W0ᵀ + s[a(i)] · (x_i A_all[a(i)]ᵀ) B_all[a(i)]ᵀ
  with A_all (n+1, r_max, in) and B_all (n+1, out, r_max) stacking every loaded adapter's
  matrices for that layer (slot 0 is the base model: zeros, so base rows get exactly W0 x).
  The base product stays ONE dense matmul over the whole batch; the adapter part gathers
  each row's A and B and runs two batched matrix-vector products (torch.bmm): BGMV.
- The seam (no hidden channel): `attach(model, adapter_set)` swaps each adapted nn.Linear
  for a MultiLoRALinear that shares its `.weight` and holds that layer's stacks, and hands
  every one of them the SAME AdapterBatch object; the engine calls
  `AdapterBatch.set_rows(indices)` before each forward. `detach` puts plain nn.Linears back.

What it costs (measured by `python -m serving.multi_lora`, in ratios to the base model)
- memory: r·(in+out) numbers per adapted layer per adapter -- rank 8 on all 7 block
  linears of the small model: ~650 KB per adapter, ~4% of the model's 16 MB. A merged copy
  per adapter would cost the whole model again; here thousands fit beside one base.
- compute: 2·r·(in+out) extra FLOPs per token per layer, next to W0's 2·in·out: ~7% of
  the small model's block FLOPs at rank 8 (Σ r(in+out) = 27k vs Σ in·out = 393k per block).
- the gather, in torch: A_all[idx] COPIES each row's matrices, N·r_max·(in+out) numbers
  written then read again per layer and forward. On a decode batch (64 rows of one token)
  that is more bytes than the base weights themselves (16 adapters of rank 8/16 on the
  small model: 83 MB copied per forward vs 16 MB of base weights). Measured on a 2-core
  CPU: a 64-row decode step 2.5x (k=1) to 4x (k=16) the base's time, a 8×32 prefill
  1.35-1.5x (one gather per sequence there); without the copy (`segment`, k=1) decode is
  1.8x: the rest is the extra small matmuls and their launches, 14 per block here.
- what a fused kernel changes: Punica's BGMV kernel reads A[a(i)] straight from the stack
  into on-chip memory (no copy, no temporary, one launch for all the rows), and its SGMV
  sorts rows into segments of one adapter so each adapter's weights are read once per
  segment, not once per row. `kernel="segment"` is that grouping in torch: one pair of
  matmuls per distinct adapter, no copy, but a host sync to find the adapters and k
  launches per layer -- cheaper when few adapters share many rows.
- rank padding (our choice; the alternative is one stack per rank): adapters of
  different ranks are padded to the layer's r_max with zeros. Exact -- zero rows of A and
  zero columns of B add exactly 0 -- but every row pays r_max (a rank-4 request does the
  work of the largest rank loaded, base rows too, multiplying zeros) and every slot stores
  r_max·(in+out). Grouping by rank would run one BGMV per rank present; S-LoRA's unified
  paging keeps each adapter at its own rank in KV-cache-like pages (its MBGMV kernel).
- sacrifices: nothing numerically (each row equals its adapter merged, up to fp32
  rounding: tests/test_multi_lora.py), but a batch of ONE adapter runs slower than that
  adapter merged: the side path is paid even when nobody mixes.

Methods (the file's `method`, written by lora.py --save): LoRA and LoRA+ (LoRA+ changes
only the training learning rates) with α/r or rsLoRA's α/√r; VeRA, whose
ΔW = diag(b)·B·diag(d)·A is another low-rank pair once b and d are folded in (so serving
stores a per-layer pair: VeRA's one-shared-pair saving is lost). Refused, in one line:
DoRA (a per-row norm of the merged W0 + sBA: not a low-rank add) and QLoRA (its ΔW was
learnt against the NF4-quantized W0, not the W0 served here). Adapter dropout is off at
inference. Adapters on MoE experts are refused: an expert sees a routed subset of rows.
"""
import copy
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.adapter_file import base_fingerprint, read_adapter
from core.cli import command_line, fmt_bytes, knob, require_at_least_one
from core.errors import UserError
from core.runtime import TimingConditions, run_cli
from model import GPT, get_config

BASE_NAME = "base"             # the name that selects no adapter (slot 0), unless the server's
KERNELS = ("gather", "segment")          # BGMV as written, or rows grouped by adapter (SGMV)
LOW_RANK_METHODS = ("lora", "loraplus", "vera")
# Why each other method cannot be a side path (the refusal's reason, one line each).
REFUSED = {
    "dora": "DoRA rescales each row of the merged W0 + sBA by m/‖W0 + sBA‖: not a low-rank "
            "add; serve it merged (python lora.py eval --load FILE --export merged.pt)",
    "qlora": "QLoRA's ΔW was learnt against the NF4-quantized W0, not the full-precision W0 "
             "served here; serve it merged (python lora.py eval --load FILE --export ...)",
}


# ----------------------------------------------------------------------------------------
# Adapters as low-rank pairs

@dataclass
class LowRank:
    """ΔW = scale · B @ A for one layer: A (r, in), B (out, r)."""
    A: torch.Tensor
    B: torch.Tensor


@dataclass
class Adapter:
    """One adapter ready to stack: its name (what requests select), where it came from,
    its rank and scale (the same for all its layers) and its pair for each layer."""
    name: str
    method: str
    rank: int
    scale: float
    layers: dict              # qualified layer name -> LowRank
    source: str = "memory"

    @property
    def nbytes(self):
        """Bytes of its own pairs: Σ r·(in+out) · bytes per number (before any padding)."""
        return sum(p.A.numel() * p.A.element_size() + p.B.numel() * p.B.element_size()
                   for p in self.layers.values())


def lora_scale(hparams):
    """α/r (Hu et al. 2021, Sec. 4.1) or rsLoRA's α/√r (Kalajdzievski 2023): the scale
    lora.LoRALinear applies; the tests check it against lora.py's own merge."""
    r, alpha = hparams["rank"], hparams["alpha"]
    return alpha / math.sqrt(r) if hparams["rslora"] else alpha / r


def file_tensor(ad, key, path):
    # read_adapter checked the types, not that each target's tensors are there: a file
    # missing one would otherwise fail with a KeyError deep in the stacking
    if key not in ad["tensors"]:
        raise UserError(f"adapter file {path!r} lacks the tensor {key!r} (not written by "
                        f"lora.py --save?)")
    return ad["tensors"][key].float()


def pairs_of(ad, path, in_features):
    """read_adapter's dict -> {layer: LowRank} and the scale. LoRA/LoRA+: the file's A, B.
    VeRA: ΔW = diag(b)·B·diag(d)·A (Kopiczko et al. 2024) = (b ⊙ B)(d ⊙ A): b scales B's
    rows, d scales A's rows, scale 1; A, B are the top-left (r, in) and (out, r) slices of
    the shared frozen pair (lora.VeRALinear.frozen_pair), so each layer gets its own
    folded copy. in_features: {layer: its input width} in the served model."""
    method, layers = ad["method"], {}
    for name in ad["targets"]:
        if method == "vera":
            d, b = file_tensor(ad, f"{name}.vera_d", path), file_tensor(ad, f"{name}.vera_b", path)
            # a layer the model lacks keeps the whole pair: check_fits refuses it by name
            A = file_tensor(ad, "vera_shared.A", path)[:, :in_features.get(name)]
            B = file_tensor(ad, "vera_shared.B", path)[:b.shape[0]]
            layers[name] = LowRank(A=d[:, None] * A, B=b[:, None] * B)
        else:
            layers[name] = LowRank(A=file_tensor(ad, f"{name}.lora_A", path),
                                   B=file_tensor(ad, f"{name}.lora_B", path))
    return layers, (1.0 if method == "vera" else lora_scale(ad["hparams"]))


def adapter_from_file(name, path, base_sha256, in_features):
    """One adapter file (lora.py --save) -> Adapter, or one UserError line: missing or not an
    adapter file (core/adapter_file.py's reader, lora.py's too), trained on another base, a
    method that is not a low-rank add."""
    # missing file, not an adapter file, wrong version, unknown settings -> its UserError
    ad = read_adapter(path)
    # The base first, as lora.load_adapter: ΔW learnt on another W0 fits the shapes and is noise.
    theirs = ad["base"]["sha256"]
    if theirs != base_sha256:
        raise UserError(f"adapter {name!r} ({path}) was trained on another base model (weights "
                        f"sha256 {theirs[:12]}…, the served base {base_sha256[:12]}…)")
    method = ad["method"]
    if method in REFUSED or method not in LOW_RANK_METHODS:
        reason = REFUSED.get(method, "not a low-rank adapter")
        raise UserError(f"adapter {name!r} ({path}) is {method}: {reason}")
    layers, scale = pairs_of(ad, path, in_features)
    return Adapter(name=name, method=method, rank=int(ad["hparams"]["rank"]), scale=scale,
                   layers=layers, source=path)


def parse_pairs(specs):
    """['NAME=PATH', ...] (the flag's form; vLLM's --lora-modules name=path) -> [(name,
    path)]; a (name, path) pair passes as it is."""
    out = []
    # partition on the FIRST '=': a path may hold '=', a name may not (AdapterSet refuses it)
    for spec in specs:
        if isinstance(spec, (tuple, list)) and len(spec) == 2:
            out.append((str(spec[0]), str(spec[1])))
            continue
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UserError(f"adapter {spec!r}: write NAME=PATH (e.g. math=out/lora/math.pt)")
        out.append((name.strip(), path.strip()))
    return out


# ----------------------------------------------------------------------------------------
# The set: every adapter stacked per layer

class AdapterSet:
    """The loaded adapters of one served model. Slot 0 is the base (`base_name`), adapter
    i is slot i+1 in the order given. Per adapted layer (the union of all targets) the
    stacks A_all (n+1, r_max, in), B_all (n+1, out, r_max) and scale (n+1,): zero where an
    adapter does not touch that layer, zero-padded where its rank is below r_max."""

    def __init__(self, model, adapters, base_name=BASE_NAME):
        self.base_name, self.adapters = base_name, list(adapters)
        # names[slot]: the base is slot 0 so that an engine's default (zeros) is "no adapter";
        # '=' is refused because NAME=PATH could not write such a name back.
        self.names = [base_name] + [a.name for a in self.adapters]
        seen = set()
        for n in self.names:
            if not n or "=" in n or n in seen:
                raise UserError(f"adapter name {n!r} is empty, holds '=' or is given twice "
                                f"(the base model is {base_name!r})")
            seen.add(n)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        for a in self.adapters:
            check_fits(a, linears)
        # layers in the model's own order: attach and the report walk them the same way
        wanted = {layer for a in self.adapters for layer in a.layers}
        self.layers = [n for n in linears if n in wanted]
        # the stacks live where the base does, in its dtype (the rows' x meets both)
        weight = next(iter(linears.values())).weight
        self.device = weight.device
        self.stacks = {n: self.stack(n, linears[n], weight.dtype, weight.device)
                       for n in self.layers}

    @classmethod
    def from_files(cls, model, specs, base_name=BASE_NAME):
        """specs: ['NAME=PATH', ...], each a lora.py --save file, checked against this base
        by the weights' fingerprint (hashed once for all the files)."""
        pairs = parse_pairs(specs)
        sha = base_fingerprint(model)
        widths = {n: m.in_features for n, m in model.named_modules()
                  if isinstance(m, nn.Linear)}
        return cls(model, [adapter_from_file(n, p, sha, widths) for n, p in pairs],
                   base_name)

    def stack(self, layer, linear, dtype, device):
        """The stacks of one layer, padded to the largest rank that touches it."""
        here = [(i + 1, a) for i, a in enumerate(self.adapters) if layer in a.layers]
        # r_max per LAYER, not global: a rank-64 adapter on wq alone pads only the wq stacks
        r_max = max(a.rank for _, a in here)
        n = len(self.names)
        A = torch.zeros(n, r_max, linear.in_features, dtype=dtype, device=device)
        B = torch.zeros(n, linear.out_features, r_max, dtype=dtype, device=device)
        # Slot 0 (the base) and the slots of adapters that skip this layer stay all-zero, scale
        # 0: their rows compute exact zeros here (the price of one uniform gather for all).
        scale = torch.zeros(n, dtype=dtype, device=device)
        for slot, a in here:
            pair, r = a.layers[layer], a.rank
            # rows r..r_max of A and columns of B stay 0: x·Aᵀ is 0 there and meets B's 0s
            A[slot, :r] = pair.A.to(device, dtype)
            B[slot, :, :r] = pair.B.to(device, dtype)
            scale[slot] = a.scale
        return dict(A=A, B=B, scale=scale)

    def index(self, name):
        """The slot a request's `model` field selects; one UserError line if unknown."""
        if name not in self.names:
            raise UserError(f"unknown model or adapter {name!r}: served are "
                            f"{', '.join(map(repr, self.names))}")
        return self.names.index(name)

    def stacked_bytes(self):
        """Bytes the stacks hold per slot (each padded to its layers' r_max)."""
        return sum(s["A"][0].numel() * s["A"].element_size() + s["B"][0].numel() *
                   s["B"].element_size() for s in self.stacks.values())

    def memory_report(self, model=None):
        """One line per adapter: its own bytes, and what its slot in the stack costs."""
        slot = self.stacked_bytes()
        whole = sum(p.numel() * p.element_size() for p in model.parameters()) if model else 0
        lines = []
        for a in self.adapters:
            share = f", {a.nbytes / whole:.1%} of the base model" if whole else ""
            lines.append(f"  {a.name:<10} {a.method:<8} r={a.rank:<3} {len(a.layers):>3} layers "
                         f"| own {fmt_bytes(a.nbytes)}{share} | slot in the stack "
                         f"{fmt_bytes(slot)} (padded to each layer's r_max)")
        return lines


def check_fits(adapter, linears):
    """Every target a plain nn.Linear of this model, A and B of its shape, no MoE expert."""
    for layer, pair in adapter.layers.items():
        if layer not in linears:
            raise UserError(f"adapter {adapter.name!r}: the served model has no linear layer "
                            f"{layer!r} (another architecture?)")
        if ".experts." in layer:
            raise UserError(f"adapter {adapter.name!r} adapts the MoE expert {layer!r}: an "
                            f"expert sees only the rows routed to it, which the per-row "
                            f"adapter indices do not follow")
        # the file's shapes against the served model's: the fingerprint already says "same
        # base" for files, but an adapter built in memory (or a hand-edited file) has none
        m = linears[layer]
        r = adapter.rank                 # the stacks are sized by it: every layer must agree
        if pair.A.shape != (r, m.in_features) or pair.B.shape != (m.out_features, r):
            raise UserError(f"adapter {adapter.name!r}: {layer} has A {tuple(pair.A.shape)}, "
                            f"B {tuple(pair.B.shape)}; rank {r} on this {m.out_features}×"
                            f"{m.in_features} layer needs A ({r}, {m.in_features}), B "
                            f"({m.out_features}, {r})")


# ----------------------------------------------------------------------------------------
# The per-batch indices and the wrapped linear

class AdapterBatch:
    """The one object through which the engine tells every wrapped layer which adapter
    each row of the coming forward uses. attach() creates it and gives it to every
    MultiLoRALinear at construction; nothing else carries the indices.

    The seam: call `set_rows(indices, logits_at=None)` before each forward, with
      - (B,) one adapter slot per sequence of a (B, T) batch (model.generate, static
        batching): broadcast over T, so prefill and decode steps reuse it; or
      - indices shaped like the token ids, (B, T) -- serve.py's engine packs a step's
        tokens into ONE (1, T) row, so its indices are (1, T), each sequence's slot
        repeated over its tokens;
      - logits_at: the forward's logits_at (the engine's picks), when an adapter targets
        the output head -- the head then sees only those positions.
    Slots come from AdapterSet.index(name) (0 = the base model)."""

    def __init__(self, adapter_set):
        self.adapter_set = adapter_set
        self.rows, self.head_rows = None, None

    def set_rows(self, indices, logits_at=None):
        # long on the stacks' device: the gather indexes them, and a CPU index into CUDA
        # stacks would copy it once per layer instead of once per step
        rows = torch.as_tensor(indices, dtype=torch.long, device=self.adapter_set.device)
        if rows.dim() not in (1, 2) or rows.numel() == 0:
            raise ValueError(f"set_rows: indices must be (B,) or (B, T), got {tuple(rows.shape)}")
        lo, hi = int(rows.min()), int(rows.max())      # one sync per step, not per layer
        if lo < 0 or hi >= len(self.adapter_set.names):
            raise ValueError(f"set_rows: slots must be in [0, {len(self.adapter_set.names)}), "
                             f"got {lo}..{hi}")
        # GPT.forward runs the head on h[:, logits_at] only, so the head's rows are the same
        # columns of the per-token indices; per-sequence (B,) indices need no cut
        self.rows = rows
        self.head_rows = rows if logits_at is None or rows.dim() == 1 else rows[:, logits_at]

    def rows_for(self, x, at_logits, layer):
        """-> (slots (G,), x viewed as (G, t, in)): G groups of t rows sharing one adapter.
        Per-sequence slots: G = B, t = T (one gather per sequence); per-token: t = 1."""
        rows = self.head_rows if at_logits else self.rows
        if rows is None:
            raise RuntimeError("AdapterBatch.set_rows was not called before the forward")
        lead = tuple(x.shape[:-1])
        # (B,) against x (B, T, in): one slot per sequence, so the gather copies B matrices,
        # not B·T -- the padded-batch case (generate, static batching) gets that for free
        if rows.dim() == 1 and len(lead) >= 1 and lead[0] == rows.shape[0]:
            return rows, x.reshape(rows.shape[0], -1, x.shape[-1])
        # per token (the engine's packed row): every token its own group of one, BGMV proper
        if tuple(rows.shape) == lead:
            return rows.reshape(-1), x.reshape(-1, 1, x.shape[-1])
        # anything else is a layer that sees other rows than the batch (MoE experts) or an
        # engine that set indices for another forward: refused loudly, never guessed
        raise ValueError(f"{layer}: the batch's adapter indices are {tuple(rows.shape)} but "
                         f"this layer sees rows {lead}")


class MultiLoRALinear(nn.Module):
    """An nn.Linear plus the side path of every loaded adapter, chosen per row:
    y = x W0ᵀ (+ b) + scale[a] · (x A_all[a]ᵀ) B_all[a]ᵀ. `.weight` (and `.bias`) ARE the
    wrapped linear's Parameters: the base stays shared, and the state_dict keeps the
    plain names (the stacks are non-persistent buffers), so the model's checkpoint and
    its base fingerprint do not change while adapters are attached."""

    def __init__(self, linear, stacks, batch, name, at_logits=False, kernel="gather"):
        super().__init__()
        if kernel not in KERNELS:
            raise UserError(f"unknown kernel {kernel!r}: use {' or '.join(KERNELS)}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # buffers: .to() moves them with the model; not persistent: not in the checkpoint
        for key in ("A", "B", "scale"):
            self.register_buffer(f"{key}_all" if key != "scale" else key, stacks[key],
                                 persistent=False)
        self.batch, self.name, self.at_logits, self.kernel = batch, name, at_logits, kernel

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)        # ONE dense matmul for every row
        # gather: the side path for every row, base rows included (slot 0 adds exact zeros):
        # no data-dependent branch, the step's shapes never depend on which adapters came
        # (what CUDA graphs need). segment: only the adapters present, at a host sync.
        slots, xg = self.batch.rows_for(x, self.at_logits, self.name)
        delta = self.gather(slots, xg) if self.kernel == "gather" else self.segment(slots, xg)
        return y + delta.view(y.shape)

    def gather(self, slots, xg):
        """BGMV: each group's A and B gathered from the stacks (a copy of G·r·(in+out)
        numbers), then two batched products: (G, t, in)·(G, in, r) -> (G, t, r), scaled,
        ·(G, r, out) -> (G, t, out)."""
        # A_all[slots] is the copy a fused kernel avoids: (G, r, in) written, then read by bmm
        h = torch.bmm(xg, self.A_all[slots].transpose(1, 2))
        # the scale on the r-wide intermediate, not the out-wide result: r ≪ out multiplies
        h = h * self.scale[slots][:, None, None]
        return torch.bmm(h, self.B_all[slots].transpose(1, 2))

    def segment(self, slots, xg):
        """SGMV-like: the rows of each adapter present together, one pair of thin matmuls
        per adapter (no copy of the weights); base rows (slot 0) are skipped."""
        out = xg.new_zeros(xg.shape[0], xg.shape[1], self.out_features)
        for a in slots.unique().tolist():             # host sync: which adapters are here
            if a == 0:
                continue
            # the rows of adapter a (a segment; Punica's SGMV gets them contiguous by
            # sorting, here an index list), computed at a's padded rank straight from the stack
            pick = (slots == a).nonzero().squeeze(1)
            h = F.linear(xg[pick], self.A_all[a]) * self.scale[a]
            out[pick] = F.linear(h, self.B_all[a])
        return out

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, slots={self.A_all.shape[0]}, "
                f"r_max={self.A_all.shape[1]}, kernel={self.kernel}")


def attach(model, adapter_set, kernel="gather"):
    """Swap every adapted nn.Linear of `model` for a MultiLoRALinear, in place. -> the
    AdapterBatch every wrapper reads its row indices from (call set_rows on it). The
    stacks are where the AdapterSet built them (the base's device then): attach after
    moving the model, not before."""
    if any(isinstance(m, MultiLoRALinear) for m in model.modules()):
        raise UserError("this model already carries multi-LoRA layers: detach() first")
    # ONE batch object for all the wrappers: the engine sets the rows once per step and
    # every layer reads the same indices -- passed in, never looked up or stored on weights
    batch = AdapterBatch(adapter_set)
    for name in adapter_set.layers:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise UserError(f"{name} is not a plain nn.Linear here (merged or adapted "
                            f"already?)")
        # the head alone is cut to logits_at's positions by GPT.forward
        new = MultiLoRALinear(linear, adapter_set.stacks[name], batch, name,
                              at_logits=name == "output", kernel=kernel)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return batch


def detach(model):
    """Every MultiLoRALinear back to a plain nn.Linear holding the same Parameters."""
    for name, m in list(model.named_modules()):
        if isinstance(m, MultiLoRALinear):
            # built on "meta": no memory for weights that are replaced at once
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                              device="meta")
            plain.weight = m.weight
            if m.bias is not None:
                plain.bias = m.bias
            # the same Parameter objects: an optimizer or a tied embedding holding them
            # still holds the model's weights
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)
    return model


# ----------------------------------------------------------------------------------------
# The measurement: per-token forward cost of base, merged, and k adapters mixed

def random_adapter(model, name, rank, targets, seed, alpha=16.0):
    """An adapter as training would leave it (B ≠ 0), in memory: the bench needs its cost,
    not its quality. A as lora.py inits it (U(±1/√in)), B small random."""
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets:
            bound = 1 / math.sqrt(m.in_features)
            A = (torch.rand(rank, m.in_features, generator=gen) * 2 - 1) * bound
            layers[n] = LowRank(A=A, B=torch.randn(m.out_features, rank, generator=gen) * 0.01)
    if not layers:
        raise UserError(f"--targets {','.join(targets)} names no linear layer of the model")
    return Adapter(name=name, method="lora", rank=rank, scale=alpha / rank, layers=layers)


@torch.no_grad()
def merged_copy(model, adapter):
    """A copy of `model` with W0 + s·B A in every adapted layer (merging: the adapter free
    at inference, the copy serving it alone)."""
    # a deep copy: the point of merging is a second full model for a second adapter
    out = copy.deepcopy(model)
    for layer, pair in adapter.layers.items():
        w = out.get_submodule(layer).weight
        w += adapter.scale * (pair.B @ pair.A).to(w)
    return out


def parse_shapes(text):
    """'64x1,8x32' -> [(64, 1), (8, 32)]: rows × tokens per forward."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise UserError(f"--shapes {text!r}: write ROWSxTOKENS,... e.g. 64x1,8x32")
    return shapes


def int_list(text, flag):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: write positive integers, e.g. 1,4,16")
    return values


def time_variants(variants, repeats):
    """{label: [seconds per repeat]}: the variants interleaved, one call each per round,
    so a burst of load hits all of them alike (the ratios are what we report)."""
    for fn in variants.values():
        fn()                                          # warm-up: allocator, first-call costs
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for label, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    return times


def build_variants(model, args, rows, tokens):
    """The forwards to time for one batch shape: base, one adapter merged, and for each k
    in --adapters and each kernel the base + k adapters, rows assigned round-robin."""
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (rows, tokens), generator=torch.Generator()
                        .manual_seed(args.seed))
    targets = args.targets.split(",")
    ranks = int_list(args.ranks, "--ranks")
    # the largest k's adapters, built once; smaller k take a prefix (same adapters)
    pool = [random_adapter(model, f"a{i}", ranks[i % len(ranks)], targets, args.seed + i)
            for i in range(max(int_list(args.adapters, "--adapters")))]
    merged = merged_copy(model, pool[0])
    variants = {"base": lambda: model(idx), "merged (1 adapter)": lambda: merged(idx)}
    served = {}
    for k in int_list(args.adapters, "--adapters"):
        for kernel in KERNELS:
            # a copy per variant: the base weights are copied too, but each variant keeps
            # its own wrappers and batch object while the timed loop interleaves them
            m = copy.deepcopy(model)
            aset = AdapterSet(m, pool[:k])
            batch = attach(m, aset, kernel)
            slots = torch.arange(rows) % k + 1                 # every row an adapter, k mixed
            variants[f"{kernel} k={k}"] = (lambda m=m, b=batch, s=slots:
                                           (b.set_rows(s), m(idx)))
            served[k] = aset
    return variants, served, pool


def report_shape(model, args, rows, tokens):
    variants, served, pool = build_variants(model, args, rows, tokens)
    with TimingConditions() as conditions:
        with torch.no_grad():
            times = time_variants(variants, args.repeats)
    # medians: robust to the odd scheduler hiccup; ratios against base from the same rounds
    t = {k: statistics.median(v) for k, v in times.items()}
    n = rows * tokens
    print(f"\n{rows} rows × {tokens} tokens per forward ({n} tokens), median of "
          f"{args.repeats}; ratio to the base model measured in this run:")
    for label in variants:
        print(f"  {label:<20} {t[label] / n * 1e6:9.1f} µs/token  {t[label] / t['base']:6.2f}x")
    # The bytes the torch gather copies (per-sequence slots: one gather per row of B), vs
    # the distinct adapters' weights that a fused kernel would read once per segment.
    k = max(served)
    slot = served[k].stacked_bytes()
    groups = rows                         # per-sequence slots: one gather per row
    print(f"  gather copy per forward at k={k}: {fmt_bytes(groups * slot)} ({groups} gathers "
          f"of a {fmt_bytes(slot)} slot) vs {fmt_bytes(sum(a.nbytes for a in pool[:k]))} of "
          f"the k adapters' own weights, what a fused BGMV/SGMV kernel reads; base weights "
          f"{fmt_bytes(sum(p.numel() * p.element_size() for p in model.parameters()))}")
    conditions.report(times)
    return served[k]


KNOBS = [
    knob("--preset", "small", "model size (random weights: the cost does not depend on them)"),
    knob("--adapters", "1,4,16", "k: adapters mixed in one batch (each k timed)"),
    knob("--ranks", "8,16", "adapter ranks, cycled over the adapters (mixed ranks are padded "
                            "to the largest)"),
    knob("--targets", "wq,wk,wv,wo,w1,w2,w3", "adapted linears (as lora.py: every block "
                                               "linear)"),
    knob("--shapes", "64x1,8x32", "batches as ROWSxTOKENS: 64x1 a decode step of 64 sequences, "
                                  "8x32 a prefill"),
    knob("--repeats", 20, "timed forwards per variant"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--seed", 0, "model, adapters and tokens"),
]


def main(argv=None):
    p = command_line("Many LoRA adapters in one batch (S-LoRA / Punica BGMV): per-token "
                     "forward cost of base, merged and k adapters mixed, and the memory per "
                     "adapter.", {None: KNOBS}, prog="python -m serving.multi_lora")
    args = p.parse_args(argv)
    require_at_least_one(args, ["repeats", "threads"])
    torch.set_num_threads(args.threads)
    # random weights: the cost of a forward does not depend on their values, and the
    # measurement needs no trained checkpoint
    model = GPT(get_config(args.preset), seed=args.seed).eval()
    print(f"{args.preset} model: {model.num_params():,} params, random weights; adapters on "
          f"{args.targets}, ranks {args.ranks}")
    aset = None
    for rows, tokens in parse_shapes(args.shapes):
        aset = report_shape(model, args, rows, tokens)
    print(f"\nmemory per adapter ({len(aset.adapters)} loaded; fp32), one line per rank:")
    lines = aset.memory_report(model)
    for rank in sorted({a.rank for a in aset.adapters}):   # the same line for equal ranks
        print(lines[next(i for i, a in enumerate(aset.adapters) if a.rank == rank)])
    # Padding's price: a slot is sized by the largest rank of each layer, whatever its own.
    slot, small = aset.stacked_bytes(), min(aset.adapters, key=lambda a: a.rank)
    print(f"  rank padding: a rank-{small.rank} adapter's slot holds {slot / small.nbytes:.1f}x "
          f"its own bytes, and each of its rows computes at r_max (a stack per rank would not)")
    print("merged: the base's cost, one adapter per model copy; gather/segment: every adapter "
          "in one batch, the side path paid per row (a fused kernel removes the gather copy).")


if __name__ == "__main__":
    run_cli(main)
