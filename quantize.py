"""
quantize.py -- make the trained GPT smaller after (or while) training it: round-to-nearest
int8/int4/int3, GPTQ, AWQ, SmoothQuant W8A8, quantization-aware training (STE, LSQ) and
pruning (magnitude, Wanda, 2:4), each written by hand, proven in tests/test_quantize.py and
measured in one ledger: bits/param counted from the stored tensors, bytes, validation loss
and perplexity vs fp32, top-1 agreement, greedy agreement, decode ms/token.

Run:  python quantize.py rtn --bits 4 --group-size 32 --save out/quantize/ckpt-int4.pt
      python quantize.py gptq --bits 3            # also: awq, smoothquant (W8A8)
      python quantize.py qat --bits 4 --steps 100 [--lsq]
      python quantize.py prune --sparsity 0.5 --pattern 2:4 --criterion wanda
      python quantize.py compare                  # every method at 8, 4 and 3 bits
Input: out/ckpt.pt, or, when there is none, a fresh tiny model trained for a few seconds.
Measured (docs/quantize.md, small preset): int8 costs nothing (Δ loss <= 1e-4); at int3
GPTQ keeps 97.4% of the next-token argmaxes where RTN keeps 95.2%; the weight-only
formats decode 1.6-8x slower on this CPU (a dequantization per matmul, no fused kernel).

What each technique saves, adds and sacrifices (Ψ = weights of the block linears; the
embedding, head and norms stay fp32 here, as most weight-only schemes keep them):
  - Round-to-nearest (RTN). int8: symmetric per output row, scale = max|w|/127; int4/int3:
    asymmetric per group of g inputs, scale = (max - min)/(2^b - 1), zero = round(-min/scale).
    Saves 32 -> b + (16 + 8)/g bits/param (fp16 scale, 8-bit zero per group; int8: 8 + 16/in).
    Adds a dequantization per matmul (unpack, subtract, multiply); sacrifices rounding error.
  - GPTQ (Frantar et al. 2022): quantize one input column at a time and spread its error onto
    the columns not yet quantized, weighted by the inverse Hessian of the layer's squared
    output error, H = 2XX^T from calibration activations. Same bytes as RTN; adds one
    calibration forward per group of layers and O(in^3) per layer; loses less than RTN.
    Groups are fitted as IST-DASLab/gptq fits them (--gptq-group-fit, calibrated.py).
  - AWQ (Lin et al. 2023): scale up the input channels whose activations are large (s = mean|x|
    ^alpha, alpha from a grid), fold 1/s into the previous norm or linear. Same bytes; adds a
    calibration forward and a grid search; protects the salient channels. alpha is scored
    as llm-awq scores it, on the attention's / MLP's output (--awq-objective).
  - SmoothQuant (Xiao et al. 2023): s_j = max|X_j|^alpha / max|W_j|^(1-alpha) moves activation
    outliers into the weights, so both can be int8 (W8A8). Adds an activation quantization per
    matmul at run time; buys an int8 x int8 -> int32 matmul (torch._int_mm, used only where
    measured faster).
  - QAT: train through the quantizer (forward: dequantized weights; backward: straight-
    through, gradient 0 where a weight is clipped). LSQ (Esser et al. 2019) also learns the
    step sizes. Same bytes as PTQ; adds training steps; recovers part of the loss.
  - Pruning: zero the weights with the lowest |W| (magnitude) or |W|·||X_j|| (Wanda, Sun et al.
    2023), per output row, or 2 of every 4 along the input (2:4, Ampere sparse tensor cores).
    Saves bytes and FLOPs only when stored sparse (2:4: values + 2-bit indices) and run by a
    sparse kernel; here the weights stay dense: it saves nothing on this machine.
"""
import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch

from compression import calibrated, prune, qat
from compression.calibrated import calibration
from compression.qat import finetune
from core import data
from core.checkpoint import load_model
from core.quant_format import (FORMAT_VERSION, SUPPORTED_BITS, QuantLinear, check_format,
                               default_group, fmt_name,
                               quantize_model, stored_nbytes, target_linears)
from model import GPT, get_config
from core.cli import (ArgumentParser, HelpFormatter, add_knobs, fmt_bytes, knob,
                      require_at_least_one)
from core.errors import UserError
from core.meters import tensor_bytes
from core.runtime import print0, run_cli, seed_everything, TimingConditions

# train.py's default output. Absent on a clean clone: load_base then trains a fresh tiny
# model, so every mode runs with no setup (the tests pass --checkpoint to a fixture instead).
DEFAULT_CKPT = "out/ckpt.pt"


# ----------------------------------------------------------------------------------------
# The methods: round-to-nearest, GPTQ, AWQ and SmoothQuant on a copy of the fp32 model.
# The stored format (codes, scales, zeros; QuantLinear, which dequantizes them in every
# forward) lives in core/quant_format.py, which core/checkpoint.py reads too; what
# calibration buys, in compression/calibrated.py.

