"""
train.py -- training the shared GPT, and where the memory of a training step goes.

Run:  python train.py                       # the demo: `small` on the built-in corpus
      python train.py --preset tiny --steps 50 --precision fp16 --checkpointing full
      python train.py --resume              # continue from out/ckpt.pt
      torchrun --standalone --nproc_per_node=4 train.py --dp zero2   # data parallel
      python -m scripts.train_bench         # the trade-off rows: what each technique costs
      python -m scripts.train_bench --estimate --params 7B --gpus 64   # the formulas, any size

What a training step holds in memory, per parameter (Ψ = parameter count):
  fp32:             params 4 + grads 4 + Adam m, v 4 + 4                 = 16 B/param
  mixed precision:  bf16/fp16 params 2 + grads 2 + fp32 master weights 4
                    + Adam m, v 4 + 4                                    = 16 B/param
  So mixed precision alone saves NO model-state memory (it even keeps a second copy of
  the weights). What it buys: 2-byte activations and, on GPUs, 2-16× faster matmuls. The
  model state is only reduced by sharding it (ZeRO: training/data_parallel.py, `--dp`).
  Activations per layer (Korthikanti et al. 2022, 16-bit, no recompute):
      s·b·h·(34 + 5·a·s/h) bytes     (s seq, b batch, h hidden, a heads)
  -- linear in the batch, quadratic in the sequence through the attention scores.

Techniques here and their price:
  - mixed precision: bf16 autocast (fp32 weights, bf16 matmuls), or the classic recipe
    written by hand: weights in bf16/fp16 + fp32 master copy; fp16 also needs dynamic loss
    scaling (Micikevicius et al. 2018) because small gradients underflow fp16. Costs: an
    extra fp32 copy (4 B/param), rounding error, skipped steps on overflow.
  - activation checkpointing (Chen et al. 2016): keep only each block's input and recompute
    the block in backward (full: ≈ +1 forward, ~+33% step time, activations ÷ ~L·const),
    or recompute only the cheap-but-big parts -- attention scores and the SwiGLU product --
    (selective, Korthikanti et al. 2022: removes the 5·a·s/h term for a few % of time).
  - gradient accumulation: k micro-batches of b instead of one of k·b: activations ÷ k,
    same update (tested), but k sequential forward/backward passes.
  - FP8 linear layers (training/fp8.py, `--precision fp8 | fp8-block`): the blocks'
    matmuls on e4m3/e5m2 copies scaled per tensor (torchtitan's float8) or per 1×B tile
    and B×B block (DeepSeek-V3), the fp32 master weights kept. Saves, on fp8 tensor
    cores, matmul time and half the linears' saved inputs; adds a cast (and an amax) per
    tensor per step and 1 B/param of fp8 weight copies; costs ~4% error per matmul.

Faults, each ending in one line that says what happened (docs/train.md, "Faults"): every
save records its run (run_id, torchrun's launch_id, save_id in every shard); --resume takes
the newest readable of --keep generations and refuses model flags that contradict the
checkpoint; a torchrun restart resumes only its own launch's saves; Ctrl-C / SIGTERM
finish the step, save and exit 130 / 143; --timeout bounds a collective waiting for a
frozen rank (core/runtime.py); the output folder is checked before step 1.
"""
import math
import os
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from core import data
from training import data_parallel, fp8
from core import scores
import optim
from training import resume as saved
from training.qk_clip import QKClip
from core.plots import svg_line_plot
from model import GPT, GPTConfig, PRESETS, get_config
from core.cli import (command_line, fmt_bytes, fmt_count, fmt_duration, given, knob,
                      preset_knob, require_at_least_one)
from core.distributed import (inject_fault, long_phase, set_collective_timeout, setup_runtime,
                              STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_STEPS, tighten_after_first_step)
from core.errors import Interrupted, UserError
from core.files import check_writable
from core.meters import ActivationMeter, comm, gpu_peak_flops, StepTimer
from core.recipe import warmup_cosine
from core.runtime import (attempt, GracefulStop, print0, run_cli, seed_everything,
                          TimingConditions)

# The two 16-bit formats. bf16 keeps fp32's 8 exponent bits (range to ~3e38) with only 8
# significant bits; fp16 has 5 exponent bits (max 65504, smallest subnormal ~6e-8) and 11
# significant bits: more precision, far less range -- hence fp16's loss scaling below.
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_RECIPES = {"fp8": "tensorwise", "fp8-block": "block"}   # --precision -> training/fp8.py


# ----------------------------------------------------------------------------------------
# Activation checkpointing, by hand

class Checkpoint(torch.autograd.Function):
    """Run fn without recording the graph; keep only its tensor inputs. In backward, run fn
    again with the graph on and backpropagate through that fresh graph. Memory: the inputs
    instead of every intermediate. Time: one extra forward of fn. (This is torch's
    "reentrant" checkpoint; parameters inside fn receive their gradients from the inner
    backward call.)"""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn                       # a callable: kept on ctx, not saved as a tensor
        # Block.run passes (x, cos, sin, mask, cache, layer): mask and cache may be None,
        # layer is an int. Non-tensors are kept as they are; tensors go through
        # save_for_backward, which checks at backward that nobody modified them in place
        # (version counter) and passes them through saved_tensors_hooks -- which is how
        # meters.ActivationMeter sees the block input as the block's only activation.
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a, t in zip(args, ctx.is_tensor) if t])
        device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        # the recomputation must see the same autocast setting as the first computation
        ctx.autocast = (device, torch.is_autocast_enabled(device),
                        torch.get_autocast_dtype(device))
        # no_grad: nothing inside fn is recorded, so each intermediate is freed once used.
        # Traps of running fn graph-free: (1) no RNG state is saved for the replay (as
        # torch.utils.checkpoint's preserve_rng_state does): fine while this GPT has no
        # dropout, but a hand-added dropout would drop other units in the recomputation;
        # (2) side outputs fn leaves for the loss are graph-free too: an MoE block's
        # aux_loss, read by GPT.loss after the forward, carries no gradient under
        # --checkpointing full (the recomputed one in backward is never backpropagated).
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_out):
        # Fresh leaves: detach() cuts the link to the outer graph (the engine that called
        # us owns it); requires_grad_ makes the inner backward put d(out)/d(input) in .grad.
        saved = iter(ctx.saved_tensors)
        args = [next(saved).detach().requires_grad_(True) if t else a
                for a, t in zip(ctx.others, ctx.is_tensor)]
        # The backward engine runs outside any autocast region: re-enter the forward's, or a
        # bf16 forward would be recomputed in fp32 and its graph would not be the one the
        # loss came from (tests/test_train.py, test_checkpointing_replays_autocast).
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.fn(*args)
        # A nested backward: the parameters inside fn get their gradients accumulated into
        # .grad right here (so DDP's per-parameter hooks fire inside it), the inputs into
        # args[i].grad. fn must return ONE tensor: there is one grad_out.
        torch.autograd.backward(out, grad_out)
        # One gradient per forward input: None for fn and the non-tensors. cos and sin get
        # one too, which autograd drops (they do not require a gradient).
        return (None,) + tuple(a.grad if t else None for a, t in zip(args, ctx.is_tensor))


def checkpointed(fn):
    """fn, but every call goes through Checkpoint: selective mode wraps the attention core
    and the SwiGLU product with it, keeping their inputs instead of their outputs."""
    return lambda *args: Checkpoint.apply(fn, *args)


def apply_activation_checkpointing(model, mode):
    """full: each block keeps only its input. selective: keep the matmul outputs, recompute
    the attention core (scores, softmax, weighted sum) and the SwiGLU product."""
    for block in model.layers:
        if mode == "full":
            # Block.forward calls run(self.compute, x, cos, sin, ...): per layer only x
            # (b·s·h values) stays; backward re-runs the block first -- one extra forward,
            # ~+33% step time (a step is ~3 forwards' worth: forward 1, backward 2).
            block.run = Checkpoint.apply                  # model.Block's documented seam
        elif mode == "selective":
            # Only what is big and cheap to redo (Korthikanti et al. 2022, "selective
            # activation recomputation"): math attention's (b, a, s, s) scores and softmax,
            # the 5·a·s/h term, and SwiGLU's silu(gate)·up. Matmul outputs stay saved:
            # recomputing them would cost the FLOPs that dominate the step. With sdpa the
            # fused kernel keeps no s×s matrix anyway, so the gain is mostly SwiGLU's.
            block.attention.attn_fn = checkpointed(block.attention.attn_fn)
            # MoE: each routed expert is its own FeedForward. The shared experts
            # (feed_forward.shared_experts) are not in this list and keep their product.
            ffns = getattr(block.feed_forward, "experts", [block.feed_forward])
            for ffn in ffns:
                ffn.act_fn = checkpointed(ffn.act_fn)
        elif mode != "none":
            raise UserError(f"unknown checkpointing mode {mode!r}: none, selective or full")


# ----------------------------------------------------------------------------------------
# Mixed precision with master weights and dynamic loss scaling, by hand

class LossScaler:
    """fp16 has 5 exponent bits: gradients below ~6e-8 become 0. Multiply the loss by S
    (so every gradient is S× larger), divide the gradients by S before the update.
    Dynamic: if any gradient is inf/NaN the scale was too big -> skip the step, halve S;
    after `growth_interval` clean steps, try S·2. (Micikevicius et al. 2018)"""

    def __init__(self, init_scale=2.0 ** 16, growth_interval=1000, enabled=True):
        # 2^16 is torch.amp.GradScaler's initial scale too (its growth interval: 2000).
        self.scale, self.growth_interval, self.enabled = init_scale, growth_interval, enabled
        self.clean_steps, self.skipped = 0, 0

    def update(self, found_inf):
        if found_inf:
            # Overflow: train_step skips this update. Halving finds the largest scale that
            # does not overflow within a few steps (2^16 -> 2^12 takes four skips).
            self.scale /= 2
            self.clean_steps = 0
            self.skipped += 1
        else:
            # Probe upward now and then: gradients shrink as training goes on, and a scale
            # left small since an early overflow would let them underflow again.
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self):
        # Saved with the checkpoint: a resumed fp16 run goes on with the same scale, so it
        # skips the same steps and its losses equal the uninterrupted run's (tested).
        return dict(scale=self.scale, clean_steps=self.clean_steps, skipped=self.skipped)

    def load_state_dict(self, s):
        self.scale, self.clean_steps, self.skipped = s["scale"], s["clean_steps"], s["skipped"]


class MasterWeights:
    """The model holds bf16/fp16 weights (forward/backward run in low precision); the
    optimizer steps fp32 copies of them, because an update of size lr·g ≪ w vanishes when
    rounded to 8 (bf16) or 11 (fp16) significant bits."""

    def __init__(self, model, dtype):
        # only what trains: a frozen parameter needs no fp32 copy
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # the master copy is taken BEFORE rounding the model's weights (a resumed run must
        # continue from the saved fp32 values, not from their fp16 rounding)
        self.params = [p.detach().float().clone().requires_grad_(True)
                       for p in self.model_params]
        # A .data swap keeps the same Parameter objects (optimizer lists, hooks and
        # named_parameters still point at them), now on 16-bit storage. Weights: 2 B/param
        # here + 4 in the masters = 6 instead of 4; grads 2 instead of 4: still 16 B/param
        # with Adam, the header's "mixed precision saves no model-state memory".
        for p in self.model_params:       # weights only: the RoPE tables stay fp32
            p.data = p.data.to(dtype)

    def grads_to_master(self, inv_scale):
        """fp32 copies of the gradients, unscaled; returns True if any is inf/NaN."""
        found_inf = False
        for mp, p in zip(self.params, self.model_params):
            # Unscale AFTER the cast: g·(1/S) computed in fp16 would flush the small values
            # back to zero, which is what scaling the loss was for.
            g = p.grad.float() * inv_scale
            # bool() waits for the device once per parameter: simple; torch's GradScaler
            # keeps the flag on the device (torch._amp_foreach_non_finite_check_and_unscale_).
            found_inf |= not bool(torch.isfinite(g).all())
            mp.grad = g
        return found_inf

    @torch.no_grad()
    def master_to_model(self):
        for mp, p in zip(self.params, self.model_params):
            # copy_ rounds to the model's dtype (to nearest): an update too small to change
            # the 16-bit weight still accumulates in mp and shows up once it is big enough.
            p.copy_(mp)
            mp.grad = None      # the fp32 gradient copy lives only during the step


# ----------------------------------------------------------------------------------------
# The schedule, the step, the evaluation

def learning_rate(step, args):
    """Linear warmup then cosine decay to min_lr (GPT-3 / Chinchilla recipe)."""
    return warmup_cosine(step, args.steps, args.warmup_steps, args.lr, args.min_lr)


def autocast_ctx(args, device):
    """--precision autocast-bf16: fp32 weights, matmuls in bf16 (the model casts RMSNorm,
    the math path's softmax and the cross-entropy to fp32 itself, model.py). Any other
    precision: a disabled context, so callers need no branch. bf16 needs no loss scale:
    its range is fp32's."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                          enabled=args.precision == "autocast-bf16")


def trained_params(model, master):
    """What the optimizer steps: the fp32 master copies in mixed precision, else the
    model's own trainable parameters."""
    return master.params if master else [p for p in model.parameters() if p.requires_grad]