def ptq(base, method, bits, group_size, calib, args, int_mm_rows=None):
    """Post-training quantization of a copy of base. -> (model, calibration passes, note).
    The calibrated methods live in compression/calibrated.py."""
    # A copy: every method edits in place (replace_module, fold_scales), and compare
    # quantizes the same base a dozen times.
    model = copy.deepcopy(base)
    for _, lin in target_linears(model):            # bad formats fail before any work
        check_format(bits, group_size, lin.in_features)
    if method == "rtn":
        return quantize_model(model, bits, group_size), 0, ""
    if method == "gptq":
        # sequential: one calibration forward per stage (q/k/v, o, gate/up, down), i.e.
        # 4·n_layer passes, each on the outputs of the stages already quantized, so a
        # layer's Hessian H = 2XX^T is taken on the inputs it will see when deployed.
        # errors collects each layer's output error and RTN's on the same inputs.
        errors = []
        transform = calibrated.gptq_transform(bits, group_size, errors,
                                              block_size=args.block_size, damp=args.damp,
                                              act_order=args.act_order,
                                              group_fit=args.gptq_group_fit)
        passes = calibrated.sequential(model, calib, transform)
        return model, passes, gptq_note(args, errors)
    if method == "awq":
        # AWQ's statistic is mean|x_j| per input channel (Lin et al. 2023, "searching to
        # scale"); the grid search scores each α by --awq-objective on the first
        # --awq-tokens tokens (0: all): cost = grid · (quantize + the scored module's run).
        # One forward serves every group: W·diag(s) with 1/s folded into the producer is an
        # identity in fp32, so earlier scalings do not change later statistics. Then RTN.
        alphas = calibrated.awq_scale(model, calib, bits, group_size, args.grid,
                                      args.awq_objective, args.awq_quantizer, args.awq_tokens)
        return quantize_model(model, bits, group_size), 1, awq_note(args, alphas)

    # Anything else falls through to SmoothQuant: only cmd_ptq and cmd_compare call this,
    # with known names -- a method added by hand needs its own branch above this line.
    # SmoothQuant's statistic is max|X_j|, not the mean: int8 activations clip at the max.
    # W8A8 ignores bits/group_size: int8 weights, one scale per output row.
    def smooth(stats, weights):
        return calibrated.smooth_scales(stats.abs_max, weights, args.alpha), args.alpha
    calibrated.scale_model(model, calib, smooth)
    return calibrated.w8a8_model(model, int_mm_rows), 1, f"alpha {args.alpha}"


def gptq_note(args, errors):
    """The ledger's note for a GPTQ row: its non-default options, then the layer error,
    Σ over layers of E||(W - Ŵ)x||² on the calibration inputs, and the ratio to RTN's."""
    opts = ["act-order"] if args.act_order else []
    if args.gptq_group_fit != "block-start":
        opts.append(f"--gptq-group-fit {args.gptq_group_fit}")
    ours, rtn = sum(e for e, _ in errors), sum(r for _, r in errors)
    err = f"layer err {ours:.4g} ({ours / rtn:.3f}× rtn)" if rtn > 0 else ""
    return "; ".join(opts + [err] if err else opts)


def awq_note(args, alphas):
    """The ledger's note for an AWQ row: its non-default options and the α range chosen."""
    opts = [f"--awq-objective {args.awq_objective}"] if args.awq_objective != "module" else []
    if args.awq_quantizer != "llm-awq":
        opts.append(f"--awq-quantizer {args.awq_quantizer}")
    return "; ".join(opts + [f"alpha {min(alphas)}..{max(alphas)}"])



# ----------------------------------------------------------------------------------------
# The int8 matmul that SmoothQuant's W8A8 layers may use: measured, then chosen

def measure_int_mm(in_features, out_features, rows=(1, 16, 64, 256), repeats=20):
    """Time torch._int_mm (int8 x int8 -> int32) against the fp32 matmul it would replace.
    -> (smallest row count from which int8 wins at every measured size, or None; lines;
    {row label: every call's seconds}, for core.runtime.TimingConditions' spread)."""
    # torch._int_mm is a private op (the leading underscore): a build may lack it, and
    # W8A8 must then fall back to the fp32 path, which gives the same numbers.
    if not hasattr(torch, "_int_mm"):
        return None, ["torch._int_mm: not in this torch build"], {}
    lines, wins, timed = [], [], {}
    # Random codes in [-127, 127], the symmetric int8 range of code_range(8): timing depends
    # on dtype and shape only. w is (out, in) as QuantLinear.codes is, so x @ w.t() is the
    # very call QuantLinear.w8a8 makes (w.t() a strided view, no copy).
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    for m in rows:
        # m = tokens in one forward: 1 is a decode step of one sequence, 256 a prefill.
        x = torch.randint(-127, 128, (m, in_features), dtype=torch.int8)
        try:
            ts_int = _times(lambda: torch._int_mm(x, w.t()), repeats)
        except RuntimeError as e:
            # a backend without a kernel for this shape (CUDA's has wanted more than 16 rows
            # and sizes in multiples of 8): "never use it" is the safe decision.
            return None, [f"torch._int_mm fails here: {str(e).splitlines()[0]}"], {}
        # The fp32 copies are made outside the timed call. The real fallback also pays a
        # codes.float() per call, so this baseline is a little faster than it: int8 has to
        # beat the stronger opponent before W8A8 switches to it.
        xf, wf = x.float(), w.float()
        ts_fp = _times(lambda: xf @ wf.t(), repeats)
        timed.update({f"int8 rows {m}": ts_int, f"fp32 rows {m}": ts_fp})
        t_int, t_fp = min(ts_int), min(ts_fp)
        wins.append(t_int < t_fp)
        lines.append(f"  rows {m:4d} x {in_features}x{out_features}: int8 {t_int * 1e6:7.1f} us"
                     f" | fp32 {t_fp * 1e6:7.1f} us")
    # The smallest m from which int8 wins at every larger measured size too: a win that
    # flips back at a bigger m (cache effects) would otherwise route prefills to the
    # slower kernel. None when int8 loses at the largest size.
    first = next((m for i, m in enumerate(rows) if all(wins[i:])), None)
    return first, lines, timed