class ExpertLoads:
    """Tokens per expert in one optimizer step, from each forward's MoE.load: loss-free
    balancing's input (DeepSeek-V3: after every step b_i += γ·sign(mean − load_i), see
    moe.Router) and the imbalance the log prints: max/mean tokens per expert, averaged
    over the layers (1.0 = even; top-k of E experts on one expert = E/k, the worst)."""

    def __init__(self):
        self.step = None            # (n_layer, n_expert), summed over the micro-batches
        self.imbalance = None       # of the last step

    def observe(self, model):
        loads = model.expert_loads()
        self.step = loads if self.step is None else self.step + loads

    def after_step(self, model, skipped):
        loads, self.step = self.step, None
        if skipped:                 # fp16 overflow: no update, so no bias step either
            return
        # Each rank routed different tokens: SUM the (n_layer, n_expert) counts. A
        # collective, so every rank reaches it in the same step (skips agree: found_inf
        # is never set under --dp, which refuses fp16).
        if torch.distributed.is_initialized():    # every rank's bias must stay identical
            comm.all_reduce(loads)
        if model.config.moe_balance == "loss_free":
            model.update_expert_bias(loads)
        # per layer max/mean over the experts, then the mean over the layers
        self.imbalance = float((loads.max(1).values / loads.mean(1)).mean())


@dataclass
class Trainer:
    """What one optimizer step works on: the model and its optimizer, and what each memory
    technique adds. Only the first two are needed; the rest default to "off"."""
    model: GPT
    optimizer: torch.optim.Optimizer
    scaler: Optional[LossScaler] = None      # fp16's dynamic loss scale
    master: Optional[MasterWeights] = None   # fp32 copies of the weights (bf16 / fp16 only)
    # who holds the gradients: data_parallel.OneProcess (None: made here, the world of one:
    # the same interface, no communication), or a --dp wrapper that communicates them
    # (during backward and in finish_grads) and, for ZeRO-1/2, the updated parameters
    sync: object = None
    qk_clip: Optional[QKClip] = None   # MuonClip's recorders and clip (--qk-clip)
    expert_loads: Optional[ExpertLoads] = None   # MoE: tokens per expert, loss-free bias

    def __post_init__(self):
        if self.sync is None:
            self.sync = data_parallel.OneProcess(self.model,
                                                 trained_params(self.model, self.master))
        if self.expert_loads is None and self.model.config.n_expert:
            self.expert_loads = ExpertLoads()    # a loss-free bias moves whoever trains


def train_step(trainer, batches, args, device):
    """One optimizer step of a Trainer over len(batches) micro-batches (gradient
    accumulation: the loss of each is divided by their number, so the summed gradient is
    that of the mean loss); MuonClip (qk_clip) after the update, then the MoE loads'
    loss-free step (expert_loads). Returns (mean loss, activation bytes of one micro-batch,
    step skipped?)."""
    model, sync, scaler, master = trainer.model, trainer.sync, trainer.scaler, trainer.master
    # S: the fp16 loss scale, else 1 (fp32, bf16 and autocast need none)
    scale = scaler.scale if scaler is not None and scaler.enabled else 1.0
    total = 0.0
    act_bytes = 0
    for i, (x, y) in enumerate(batches):
        # DDP's no_sync(): the k-1 earlier micro-steps only accumulate into p.grad, so one
        # all-reduce per step instead of k (ZeRO-2/3 still reduce-scatter every micro-step)
        sync.set_sync(i == len(batches) - 1)      # communicate on the last micro-step only
        with ActivationMeter(model) as meter, autocast_ctx(args, device):
            _, loss = model(x, y)
        # what autograd saved for this micro-batch (read before backward frees it); the
        # max over equal-shaped micro-batches: what gradient accumulation divides by k
        act_bytes = max(act_bytes, meter.bytes)
        if trainer.expert_loads is not None:
            trainer.expert_loads.observe(model)
        # loss·S/k: S lifts fp16's small gradients above underflow; 1/k makes the k summed
        # gradients those of the mean over all k·b sequences, as one big batch would give
        # (tests/test_train.py, test_gradient_accumulation_equals_one_big_batch).
        (loss * (scale / len(batches))).backward()
        # .item() is a host-device sync per micro-batch: harmless here, a stall at scale
        total += loss.item() / len(batches)
    sync.finish_grads()                           # data parallel: the gradients averaged
    # Mixed precision: 16-bit grads -> fp32 masters, unscaled, checked for inf/NaN. fp32 and
    # autocast have no master copy and no check: an inf gradient there is not caught.
    found_inf = master.grads_to_master(1.0 / scale) if master is not None else False
    if scaler is not None and scaler.enabled:
        scaler.update(found_inf)                  # fp16: inf/NaN -> skip, halve the scale
    if found_inf:
        # Skip: drop the fp32 grads; the weights, Adam's moments and its step count stay
        # as they were (test_inf_gradient_skips_step_and_halves_scale). The schedule still
        # moves on: a skipped step spends its lr and its batch.
        for p in master.params:
            p.grad = None
    else:
        # Global-norm clipping (GPT-3: 1.0) of what the optimizer steps: the unscaled fp32
        # grads, or under ZeRO each rank's slice, whose squared norms add up (one scalar
        # all-reduce, data_parallel.clip_grad_norm). Clipping scaled grads would clip S× early.
        if args.grad_clip > 0:
            sync.clip_grads(args.grad_clip)
        trainer.optimizer.step()
        if master is not None:
            master.master_to_model()              # round the fp32 update into the model
        sync.after_step()                         # ZeRO-1/2: gather the updated slices
    # The fp32 masters are scaled with the model's W_q/W_k (the copies dict), or the next
    # master_to_model would write the unclipped weights back. It runs on a skipped step too:
    # the maxima came from forwards that did run.
    if trainer.qk_clip is not None:    # MuonClip, with the maxima this step's forwards recorded
        trainer.qk_clip.apply(dict(zip(master.model_params, master.params)) if master else None)
    if trainer.expert_loads is not None:    # loss-free balancing: an explicit step of its own
        trainer.expert_loads.after_step(model, skipped=bool(found_inf))
    return total, act_bytes, found_inf


def evaluate(model, corpus, args, device):
    """Mean cross-entropy over eval_iters fixed validation batches (the same batches every
    time): core/scores.py's validation_loss, the one definition every script shares."""
    return scores.validation_loss(model, corpus.val, args.batch_size, args.seq_len,
                                  args.eval_iters, args.seed + 1, device,
                                  autocast_ctx(args, device))


def micro_batches(corpus, args, step, device, rank=0):
    """A batch is a pure function of (seed, step, micro-step, rank): resuming at step k
    sees exactly the data the uninterrupted run saw."""
    # Batch index step·k + m, and the rank in the generator's seed (data.get_batch): a resume
    # must keep --grad-accum, --batch-size and the world size, or it draws other batches
    # (no error: just not the data the uninterrupted run would have seen).
    return [data.get_batch(corpus.train, args.batch_size, args.seq_len, args.seed,
                           step * args.grad_accum + m, rank=rank, device=device)
            for m in range(args.grad_accum)]