def _times(fn, repeats):
    """The seconds of each of `repeats` calls of fn."""
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return seconds


def _best_time(fn, repeats):
    """The fastest of `repeats` calls of fn, in seconds. The minimum, not the mean: on a
    shared machine noise only ever adds time, so the minimum is the least noisy estimate."""
    return min(_times(fn, repeats))



def int_mm_decision(base):
    """Measure torch._int_mm on the widest block linear; -> rows from which to use it."""
    # One decision for every layer, from the largest weight (an MLP linear, ffn_hidden ×
    # dim): a simplification -- a per-shape table would suit a model of mixed widths better.
    widest = max((lin for _, lin in target_linears(base)), key=lambda m: m.weight.numel())
    with TimingConditions() as conditions:    # the load as the timing starts and ends
        rows, lines, timed = measure_int_mm(widest.in_features, widest.out_features)
    print0("int8 x int8 -> int32 matmul (torch._int_mm) vs fp32, best of 20:")
    for line in lines:
        print0(line)
    # the fp32 fallback is exact too: |sum x_q·w_q| <= 127^2·in < 2^24 (in <= 1040), the
    # integers fp32 holds exactly (QuantLinear.w8a8): the choice changes speed, not numbers
    print0(f"  -> W8A8 uses torch._int_mm from {rows} rows on" if rows is not None else
           "  -> W8A8 uses the fp32 matmul on integer values (exact, and faster here)")
    # a busy machine can flip the choice (it changes speed only): say so when it was busy
    conditions.report(timed, out=print0)
    return rows



# ----------------------------------------------------------------------------------------
# The ledger: every row measured against the fp32 model in the same run

def model_bytes(model):
    """-> (stored bytes of the quantized linears, their weights' count, all bytes). Counted
    from the tensors the model holds: parameters and stored buffers (the state_dict)."""
    q_bytes = q_params = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            # codes + fp16 scales (+ uint8 zeros): bits/weight = 8·q_bytes/q_params comes
            # out as b + (16 + 8)/g, e.g. 4 + 24/32 = 4.75 for int4 g32, which
            # tests/test_quantize.py asserts from the CLI's ledger row.
            q_bytes += stored_nbytes(m.stored())
            q_params += m.shape[0] * m.shape[1]
    # keep_vars=True hands back the Parameters themselves, not fresh detached tensors, so
    # tensor_bytes' id() de-duplication counts a tied embedding/head (tie_embeddings) once.
    # A pruned model's masks are non-persistent buffers: not counted, as not stored.
    return q_bytes, q_params, tensor_bytes(model.state_dict(keep_vars=True).values())




class Evaluator:
    """The fp32 reference, measured once: validation batches, next-token argmax, greedy
    continuations of held-out prompts (windows of the validation split), decode ms/token."""

    def __init__(self, fp32, corpus, args):
        # The model cannot attend past block_size: --seq-len is capped to it.
        seq = min(fp32.config.block_size, args.seq_len)
        # Drawn once and reused for every row, so two rows differ by their method only,
        # never by the sample. Seed + 1 on the validation split; calibration draws seed + 2
        # on the train split and fine-tuning seed + 3: no method ever sees these tokens.
        self.batches = [data.get_batch(corpus.val, args.batch_size, seq, args.seed + 1, i)
                        for i in range(args.eval_batches)]
        gen = torch.Generator().manual_seed(args.seed)
        # the high end is exclusive, so s + prompt_len <= len(val): every prompt is whole
        starts = torch.randint(0, len(corpus.val) - args.prompt_len, (args.prompts,),
                               generator=gen).tolist()
        # val is a uint16 memmap; generate() wants a list of Python ints
        self.prompts = [corpus.val[s:s + args.prompt_len].astype("int64").tolist()
                        for s in starts]
        self.args, self.fp32 = args, fp32
        self.ref_loss, self.ref_top1 = self.loss_and_top1(fp32)
        # temperature 0 = argmax (model.sample_next): deterministic, so any difference
        # from these continuations is the quantization's, not the sampler's.
        self.ref_greedy = [fp32.generate(p, args.new_tokens, temperature=0) for p in self.prompts]

    @torch.no_grad()
    def loss_and_top1(self, model):
        """-> (mean validation cross-entropy, the (B, T) next-token argmax of every batch)."""
        losses, top1 = [], []
        for x, y in self.batches:
            logits, loss = model(x, y)
            losses.append(loss.item())
            # keep the argmax only: B·T int64s instead of B·T·V floats of logits
            top1.append(logits.argmax(-1))
        # every batch has B·T tokens, so the mean of batch means is the mean over tokens
        return sum(losses) / len(losses), top1

    def decode_ms(self, model):
        """ms per new token of model and of fp32: best of --repeats greedy generations of one
        prompt each, alternated, so both see the same load on a shared machine."""
        n, best = self.args.new_tokens, [math.inf, math.inf]
        # The fp32 row times itself once; any other row is timed against a fresh fp32
        # run, so "× fp32" is a ratio of two measurements taken under the same load.
        pair = (model,) if model is self.fp32 else (model, self.fp32)
        for _ in range(self.args.repeats):
            for i, m in enumerate(pair):
                # One generate = one prefill + n decode steps. A QuantLinear dequantizes
                # its whole weight in every forward, i.e. at every token: out·in work per
                # layer per step, no less than the batch-1 matmul itself -- hence 1.6-8x.
                best[i] = min(best[i], _best_time(
                    lambda: m.generate(self.prompts[0], n, temperature=0), 1))
        # the prefill is spread over the n tokens (short prompts: a small share)
        ms = [1000 * b / n for b in best]
        return ms[0], (ms[0] if model is self.fp32 else ms[1])

    def row(self, model, method, fmt, seconds=0.0, passes=0, note=""):
        """One ledger row (a dict; ledger_lines prints it, compare.json stores it)."""
        model.eval()
        loss, top1 = self.loss_and_top1(model)
        # top-1: the share of validation positions whose argmax is fp32's -- a finer
        # measure than Δ loss when the loss barely moves (int8)
        agree = sum(int((a == b).sum()) for a, b in zip(top1, self.ref_top1))
        greedy = [model.generate(p, self.args.new_tokens, temperature=0) for p in self.prompts]
        # greedy: the share of each continuation produced before the first divergence
        same = [_prefix(a, b) / len(b) for a, b in zip(greedy, self.ref_greedy)]
        q_bytes, q_params, total = model_bytes(model)
        ms, ref_ms = self.decode_ms(model)
        # No QuantLinear (fp32, pruned, fine-tuned rows): 32 bits, as the weights stay
        # dense fp32. ppl = e^loss, the loss being in nats.
        return dict(method=method, format=fmt,
                    bits_per_weight=8 * q_bytes / q_params if q_params else 32.0,
                    model_bytes=total, val_loss=loss, d_loss=loss - self.ref_loss,
                    ppl=math.exp(loss), top1=agree / sum(t.numel() for t in top1),
                    greedy=sum(same) / len(same), ms_per_token=ms, vs_fp32=ms / ref_ms,
                    calib_passes=passes, seconds=seconds, note=note)