# ----------------------------------------------------------------------------------------
# The memory story, measured and next to the formulas

def model_state_report(state, n_params, precision, muon_params=0):
    """Measured bytes per rank vs the textbook formula for this run's dtypes. muon_params:
    the hidden matrices Muon steps (one momentum buffer: 4 B/param instead of Adam's 8)."""
    # Bytes per parameter of each kind. Adam's 8 = m and v, allocated like the tensor they
    # follow: the fp32 masters in mixed precision, so 8 whatever the model's dtype.
    if precision in LOW_PRECISION:
        formula = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
        label = f"{precision} params 2 + grads 2 + fp32 master 4 + Adam 8"
    else:
        formula = {"params": 4, "grads": 4, "master": 0, "optimizer": 8}
        label = "fp32 params 4 + grads 4 + Adam 8"
    want = {k: per * n_params for k, per in formula.items()}
    if muon_params:
        want["optimizer"] -= 4 * muon_params
        label += f", Muon 4 on {muon_params:,} hidden-matrix params"
    lines = [f"model state, Ψ = {n_params:,} parameters ({label}):"]
    # Exact equality is expected: state is measured from the tensors themselves
    # (meters.model_state_bytes), so "!=" means a buffer the formula does not know about.
    for key, per in formula.items():
        ok = "==" if state[key] == want[key] else "!="
        lines.append(f"  {key:<10} measured {state[key]:>12,} B  {ok} formula "
                     f"{want[key]:>12,} B")
    lines.append(f"  total      measured {fmt_bytes(state['total'] - state['opt_scalars'])}"
                 f" = {(state['total'] - state['opt_scalars']) / n_params:.2f} B/param"
                 f" (+{state['opt_scalars']} B of per-tensor Adam step counters)")
    return "\n".join(lines)


def activation_formula(seq, batch, hidden, heads, layers, bytes_per_value=2):
    """Korthikanti et al. 2022, eq. 2: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit (a
    GPT-3 block with dropout and a 4h MLP). Scaled by bytes_per_value/2 for fp32."""
    # 34·sbh: attention 11 (its input, Q, K, V, the output projection's input, a dropout
    # mask), MLP 19 (with a 4h GELU), two LayerNorm inputs 4; 5·a·s²·b: the scores'
    # softmax output, its dropout mask and the dropout output, per head -- the s² term.
    per_layer = seq * batch * hidden * (34 + 5 * heads * seq / hidden)
    return per_layer * layers * bytes_per_value / 2


# ----------------------------------------------------------------------------------------
# Building and the loop

@dataclass
class Run(Trainer):
    """What one training run holds: a Trainer (what a step works on) and where the run is.
    Built by build(), carried by the loop, saved by training/resume.py."""
    corpus: Optional[data.Corpus] = None
    step: int = 0                     # optimizer steps done = the data position
    history: dict = field(default_factory=lambda: {"loss": [], "val": []})   # saved too
    run_id: str = ""                  # one per training run, kept by every resume


def build_model(args, rt, resume):
    """The config (the checkpoint's when resuming), the corpus and the model on the device."""
    if resume:
        # the checkpoint's config wins; model flags that disagree with it were already
        # refused by resume.check_model_flags (inside find_resume)
        args.preset = resume["args"].get("preset") or "small"   # the banner names it
        cfg = GPTConfig(**resume["config"]).validate()
    else:
        args.preset = args.preset or "small"
        cfg = get_config(args.preset, **given(args, CONFIG_KNOBS))
    # The tokenizer is trained on the corpus (and cached) for this vocabulary size. A resume
    # needs the checkpoint's byte for byte: other merges and every id means another string.
    corpus = data.load_corpus(args.data, vocab_size=args.vocab_size or cfg.vocab_size)
    if resume and data.encoding_to_state(corpus.enc) != resume["tokenizer"]:
        raise UserError(f"the checkpoint was trained on another corpus/tokenizer "
                        f"({resume['corpus']}); pass the same --data and --vocab-size")
    # --vocab-size other than the preset's, or a corpus that ran out of pairs to merge
    # (data.train_bpe): the embedding and the head follow the tokenizer's real size.
    if corpus.enc.n_vocab != cfg.vocab_size:
        cfg = get_config(args.preset, **{**asdict(cfg), "vocab_size": corpus.enc.n_vocab})
    args.seq_len = args.seq_len or cfg.block_size
    if args.seq_len > cfg.block_size:
        raise UserError(f"--seq-len {args.seq_len} is longer than the model's context "
                        f"(block_size={cfg.block_size})")
    # init_weights draws from its own generator seeded with --seed: every data-parallel rank
    # builds bit-identical weights without a broadcast.
    model = GPT(cfg, seed=args.seed).to(rt.device)
    if resume and not args.dp:      # (a --dp resume reads its shards into the wrapper)
        model.load_state_dict(resume["model"])
    return model, corpus


def build_optimizer(args, model, sync, master, rt):
    """AdamW over decay / no-decay groups, or Muon on the hidden matrices + AdamW."""
    if args.optimizer != "muon":
        # Groups from sync: matrices decay, 1-D norm gains do not; under ZeRO these are flat
        # slices cut at parameter boundaries. lr is a placeholder: optim.set_lr writes the
        # schedule's value before every step.
        return torch.optim.AdamW(sync.optimizer_groups(args.weight_decay), lr=args.lr,
                                 betas=(args.beta1, args.beta2), eps=1e-8)
    settings = dict(lr=args.lr, weight_decay=args.weight_decay, muon_lr=args.muon_lr,
                    betas=(args.beta1, args.beta2))
    if args.dp in (None, "ddp"):
        # names and trained_params iterate model.parameters() in the same order
        # (requires_grad only), so the zip gives Muon the fp32 masters under the model's
        # names. No rank or world_size: under --dp ddp every rank runs Newton–Schulz on
        # every matrix (optim.Muon's shard() would split that work, one owner per matrix).
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return optim.build_optimizer(zip(names, trained_params(model, master)), "muon",
                                     **settings)
    # Sharded state (ZeRO's flat slices, FSDP2's rows): the wrapper's pieces, each with its
    # parameter's name, shape and flat range -- optim.ShardedMuonAdamW gathers each matrix
    # to one owner for Newton–Schulz and sends the update's pieces back.
    return optim.build_sharded(sync.owned_ranges(rt.rank), rt.rank, rt.world_size, **settings)