def _prefix(a, b):
    """Length of the common prefix: greedy decoding diverges for good at the first miss."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


LEDGER_HEAD = ("| method | format | bits/weight | model bytes | val loss | Δ loss | ppl | "
               "top-1 = fp32 | greedy = fp32 | decode ms/tok | × fp32 | calib passes | s | "
               "note |")


def ledger_lines(rows):
    """Markdown lines: the head and its separator, then one line per row."""
    # 14 = the cells of LEDGER_HEAD: add a column to one and not the other and markdown
    # renders no table at all
    lines = [LEDGER_HEAD, "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['method']} | {r['format']} | {r['bits_per_weight']:.3f} | "
                     f"{fmt_bytes(r['model_bytes'])} | {r['val_loss']:.4f} | "
                     f"{r['d_loss']:+.4f} | {r['ppl']:.2f} | {r['top1']:.1%} | "
                     f"{r['greedy']:.1%} | {r['ms_per_token']:.2f} | {r['vs_fp32']:.2f} | "
                     f"{r['calib_passes']} | {r['seconds']:.1f} | {r['note']} |")
    return lines



class Table:
    """Prints the ledger row by row as the rows come (a long compare shows progress)."""

    def __init__(self, title):
        print0(f"\n{title}")
        # no rows: just the head and its separator, so the printed lines paste as markdown
        print0("\n".join(ledger_lines([])))
        self.rows = []

    def add(self, row):
        self.rows.append(row)
        # [-1]: the row's line without the head again
        print0(ledger_lines([row])[-1])



# ----------------------------------------------------------------------------------------
# The base model in, the result out: codes, scales and zeros as integer/fp16 tensors, the
# rest as plain tensors

def load_base(args):
    """-> (fp32 model, corpus, description). No --checkpoint and no out/ckpt.pt: a fresh tiny
    model, trained for --base-steps steps right here."""
    if args.ckpt is None and not os.path.exists(DEFAULT_CKPT):
        cfg = get_config("tiny")
        corpus = data.load_corpus(args.data, cfg.vocab_size)
        model = GPT(cfg, seed=args.seed)
        t0 = time.perf_counter()
        # lr 3e-3, 10x the QAT default: this trains from scratch, not a few steps of a
        # trained model. A barely trained model says little about what rounding costs.
        loss = finetune(model, corpus, args.base_steps, 3e-3, 16, cfg.block_size, args.seed)
        print0(f"no {DEFAULT_CKPT}: trained a fresh tiny model instead ({args.base_steps} steps"
               f" in {time.perf_counter() - t0:.0f} s, train loss {loss:.3f})")
        return model, corpus, f"fresh tiny model ({args.base_steps} steps)"
    path = args.ckpt or DEFAULT_CKPT
    model, ckpt = load_model(path, "cpu")          # a missing file: one clear UserError
    # load_model would hand back the dequantized weights: quantizing them again measures
    # the second rounding against a reference that is itself already quantized.
    if "quantization" in ckpt:
        raise UserError(f"{path} is already quantized: start from an fp32 checkpoint")
    data_path = args.data or (ckpt.get("args") or {}).get("data")
    corpus = data.load_corpus(data_path, model.config.vocab_size)
    # Another corpus gives another BPE: the ids would be tokens the model never learned,
    # and every loss in the ledger would be silently meaningless. Compare the merges.
    if data.encoding_from_state(ckpt["tokenizer"])._mergeable_ranks != corpus.enc._mergeable_ranks:
        raise UserError(f"{path}'s tokenizer is not the one of corpus "
                        f"{data_path or 'stdlib'}: pass the --data it was trained on")
    # whatever dtype the checkpoint holds, the reference every row is measured against is
    # fp32 (the GPT has no dropout, so eval() changes nothing today; it stays for safety)
    return model.float().eval(), corpus, path



def save_checkpoint(path, model, enc, meta, data_path):
    """A file torch.load(weights_only=True) reads: plain dicts, strings, numbers, tensors.
    With quantized layers: "quantization" (format + per-layer metadata) and "quantized"
    (name -> stored tensors); core/checkpoint.py's load_model hands such a file to
    core/quant_format.py's model_from_checkpoint."""
    quantized, layers = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            # clone: torch.save writes a tensor's whole underlying storage, so a copy keeps
            # the file to exactly the bytes the ledger counted
            quantized[name] = {k: v.clone() for k, v in m.stored().items()}
            # what model_from_checkpoint needs to dequantize without the quantizer's code;
            # act_bits = 8 marks W8A8, which it can only run weight-only
            layers[name] = dict(shape=list(m.shape), bits=m.bits, group_size=m.group_size,
                                act_bits=m.act_bits)
    # Everything but the quantized layers' buffers ("layers.0.attention.wq.codes" has the
    # module prefix "layers.0.attention.wq"): model_from_checkpoint loads "model" into a
    # plain GPT with a strict load_state_dict, which would refuse those keys as unexpected,
    # and they are in "quantized" already.
    plain = {k: v.clone() for k, v in model.state_dict().items()
             if k.rpartition(".")[0] not in quantized}
    # args.data: load_base (and serve.py) find the corpus the model was trained on from it
    ckpt = dict(config=asdict(model.config), model=plain, tokenizer=data.encoding_to_state(enc),
                args={"data": data_path})
    if quantized:
        ckpt["quantization"] = dict(format=FORMAT_VERSION, layers=layers, **meta)
        ckpt["quantized"] = quantized
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Write, then rename: os.replace is atomic on POSIX, so a crash mid-write leaves the old
    # checkpoint whole, never a truncated one that torch.load fails on.
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)



# ----------------------------------------------------------------------------------------
# The modes' commands (QAT and pruning: compression/qat.py, compression/prune.py)

def cmd_ptq(args, base, corpus, ev, table, int_mm_rows):
    """One PTQ method (rtn, gptq, awq, smoothquant): its ledger row; -> the model."""
    bits = args.bits
    # --group-size not given (None): 0 = per output row for int8, 32 for int4/int3
    g = default_group(bits, args.group_size)
    # RTN looks at the weights only: no calibration data, zero passes in the ledger
    calib = calibration(corpus, base, args, args.mode) if args.mode != "rtn" else []
    # smoothquant: its parser fixes bits, group_size = 8, 0 (it has no format flags)
    model, row = ptq_row(ev, base, args.mode, bits, g, calib, args, int_mm_rows)
    table.add(row)
    return model


def ptq_row(ev, base, method, bits, g, calib, opts, int_mm_rows=None):
    """ptq, then its ledger row. -> (model, row). The clock starts after the calibration
    batches are drawn: "s" is the method's own time."""
    t0 = time.perf_counter()
    model, passes, note = ptq(base, method, bits, g, calib, opts, int_mm_rows)
    # W8A8 (smoothquant) quantizes the activations too: "int8 per-row + int8 act"
    fmt = fmt_name(bits, g, 8 if method == "smoothquant" else 0)
    return model, ev.row(model, method, fmt, time.perf_counter() - t0, passes, note)


def cmd_compare(args, base, corpus, ev, table, int_mm_rows):
    """Every method on one table; -> None (compare writes its table, never a checkpoint).
    Rows: fp32 (main), then per bits rtn, gptq, gptq with the other group fit, gptq
    act-order, awq, awq by this repo's earlier rule (the variants at int4/int3 only);
    SmoothQuant; QAT with its controls; pruning -- tests/test_quantize.py counts them."""
    bits_list = bits_of(args)
    # One calibration set for all: GPTQ, AWQ, SmoothQuant and Wanda see the same tokens,
    # so the ledger compares the methods, not their samples.
    calib = calibration(corpus, base, args, "compare")
    for bits in bits_list:
        g = default_group(bits, args.group_size)
        # copies of args with options changed: each variant's row beside the default's
        act_order = variant(args, act_order=True)
        fit = variant(args, gptq_group_fit=other_fit(args.gptq_group_fit))
        awq_ours = variant(args, awq_objective="linear", awq_quantizer="stored")
        for method, opts in (("rtn", args), ("gptq", args), ("gptq", fit), ("gptq", act_order),
                             ("awq", args), ("awq", awq_ours)):
            # no variant row at int8 (per-row groups, near lossless already: nothing to
            # show), no act-order row when --act-order is given (the plain gptq row is
            # act-order already), no group-fit row where the two fits cannot differ (static
            # groups, or groups no smaller than the lazy block), no second AWQ row when the
            # flags already ask for the earlier rule
            if opts is not args and (bits == 8 or (opts is act_order and args.act_order)
                                     or (opts is fit and not fits_differ(args, bits, g))
                                     or (opts is awq_ours and not awq_default(args))):
                continue
            table.add(ptq_row(ev, base, method, bits, g, calib, opts)[1])
    # W8A8 once, whatever --bits-list says: it is int8 by construction. Only this row
    # gets int_mm_rows; the rows above are weight-only and never multiply integers.
    table.add(ptq_row(ev, base, "smoothquant", 8, 0, calib, args, int_mm_rows)[1])
    # QAT at the low bit widths only (int8 RTN loses ~nothing: no loss to recover), each
    # with STE and with LSQ
    for row, _ in qat.qat_rows(base, corpus, ev, [b for b in bits_list if b != 8],
                               [False, True], args, args.qat_steps):
        table.add(row)
    for row in prune.compare_rows(base, corpus, ev, calib, args):
        table.add(row)
    return None


def variant(args, **change):
    """A copy of the parsed flags with some of them changed (args itself stays as it is)."""
    return argparse.Namespace(**{**vars(args), **change})


def other_fit(fit):
    """The GPTQ group fit that is not `fit`: compare's second row."""
    return next(f for f in calibrated.GROUP_FITS if f != fit)


def fits_differ(args, bits, g):
    """Whether GPTQ's two group fits can give other weights: only when a group can start
    inside a lazy block (groups smaller than the block, no static groups)."""
    return not args.act_order and bits != 8 and 0 < g < args.block_size


def awq_default(args):
    """Whether the AWQ flags are llm-awq's (then compare adds a row with this repo's earlier
    rule, per-linear objective and stored quantizer, for the difference)."""
    return args.awq_objective == "module" and args.awq_quantizer == "llm-awq"


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables). Each mode takes the
# groups it reads (MODES below), so a flag shared by several modes is stated once here.