def build(args, rt):
    """-> Run: the model (checkpointed, in its precision, wrapped for --dp), its optimizer
    and loss scaler, the corpus, and where a --resume continues from."""
    # A torchrun restart (attempt > 0) of a run that saves resumes by itself, but only from
    # a save of this very launch (resume.find_resume compares launch ids).
    restarted = attempt() != "0" and bool(args.save_interval) and not args.resume
    found = saved.find_resume(args, restarted)
    resume = found[0] if found else None
    model, corpus = build_model(args, rt, resume)
    # A fresh start -- the first attempt, or a restart with no save of its own launch --
    # checks what it would write over: a refusal holds on every restart too
    if resume is None and args.save_interval:
        saved.check_overwrite(args, asdict(model.config), restarted)
    # The order below matters: the masters exist before the optimizer (it must step them,
    # not the 16-bit weights); checkpointing wraps the functions before QKClip wraps them
    # again (its recorder then sits outside the selective recomputation); --dp wraps the
    # model before the optimizer, whose groups come from the wrapper's (maybe flat) tensors.
    master = None
    if args.precision in LOW_PRECISION:
        if args.dp:
            raise UserError(f"--precision {args.precision} (master weights) is single-process "
                            "only; with --dp use fp32 or autocast-bf16")
        master = MasterWeights(model, LOW_PRECISION[args.precision])
    if args.precision in FP8_RECIPES:     # the blocks' nn.Linear -> fp8.Float8Linear, same
        # Parameters. Not given, the tile is V3's 128, or the largest power of two below it
        # that divides every converted width (the demo's 64-wide K/V projections: 64)
        if args.fp8_block is None:
            args.fp8_block = fp8.default_block(model)
        fp8.convert_to_fp8(model, FP8_RECIPES[args.precision], args.fp8_scaling,
                           args.fp8_block)
    apply_activation_checkpointing(model, args.checkpointing)
    if args.dp:
        sync = data_parallel.wrap(model, args.dp, rt, args.bucket_mb)
    else:
        sync = data_parallel.OneProcess(model, trained_params(model, master))
    optimizer = build_optimizer(args, model, sync, master, rt)
    # only fp16 scales: bf16's 8 exponent bits cover fp32's range
    scaler = LossScaler(args.loss_scale, args.scale_window, enabled=args.precision == "fp16")
    run_id = resume.get("run_id") if resume else None
    run = Run(model, optimizer, scaler, master, sync,
              QKClip(model, args.qk_clip) if args.qk_clip else None, corpus=corpus,
              run_id=run_id or saved.launch_id() or uuid.uuid4().hex[:12])
    if resume:
        _, full, where = found
        # Adam's m, v and step counts continue: fresh moments would re-run Adam's bias
        # correction from t = 1 and the losses would part from the uninterrupted run's.
        if args.dp:
            data_parallel.apply_generation(full, where, sync, optimizer, rt.rank)
        else:
            optimizer.load_state_dict(resume["optimizer"])
        scaler.load_state_dict(resume["scaler"])
        run.step = resume["step"]
        run.history = resume["history"]
        # last, so that nothing drawn while building shifts the restored streams
        saved.restore_rng_state(resume["rng"])
    return run


def state_rows(run):
    """This rank's model-state bytes by kind, with their total."""
    rows = run.sync.state_bytes(run.optimizer)
    rows.setdefault("opt_scalars", 0)
    rows["total"] = sum(rows.values())
    return rows


def banner(args, rt, run, n_params, tokens_per_step):
    cfg = run.model.config
    corpus = run.corpus
    print0(f"model {args.preset}: {n_params:,} params ({cfg.n_layer} layers, d={cfg.n_embd}, "
           f"{cfg.n_head} heads / {cfg.n_kv_head} kv, vocab {cfg.vocab_size}) | corpus "
           f"{corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} val tokens, "
           f"{corpus.bytes_per_token:.2f} bytes/token | {tokens_per_step:,} tokens/step | "
           f"{args.precision}" + (f" (B = {args.fp8_block})" if args.precision == "fp8-block"
                                  else "") +
           f", checkpointing {args.checkpointing}, device {rt.device}"
           + (f" | --dp {args.dp} on {rt.world_size} ranks" if args.dp else ""))
    if rt.distributed:             # the two phases of hang detection (core/runtime.py)
        later = ("the same (--step-timeout 0)" if args.step_timeout == 0 else
                 f"{min(args.step_timeout, rt.timeout):g} s" if args.step_timeout else
                 f"max({STEP_TIMEOUT_FLOOR:g} s, {STEP_TIMEOUT_STEPS} x the first step)")
        print0(f"hang detection: a collective waits {rt.timeout:g} s for a silent peer at "
               f"start-up and in the first step, then {later}; saves and evaluations "
               f"{rt.timeout:g} s" + (" (NCCL: its watchdog aborts the process at the "
                                       "deadline)" if rt.backend == "nccl" else ""))
    # Two yardsticks for the log: log V, the loss of a uniform guess, where step 1 should
    # start (N(0, 0.02) weights give near-uniform logits), and the unigram loss of a model
    # that ignores context, which a trained GPT must beat (tests/test_train.py).
    if run.step == 0:
        baseline = data.unigram_baseline_loss(corpus.train, corpus.val, cfg.vocab_size)
        run.history["unigram"] = baseline
        print0(f"unigram baseline val loss {baseline:.3f} (uniform: "
               f"{math.log(cfg.vocab_size):.3f})")


def log_line(args, rt, run, loss, lr, timer, state, act_bytes, sent_per_step, skipped,
             tokens_per_step):
    line = (f"step {run.step:4d} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{fmt_count(tokens_per_step / timer.seconds)} tok/s | "
            f"{timer.seconds * 1000:.0f} ms | state {fmt_bytes(state['total'])}"
            f"{'/rank' if args.dp else ''} | act {fmt_bytes(act_bytes)}")
    if args.dp:
        line += f" | sent {fmt_bytes(sent_per_step)}/step"
    # MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM): FLOPs per token (6N + 12·L·d·T)
    # × tokens/s over the peak of all world_size GPUs. Checkpointing's recomputation is not
    # model FLOPs (counting it gives "hardware FLOPs utilisation"), so --checkpointing full
    # shows a lower MFU for the same busy GPU: ~6N of work in a ~8N step, about 3/4.
    peak = gpu_peak_flops(rt.device)
    if peak:
        flops = run.model.flops_per_token(args.seq_len) * tokens_per_step / timer.seconds
        line += f" | mfu {100 * flops / peak / rt.world_size:.1f}%"
    if args.precision == "fp16":
        line += f" | scale {run.scaler.scale:g}" + (" SKIPPED" if skipped else "")
    if run.expert_loads is not None and run.expert_loads.imbalance is not None:
        line += f" | experts max/mean {run.expert_loads.imbalance:.2f}"
    clip_report = run.qk_clip.take_report() if run.qk_clip is not None else None
    if clip_report:                  # since the previous log line
        line += f" | qk-clip {clip_report}"
    return line


def train(args, rt):
    """The loop: one screen, as nanoGPT's. Every step: the schedule's lr, the step's
    micro-batches, one optimizer step, the loss every rank agrees on, then the log line,
    the validation and the checkpoint when they are due."""
    run, n_params, tokens_per_step, last = start(args, rt)
    first_step = run.step
    if first_step and first_step >= args.steps:
        print0(f"nothing to do: the checkpoint is already at step {first_step} of --steps "
               f"{args.steps} (raise --steps to train further)")
        return run.history
    state, act_bytes, sent, t_start = None, 0, 0, time.time()
    tight = 0.0                     # the collective timeout after the first step (0: none)
    # Ctrl-C: finish the step, save, say how to resume; and the machine's load as the loop
    # starts and ends, the judge of the tok/s and ms in its log lines (core/meters.py)
    with GracefulStop() as stop, TimingConditions() as conditions:
        while run.step < last:
            inject_fault(rt, run.step, args.crash_at_step, args.hang_at_step)
            # every group's lr (× its lr_scale: Muon's own) is written before each step
            lr = learning_rate(run.step, args)
            optim.set_lr(run.optimizer, lr)
            batches = micro_batches(run.corpus, args, run.step, rt.device, rt.rank)
            # bytes this rank put on the wire in the step: meters.comm counts the collectives
            # it wraps (FSDP2's run inside PyTorch and are not seen)
            wire_before = comm.total_wire
            with StepTimer(rt.device) as timer:
                loss, act_bytes, skipped = train_step(run, batches, args, rt.device)
            sent += comm.total_wire - wire_before
            if run.expert_loads is not None and not skipped:
                run.history.setdefault("imbalance", []).append(run.expert_loads.imbalance)
            state = state_rows(run)        # measured while the gradients still exist
            run.sync.zero_grad()        # set to None: freed until the next backward
            # A collective every rank makes every step: skip it on one rank and all hang.
            loss, signum = global_mean(loss, rt, stop.signum)   # every rank stops together
            run.history["loss"].append(loss)
            run.step += 1
            # the first step of this invocation too: at --log-interval 10 a loaded CPU
            # would otherwise stay silent for minutes before the first line and its eta
            if run.step % args.log_interval == 0 or run.step in (args.steps, first_step + 1):
                per_step = (time.time() - t_start) / (run.step - first_step)
                print0(log_line(args, rt, run, loss, lr, timer, state, act_bytes,
                                sent / (run.step - first_step), skipped, tokens_per_step)
                       + f" | eta {fmt_duration(per_step * (last - run.step))}")
            # hang detection's second phase: a step's time is known now (core/runtime.py)
            if run.step == first_step + 1:
                tight = tighten_after_first_step(rt, args.step_timeout, timer.seconds)
            evaluate_and_save(args, rt, run, last, signum, tight)
            if signum:
                stopped(args, run, signum)
    if tight:                       # the report and the sample: long steps again
        set_collective_timeout(rt.timeout)
    run.history["elapsed"] = time.time() - t_start
    if state is not None:
        final_report(args, rt, run, state, n_params, act_bytes, sent / (run.step - first_step))
    wrap_up(args, rt, run, conditions)
    return run.history


def start(args, rt):
    """-> (the Run, its parameter count, tokens per step, the last step of this invocation),
    after the banner and the disk check."""
    seed_everything(args.seed)
    run = build(args, rt)
    with torch.device("meta"):      # count from the config: ZeRO-3/FSDP hold only shards
        n_params = GPT(run.model.config, seed=None).num_params()
    # the global batch in tokens: b·T per micro-batch, k micro-batches, on every rank
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * rt.world_size
    banner(args, rt, run, n_params, tokens_per_step)
    if args.save_interval:        # a read-only or full disk: now, not at the first save
        check_writable(os.path.dirname(os.path.abspath(args.ckpt)),
                       saved.checkpoint_bytes(n_params, args))
    # --stop-after ends this invocation early, but the schedule keeps --steps as its length,
    # so a resumed run continues the same cosine (test_resume_reproduces_the_uninterrupted_run)
    last = min(args.steps, run.step + (args.stop_after or args.steps))
    if run.step and run.step < args.steps:
        print0(f"resumed at step {run.step} from {saved.location(args)}")
    return run, n_params, tokens_per_step, last


def wrap_up(args, rt, run, conditions):
    """After the loop: the time (and one warning line when the machine was too loaded to
    trust it), how to go on, the loss curve, the sample, what next."""
    print0(f"trained {run.step} steps in {run.history['elapsed']:.1f} s")
    conditions.report(out=print0)
    if run.step < args.steps and args.save_interval:
        print0(f"stopped at step {run.step} of {args.steps} (--stop-after): continue with "
               f"the same command and --resume")
    if args.save_interval and rt.is_main:
        print0(f"loss curve: {loss_curve(args, run.history)}")
    if args.sample_tokens and run.step > 0:
        sample(run.model, run.corpus.enc, args, rt.device)
    if args.save_interval and run.step > 0:
        next_steps(args)


def next_steps(args):
    """The demo's last lines: what a reader can do with the checkpoint just written."""
    flag = "" if args.ckpt == "out/ckpt.pt" else f" --checkpoint {args.ckpt}"
    print0(f"next: python sample.py{flag}   (talk to the model)\n"
           f"      python serve.py{flag} --port 8000   (serve it: an OpenAI-compatible API)\n"
           f"      python evaluate.py ppl{flag}   (perplexity and bits/byte)")


def evaluate_and_save(args, rt, run, last, signum, tight):
    """The validation and the checkpoint of this step, when they are due. Both take longer
    than a step (and a save can take much longer on one rank than on the others), so their
    collectives wait the start-up timeout, not the tight one (distributed.long_phase)."""
    due_eval = run.step % args.eval_interval == 0 or run.step == args.steps
    # on the interval, at this invocation's last step, or after a signal; under --dp
    # every rank writes its own shard, so every rank takes this branch together
    due_save = args.save_interval and (run.step % args.save_interval == 0 or
                                       run.step == last or signum)
    if not (due_eval or due_save):
        return
    with long_phase(rt.timeout, tight):
        # every rank evaluates (a ZeRO-3 forward gathers weights: a collective), all on
        # the same fixed batches -- the rank is not in their seed
        if due_eval:
            val = evaluate(run.model, run.corpus, args, rt.device)
            run.history["val"].append((run.step, val))
            print0(f"step {run.step:4d} | val loss {val:.4f}")
        if due_save:
            if args.save_delay and rt.rank == rt.world_size - 1:
                time.sleep(args.save_delay)       # fault injection: a slow disk on one rank
            saved.save(args, rt, run)
            print0(f"saved step {run.step} to {saved.location(args)}")