COMMON_KNOBS = [
    # --checkpoint as every script spells it; --ckpt, the old spelling, kept as an alias
    knob("--checkpoint --ckpt", None, f"fp32 checkpoint; not given: {DEFAULT_CKPT}, or a fresh "
         "tiny model trained here when that file does not exist", dest="ckpt"),
    knob("--data", None, "UTF-8 text the checkpoint was trained on (not given: what the "
         "checkpoint records, else the built-in corpus)"),
    knob("--base-steps", 600, "training steps of a fresh model"),
    knob("--calib-batches", 4, "calibration batches (train split)"),
    knob("--eval-batches", 8, "validation batches"),
    knob("--batch-size", 8, "rows per batch"),
    knob("--seq-len", 128, "tokens per row"),
    knob("--prompts", 16, "held-out prompts, greedy agreement"),
    knob("--prompt-len", 16, "tokens per prompt"),
    knob("--new-tokens", 32, "greedy tokens per prompt"),
    knob("--repeats", 3, "decode timing: best of this many"),
    knob("--seed", 0, "batches, prompts, the fresh model"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--save", "", "write the result to this checkpoint (read by "
         "core.checkpoint.load_model, serve.py, spec_decode.py)"),
    knob("--out-dir", "out/quantize", "compare: where the table goes"),
]

# --group-size has no default, not 0: 0 is a real choice (one group per row), and "not
# given" must resolve by bits (default_group)
FORMAT_KNOBS = [
    knob("--bits", 4, f"one of {SUPPORTED_BITS}"),
    knob("--group-size", int, "inputs per scale/zero; not given: 0 (one group per output "
         "row) for int8, 32 for int3/int4"),
]

# GPTQ's knobs, defaults as in its reference code: λ = 1% of the mean diagonal of H
# keeps the Cholesky factorisation defined when XX^T is singular (dead inputs, fewer
# tokens than inputs); 128 columns per lazy batch, as in Frantar et al. 2022 ("lazy
# batch-updates"). Raise --damp and GPTQ moves toward RTN (H toward a multiple of I).
# --gptq-group-fit: which weights a group inside a lazy block is fitted on
# (compression/calibrated.py, GROUP_FITS: the reference's block-start, or updated).
GPTQ_KNOBS = [
    knob("--damp", 0.01, "dampening λ = damp · mean(diag H)"),
    knob("--block-size", 128, "columns per lazy batch"),
    knob("--act-order", False, "columns by decreasing diag H"),
    knob("--gptq-group-fit", "block-start", "a group's scale/zero from the weights at its "
         "block's start (IST-DASLab/gptq) or as updated so far", choices=calibrated.GROUP_FITS),
]

# 20 grid points as llm-awq's auto_scale; α = 0 is plain RTN, so AWQ never scores worse
# than RTN on its own calibration sample. Objective and quantizer of the search: llm-awq's
# by default, this repo's earlier ones as options (calibrated.AWQ_OBJECTIVES).
AWQ_KNOBS = [
    knob("--grid", 20, "α grid points on [0, 1)"),
    knob("--awq-tokens", 0, "calibration tokens the search scores (0: all, as llm-awq)"),
    knob("--awq-objective", "module", "score α by the attention/MLP output (llm-awq) or by "
         "each linear's own", choices=calibrated.AWQ_OBJECTIVES),
    knob("--awq-quantizer", "llm-awq", "the search's rounding: llm-awq's min/max fp32, or the "
         "stored format's", choices=list(calibrated.AWQ_QUANTIZERS)),
]

# α = 0.5, the paper's default: the difficulty split evenly between activations and
# weights; α -> 1 moves more of the outliers into the weights
SMOOTHQUANT_KNOBS = [knob("--alpha", 0.5, "migration strength α")]

TRAINING_KNOBS = [knob("--lr", 3e-4, "QAT / fine-tuning learning rate")]

# The groups, under their --help headings; every mode takes the first
COMMON = "model, data and ledger"
KNOBS = {COMMON: COMMON_KNOBS, "format": FORMAT_KNOBS, "GPTQ": GPTQ_KNOBS, "AWQ": AWQ_KNOBS,
         "SmoothQuant": SMOOTHQUANT_KNOBS, "training": TRAINING_KNOBS}

# A mode's own knobs, listed under its "options" (not a group of their own)
QAT_KNOBS = [
    knob("--steps", 100, "QAT (and control) steps"),
    knob("--lsq", False, "learn the step sizes (LSQ)"),
]
# per-block: locuslab/wanda's prune_wanda (a block's statistics, then all of it pruned);
# per-stage re-collects after each pruned stage (compression/prune.py, SCHEDULES)
WANDA_SCHEDULE = knob("--wanda-schedule", "per-block", "Wanda's statistics: once a block, "
                      "or again after each stage", choices=list(prune.SCHEDULES))
PRUNE_KNOBS = [
    knob("--sparsity", 0.5, "fraction of zeros"),
    knob("--pattern", "unstructured", "per-row fraction, or 2 of every 4 inputs",
         choices=["unstructured", "2:4"]),
    knob("--criterion", "wanda", "|W|, or |W|·||X||", choices=["magnitude", "wanda"]),
    knob("--finetune-steps", 0, "masked fine-tuning"),
    WANDA_SCHEDULE,
]
# compare takes --bits-list instead of the format group's single --bits, so it states its
# own --group-size (the same default rule)
COMPARE_KNOBS = [
    knob("--bits-list", "8,4,3", "weight bits to compare"),
    knob("--group-size", int, "not given: 0 for int8, 32 for int3/int4"),
    knob("--qat-steps", 100, "QAT and fine-tuning steps"),
    WANDA_SCHEDULE,
]


# mode: (its command, its help, the KNOBS groups it reads besides COMMON, its own knobs).
# One signature for every command, so dispatch is a dict lookup; what each returns is the
# model --save writes (None for compare). RTN and the calibrated methods here, QAT and
# pruning in compression/qat.py and compression/prune.py.
MODES = {
    "rtn": (cmd_ptq, "round-to-nearest", ["format"], []),
    "gptq": (cmd_ptq, "GPTQ: column-by-column with error compensation", ["format", "GPTQ"], []),
    "awq": (cmd_ptq, "AWQ: activation-aware scales, then RTN", ["format", "AWQ"], []),
    # no format group: W8A8 fixes its format (int8, per row), set by build_parser
    "smoothquant": (cmd_ptq, "SmoothQuant: W8A8 (int8 weights and per-token int8 activations)",
                    ["SmoothQuant"], []),
    "qat": (qat.cmd_qat, "quantization-aware training vs PTQ and fp32 fine-tuning",
            ["format", "training"], QAT_KNOBS),
    "prune": (prune.cmd_prune, "magnitude or Wanda pruning, unstructured or 2:4", ["training"],
              PRUNE_KNOBS),
    "compare": (cmd_compare, "every method at --bits-list, QAT, pruning: one table",
                ["GPTQ", "AWQ", "SmoothQuant", "training"], COMPARE_KNOBS),
}


def build_parser():
    """One subcommand per mode, each with only the knob groups that mode reads."""
    p = ArgumentParser(description="Quantize or prune the GPT; a ledger of what each "
                       "method saves and costs.")
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (_, help, groups, own) in MODES.items():
        s = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        for title in [COMMON] + groups:
            add_knobs(s, KNOBS[title], title)
        add_knobs(s, own)
    # smoothquant's format is no flag: int8 weights, one scale per output row
    sub.choices["smoothquant"].set_defaults(bits=8, group_size=0)
    return p


def bits_of(args):
    """The weight bit widths this run will use: --bits, --bits-list, or none at all."""
    # prune's subcommand has no --bits (it keeps fp32 weights): nothing to check.
    # smoothquant has none either; its parser fixes bits = 8 (build_parser).
    if args.mode != "compare":
        return [args.bits] if hasattr(args, "bits") else []
    try:
        return [int(b) for b in args.bits_list.split(",")]
    except ValueError:
        raise UserError(f"--bits-list wants comma-separated integers, got {args.bits_list!r}")


def check_flags(args):
    """The flags' own ranges, one line each, before anything is loaded or trained."""
    # A 0 here would end as a ZeroDivisionError deep in the Evaluator (a mean over no
    # batches, no prompts, no new tokens): one clear error instead.
    require_at_least_one(args, ("eval_batches", "batch_size", "seq_len", "prompts",
                                "prompt_len", "new_tokens", "repeats", "base_steps"))
    for bits in bits_of(args):
        if bits not in SUPPORTED_BITS:
            raise UserError(f"--bits {bits} is not supported: choose one of {SUPPORTED_BITS}")
    # 0 steps is allowed (QAT then exports its initial fake-quantized weights); getattr
    # with a default because each subcommand defines only some of these flags
    for name in ("steps", "qat_steps", "finetune_steps", "calib_batches", "awq_tokens"):
        if getattr(args, name, 0) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0")
    if args.mode == "prune" and not 0 <= args.sparsity < 1:
        raise UserError(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if args.save and args.mode == "compare":
        raise UserError("compare writes its table to --out-dir; --save needs one method")


def check_shapes(args, model):
    """Everything that can be checked against the model's shapes, before any work."""
    for bits in bits_of(args):
        for _, lin in target_linears(model):
            check_format(bits, default_group(bits, args.group_size), lin.in_features)
    if args.mode == "prune":
        prune.check_prune(model, args.sparsity, args.pattern)
    # compare prunes 2:4 at 50% after minutes of other rows: check the shapes now
    if args.mode == "compare":
        prune.check_prune(model, 0.5, "2:4")


def write_compare(out_dir, command, source, seconds, rows):
    """compare's table: compare.json (every figure, the command, the base) and compare.md."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(dict(command=command, base=source, seconds=seconds, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write("\n".join(ledger_lines(rows)) + "\n")
    print0(f"wrote {out_dir}/compare.md and compare.json")


def save_result(args, model, enc):
    """--save: the mode's model, in the format core/checkpoint.py's load_model reads."""
    # prune has no --bits: its checkpoint is plain fp32 with zeros, no "quantization"
    # entry (save_checkpoint adds it only when there are QuantLinears)
    meta = dict(method=args.mode, bits=getattr(args, "bits", 32))
    save_checkpoint(args.save, model, enc, meta, args.data)
    print0(f"wrote {args.save}" + (" (W8A8: loaders get the int8 weights; activation "
           "quantization is quantize.py's own)" if args.mode == "smoothquant" else ""))


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_flags(args)
    # the ledger's title and compare.json name the command that made the numbers
    command = " ".join(["python quantize.py", *(sys.argv[1:] if argv is None else argv)])
    # One thread by default: the ms/token column is comparable across runs and machines,
    # and a shared CPU's other jobs disturb it less.
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    t_start = time.perf_counter()
    base, corpus, source = load_base(args)
    check_shapes(args, base)
    print0(f"base: {source} | {base.num_params():,} params, {len(target_linears(base))} "
           f"block linears | corpus {corpus.name} | {torch.get_num_threads()} thread(s)")
    ev = Evaluator(base, corpus, args)
    int_mm_rows = int_mm_decision(base) if args.mode in ("smoothquant", "compare") else None
    table = Table(f"ledger ({command}):")
    # The reference row checks the ledger itself: Δ loss 0, top-1 and greedy 100%,
    # × fp32 = 1.00. Anything else there means the Evaluator is not deterministic.
    with TimingConditions() as conditions:   # the load around every row's ms/token
        table.add(ev.row(base, "fp32", "fp32"))
        model = MODES[args.mode][0](args, base, corpus, ev, table, int_mm_rows)
    seconds = time.perf_counter() - t_start
    print0(f"total {seconds:.0f} s; timings: wall clock on this CPU")
    conditions.report(out=print0)              # one line when it was too busy to trust them
    if args.mode == "compare":
        write_compare(args.out_dir, command, source, seconds, table.rows)
    if args.save:
        save_result(args, model, corpus.enc)
    return table.rows


if __name__ == "__main__":
    run_cli(main)