def loss_curve(args, history):
    """The training loss of every step and the validation losses, as an SVG next to the
    checkpoint (core/plots.py: written by hand, one point per step). -> its path."""
    series = {"train": list(enumerate(history["loss"], start=1)),
              "val": [(step, val) for step, val in history["val"]]}
    name = os.path.splitext(os.path.basename(args.ckpt))[0] + "_loss"
    return svg_line_plot(name, series, title=f"{args.preset}: loss per step", xlabel="step",
                         ylabel="loss (nats)",
                         directory=os.path.dirname(os.path.abspath(args.ckpt)))


def final_report(args, rt, run, state, n_params, act_bytes, sent_per_step):
    """The model-state ledger (one process: next to the formula; --dp: every rank next to
    the ZeRO formulas) and the activations next to Korthikanti et al.'s formula."""
    cfg = run.model.config
    # Muon's share (one momentum buffer, 4 B/param instead of Adam's 8), by the model's
    # names and shapes: under ZeRO-3 the parameters themselves are freed shards
    muon = sum(p.numel() for n, p in run.model.named_parameters()
               if optim.is_hidden_matrix(n, p)) if args.optimizer == "muon" else 0
    if args.dp:
        run.history["ledger"] = data_parallel.ledger(args.dp, rt, state, n_params,
                                                      sent_per_step, muon)
        if isinstance(run.optimizer, optim.ShardedMuonAdamW):
            print0(run.optimizer.report())
    else:
        print0(model_state_report(state, n_params, args.precision, muon))
    a = activation_formula(args.seq_len, args.batch_size, cfg.n_embd, cfg.n_head,
                           cfg.n_layer, 2 if args.precision in LOW_PRECISION or
                           args.precision == "autocast-bf16" else 4)
    print0(f"activations of one micro-batch: measured {fmt_bytes(act_bytes)} vs "
           f"Korthikanti's GPT-3-block formula {fmt_bytes(a)} (ours: no dropout, SwiGLU, "
           f"GQA, checkpointing={args.checkpointing})")
    seen = run.history.get("imbalance")
    if seen:
        last = seen[-max(1, len(seen) // 10):]
        print0(f"experts ({cfg.moe_balance}, {cfg.moe_score}, aux coef {cfg.moe_aux_coef:g}): "
               f"max/mean tokens per expert {sum(seen) / len(seen):.3f} over {len(seen)} "
               f"steps, {sum(last) / len(last):.3f} over the last {len(last)} | active "
               f"params {run.model.num_params(active=True):,} of {n_params:,}")


def global_mean(value, rt, signum=0):
    """-> (the loss of the whole global batch = the mean of the ranks' losses, the stop
    signal any rank received). The signal rides on the all-reduce every step makes anyway,
    so every rank stops after the same step (SIGINT wins over SIGTERM)."""
    if not rt.distributed:
        return value, signum
    # The loss and two 0/1 flags in ONE all-reduce (SUM): a flag > 0 means some rank got
    # that signal. float64: the flags stay exact and the loss sum loses nothing. On the
    # rank's device, because NCCL moves CUDA tensors only.
    t = torch.tensor([value, signum == signal.SIGINT, signum == signal.SIGTERM],
                     dtype=torch.float64, device=rt.device)
    comm.all_reduce(t)
    signum = signal.SIGINT if t[1] else signal.SIGTERM if t[2] else 0
    # ÷ N: every rank's loss is a mean over the same number of tokens
    return float(t[0]) / rt.world_size, int(signum)


def stopped(args, run, signum):
    """After a SIGINT / SIGTERM: the one line saying where the run stopped and how to go
    on, then Interrupted (run_cli exits 130 / 143)."""
    where = saved.location(args)
    print0(f"{signal.Signals(signum).name}: stopped after step {run.step} of {args.steps}; "
           + (f"checkpoint saved to {where}: run the same command with --resume to continue"
              if args.save_interval else "nothing saved (--save-interval 0)"))
    raise Interrupted(signum)


def sample(model, enc, args, device):
    """The end-of-run sample, printed by rank 0 (every rank runs generate: a sharded
    model's forward is collective). sample.py does the same from a saved checkpoint."""
    model.eval()
    prompt = enc.encode_ordinary(args.prompt)
    # the room left in the context; a --prompt longer than block_size fails in the
    # forward -- one error line, after the checkpoint was saved
    n = min(args.sample_tokens, model.config.block_size - len(prompt))
    with autocast_ctx(args, device):
        out = model.generate(prompt, n, temperature=args.temperature, top_k=args.top_k,
                             seed=args.seed, eos_id=enc.eot_token)
    print0("---- sample ----\n" + enc.decode(prompt + out) + "\n----------------")


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables)

MODEL_KNOBS = [
    knob("--preset", None, f"one of {', '.join(PRESETS)} (default: small; with --resume the "
         "checkpoint's, and a different one is refused)"),
    preset_knob("--n-layer", int, "layer count"),
    preset_knob("--n-embd", int, "width"),
    preset_knob("--n-head", int, "attention heads"),
    preset_knob("--n-kv-head", int, "key/value heads"),
    knob("--n-expert", int, "override the preset's experts (0 = dense; not given: the preset's)"),
    preset_knob("--block-size", int, "context length"),
    knob("--moe-balance", None, "MoE balancing: the Switch aux loss, or DeepSeek-V3's routing "
         "bias (default: the preset's)", choices=["aux", "loss_free"]),
    knob("--moe-aux-coef", float, "weight of the MoE balance loss (default: the preset's: "
         "0.01; v3: 1e-4)"),
    knob("--moe-bias-rate", float, "γ of the loss-free bias update (default: the preset's: "
         "0.001, DeepSeek-V3's)"),
    knob("--attn", None, "attention kernel (default: the preset's, sdpa; bench uses math)",
         choices=["sdpa", "math"]),
]
# the knobs above that model.get_config takes as overrides (all but --preset)
CONFIG_KNOBS = MODEL_KNOBS[1:]

DATA_KNOBS = [
    knob("--data", None, "a UTF-8 text file (default: the built-in corpus, the Python "
         "standard library's top-level sources)"),
    knob("--vocab-size", int, "tokenizer vocabulary (default: the preset's)"),
    knob("--batch-size", 8, "sequences per micro-batch"),
    knob("--seq-len", int, "tokens per sequence (default: the model's block size)"),
    knob("--grad-accum", 1, "micro-batches per step"),
]

# GPT-3's recipe (Brown et al. 2020, appendix B): β2 0.95 (not Adam's 0.999: v tracks the
# gradients' scale within ~20 steps, so a burst of large gradients cannot make m/√v large
# for long), weight decay 0.1, clipping at norm 1.0, cosine to 10% of the peak (min-lr =
# lr/10). The peak is 5× GPT-3 Small's 6e-4: small models take larger steps, and the
# 600-step demo needs them.
OPTIMIZER_KNOBS = [
    knob("--steps", 600, "optimizer steps"),
    knob("--lr", 3e-3, "peak learning rate"),
    knob("--min-lr", 3e-4, "final learning rate"),
    knob("--warmup-steps", 30, "linear warm-up steps"),
    knob("--weight-decay", 0.1, "AdamW weight decay (matrices only)"),
    knob("--beta1", 0.9, "Adam β1"),
    knob("--beta2", 0.95, "Adam β2"),
    knob("--grad-clip", 1.0, "max gradient norm (0 = off)"),
    knob("--optimizer", "adamw", "adamw, or muon: Muon on hidden matrices + AdamW on "
         "embeddings, head, norms (optim.py)", choices=optim.OPTIMIZERS),
    knob("--muon-lr", float, "Muon's peak lr (default: --lr; its update is scaled to AdamW's "
         "RMS)"),
    knob("--qk-clip", 0.0, "MuonClip: after each step rescale W_q/W_k of heads whose max "
         "logit > TAU (0 = off; K2: 100)", metavar="TAU"),
]

MEMORY_KNOBS = [
    knob("--precision", "fp32", "fp32; bf16 autocast over fp32 weights; bf16 or fp16 weights "
         "with fp32 master weights (fp16 adds dynamic loss scaling); fp8 / fp8-block: the "
         "blocks' linears in FP8, scaled per tensor or per tile and block (training/fp8.py)",
         choices=["fp32", "autocast-bf16", "bf16", "fp16", *FP8_RECIPES]),
    knob("--fp8-block", int, "fp8-block: the tile width B (1×B activation tiles, B×B weight "
         "blocks), dividing every block linear's width (not given: DeepSeek-V3's 128, or the "
         "largest power of two below it that divides them: 64 for the demo)"),
    knob("--fp8-scaling", "dynamic", "fp8: each scale from the tensor's own amax (dynamic) or "
         "from the last 16 steps' amaxes (delayed, Transformer Engine's; tensorwise only)",
         choices=list(fp8.SCALINGS)),
    knob("--loss-scale", 2.0 ** 16, "initial fp16 scale"),
    knob("--scale-window", 200, "clean steps before the fp16 loss scale doubles"),
    knob("--checkpointing", "none", "activation checkpointing",
         choices=["none", "selective", "full"]),
]

DATA_PARALLEL_KNOBS = [
    knob("--dp", None, "ddp, zero1, zero2, zero3 (by hand) or fsdp (PyTorch's fully_shard); "
         "not given: one process", choices=data_parallel.MODES),
    # 1 MB, not PyTorch DDP's 25: `small`'s ~3.9M fp32 gradients (~16 MB) would fill one
    # 25 MB bucket, launched only when backward ends -- nothing left to overlap with.
    knob("--bucket-mb", 1.0, "ddp gradient bucket size"),
    knob("--crash-at-step", -1, "the last rank exits abruptly at this step (first attempt "
         "only): try it under torchrun --max-restarts=1"),
    knob("--hang-at-step", -1, "the last rank stops itself (SIGSTOP) at this step (first "
         "attempt only): the --timeout watchdog"),
    knob("--timeout", float, "seconds a collective waits for a silent peer during start-up, "
         "the first step, saves and evaluations before the job exits (status 3) for torchrun "
         "to restart (default: 300 on CPU, 600 on GPU)"),
    knob("--step-timeout", float, "seconds a collective waits after the first step (not "
         "given: max(60, 20 x the first step's time), at most --timeout; 0: --timeout "
         "throughout). Under NCCL its watchdog aborts the process at this deadline"),
    knob("--save-delay", 0.0, "fault injection: the last rank sleeps this many seconds in "
         "every save, like a slow disk (saves wait --timeout, so a tight --step-timeout must "
         "not end the job)"),
]

RUN_KNOBS = [
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--seed", 1337, "weights, data and sampling seed"),
    knob("--log-interval", 10, "steps between log lines"),
    knob("--eval-interval", 100, "steps between validations"),
    knob("--eval-iters", 20, "validation batches"),
    knob("--checkpoint --ckpt", "out/ckpt.pt", "checkpoint path (written, and read by "
         "--resume; --ckpt: the same)", dest="ckpt"),
    knob("--save-interval", 100, "0 = never save"),
    knob("--resume", False, "continue from --ckpt (the newest readable of the --keep "
         "generations)"),
    knob("--overwrite", False, "a fresh run may write over a --ckpt that holds another model "
         "or an unfinished run (refused otherwise)"),
    knob("--keep", 2, "checkpoint generations kept (ckpt.pt, ckpt.pt.1, ...; --dp: step_K "
         "folders): the fallback if the newest is unreadable"),
    knob("--stop-after", 0, "stop (and save) after this many steps of this invocation; the "
         "schedule still runs to --steps (0 = off)"),
    knob("--sample-tokens", 200, "tokens sampled at the end"),
    knob("--prompt", "def ", "prompt of the final sample"),
    knob("--temperature", 0.8, "final sample's temperature"),
    knob("--top-k", 50, "final sample's top-k"),
]

KNOBS = {"model": MODEL_KNOBS, "data": DATA_KNOBS, "optimisation": OPTIMIZER_KNOBS,
         "memory techniques": MEMORY_KNOBS,
         "data parallelism (under torchrun)": DATA_PARALLEL_KNOBS, "run": RUN_KNOBS}


def build_parser(description):
    """Every knob of the loop; scripts/train_bench.py adds its own group to these."""
    return command_line(description, KNOBS)


def check_args(args):
    """The counts that must be >= 1 and a positive --timeout, one line each."""
    require_at_least_one(args, ("steps", "batch_size", "grad_accum", "log_interval",
                                "eval_interval", "eval_iters", "warmup_steps", "keep"))
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if (args.step_timeout is not None and args.step_timeout < 0) or args.save_delay < 0:
        raise UserError("--step-timeout and --save-delay must be >= 0 seconds")
    return args


def parse_args(argv=None):
    p = build_parser("Train the shared GPT (single process; distributed modes: see README). "
                     "What each technique costs, measured: python -m scripts.train_bench.")
    return check_args(p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    with setup_runtime(args.device, args.timeout) as rt:
        if args.dp and not rt.distributed:
            raise UserError(f"--dp {args.dp} needs processes to talk to: launch with "
                            f"torchrun --standalone --nproc_per_node=N train.py --dp {args.dp} ...")
        if rt.world_size > 1 and not args.dp:
            raise UserError(f"{rt.world_size} processes but no --dp mode: choose one of "
                            f"{', '.join(data_parallel.MODES)}")
        return train(args, rt)


if __name__ == "__main__":
    run_cli(main)
