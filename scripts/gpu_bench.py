"""
scripts/gpu_bench.py -- one command, one table: what the scripts achieve on this machine's GPU.

Run:  python -m scripts.gpu_bench                    # one GPU, ~100M parameters (< 6 min?)
      python -m scripts.gpu_bench --device cpu --tiny   # the same code at toy size (its test)

Every figure the README explains on 2 CPU cores, measured where the users run:
  train    train.py's step (train_step: AdamW, clipping) at ~100M parameters (16 layers,
           d = 768, GQA 12/4 heads, 1024 tokens), fp32, fp8 tensorwise (training/fp8.py:
           torch._scaled_mm on the fp8 tensor cores) and bf16 autocast: tokens/s and
           MFU = FLOPs/token (6·N + 12·L·d·T, PaLM app. B) × tokens/s ÷ the GPU's dense
           bf16 peak (meters.gpu_peak_flops); next to it the memory ledger: model state
           (measured == 16 B/param), activations counted by saved-tensor hooks, and the
           allocator's torch.cuda.max_memory_allocated.
  decode   generate() at batch 1 on the trained model in bf16: ms per token, and the bytes a
           token must read (every weight but the embedding table, plus the K/V of the
           context) ÷ that time = achieved bandwidth, as a fraction of the GPU's peak HBM
           bandwidth (the roofline: a batch-1 decode step is memory-bound, so the peak is
           the bound; Python and kernel-launch overhead is what keeps it below).
  serve    scripts/serve_bench.py on one workload: sequential generate() vs static batching vs the
           engine (continuous batching, paged KV): output tokens/s, and whether the greedy
           outputs equal sequential generate()'s.
  spec     spec_decode.py's drafters at T = 0, batch 1 (the draft model, its tree, Medusa,
           MTP, EAGLE, DFlash, trained here on the target's own outputs): tokens/s vs plain
           greedy decoding, acceptance α, and outputs == greedy. On the CPU a target pass
           over γ+1 tokens costs ~1.35× one token; on a GPU it should cost ~1× (memory-bound),
           so the speedups test that explanation.
The target is trained here first (--learn-steps on the built-in corpus) so that drafters
have something to learn and decoding produces text, not noise. Sub-benchmarks' own output
goes to <out-dir>/*.log; the table is printed and written to <out-dir>/table.txt.
"""
import contextlib
import copy
import os
import time
import types
from dataclasses import asdict

import torch

from core import data
import optim
from scripts import serve_bench
import spec_decode as sd
import train
from model import GPT, KVCache, get_config
from training import fp8
from core.cli import command_line, fmt_bytes, fmt_count, knob
from core.errors import UserError
from core.meters import gpu_peak_flops, model_state_bytes, StepTimer
from core.runtime import pick_device, run_cli, seed_everything, TimingConditions

# Peak HBM/GDDR bandwidth (bytes/s) from the vendors' data sheets; the first key found in
# torch.cuda.get_device_name() wins (so the specific names come before the general ones).
GPU_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                      "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12,
                      "A100": 1.555e12, "L4": 300e9, "4090": 1.008e12}

# the target (and the draft model) and the train batch: ~100M parameters, or toy size
SIZES = {"full": dict(n_layer=16, n_embd=768, n_head=12, n_kv_head=4, block_size=1024,
                      batch=16, seq=1024, vocab=4096, draft_layers=2, draft_embd=256),
         "tiny": dict(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, block_size=64,
                      batch=4, seq=64, vocab=512, draft_layers=1, draft_embd=32)}


def peak_bandwidth(device):
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in GPU_PEAK_BANDWIDTH.items() if key in name), None)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def memory_peak(device):
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def reset_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------------------
# train: timed steps of train.train_step, fp32 and bf16 autocast; the bf16 run goes on
# learning and becomes the target of the decode, serve and spec rows

def train_args(precision, size, lr):
    return train.parse_args(["--precision", precision, "--attn", "sdpa", "--lr", str(lr),
                             "--batch-size", str(size["batch"]), "--seq-len", str(size["seq"]),
                             "--warmup-steps", "20", "--grad-clip", "1.0"])


def timed_steps(model, opt, corpus, args, device, first, n, measure=True):
    """n optimizer steps on the corpus from step `first` (train.py's schedule and batches);
    -> (median seconds per step, last loss, activation bytes of a step, model-state bytes
    with the gradients still held, peak allocated bytes since the first step or None)."""
    if measure:
        reset_memory(device)
    seconds, loss, act, state = [], 0.0, 0, None
    for step in range(first, first + n):
        optim.set_lr(opt, train.learning_rate(step, args))
        batches = train.micro_batches(corpus, args, step, device)
        with StepTimer(device) as timer:
            loss, act, _ = train.train_step(train.Trainer(model, opt), batches, args, device)
        if measure:
            state = model_state_bytes(model, opt)
        model.zero_grad(set_to_none=True)
        seconds.append(timer.seconds)
    peak = memory_peak(device) if measure else None
    return sorted(seconds)[len(seconds) // 2], loss, act, state, peak


def train_row(label, model, args, device, timed):
    secs, _, act, state, peak = timed
    tokens = args.batch_size * args.seq_len
    n = model.num_params()
    flops = model.flops_per_token(args.seq_len) * tokens / secs
    top = gpu_peak_flops(device)
    mfu = f"MFU {100 * flops / top:.1f}% of bf16 peak" if top else \
        f"{fmt_count(flops)}FLOP/s (no peak known)"
    state_total = state["total"] - state["opt_scalars"]
    mem = (f"state {fmt_bytes(state_total)} = {state_total / n:.1f} B/param, act "
           f"{fmt_bytes(act)} (hooks)") + (f", max allocated {fmt_bytes(peak)}" if peak else "")
    return (label, f"{fmt_count(tokens / secs)} tok/s", mfu, f"{secs * 1e3:.0f} ms/step; {mem}")


def bench_train(size, corpus, device, learn_steps, timed, log):
    cfg = get_config("small", vocab_size=corpus.enc.n_vocab, **{k: size[k] for k in (
        "n_layer", "n_embd", "n_head", "n_kv_head", "block_size")})
    dcfg = get_config("draft", vocab_size=corpus.enc.n_vocab, block_size=size["block_size"],
                      n_layer=size["draft_layers"], n_embd=size["draft_embd"])
    rows = []
    # fp32: a short run from a fresh model, timed, then thrown away (TF32 off: torch's default)
    seed_everything(0)
    model = GPT(cfg, seed=0).to(device)
    args = train_args("fp32", size, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    timed_steps(model, opt, corpus, args, device, 0, 2)                  # warm-up
    rows.append(train_row("train fp32", model, args, device,
                          timed_steps(model, opt, corpus, args, device, 2, timed)))
    del model, opt
    # fp8 tensorwise (training/fp8.py): the blocks' linears on e4m3/e5m2 copies, the rest in
    # fp32 -- on an H100 the matmuls go to torch._scaled_mm's fp8 tensor cores
    model = GPT(cfg, seed=0).to(device)
    fp8.convert_to_fp8(model, "tensorwise")
    args = train_args("fp8", size, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    timed_steps(model, opt, corpus, args, device, 0, 2)                  # warm-up
    rows.append(train_row("train fp8 tensorwise", model, args, device,
                          timed_steps(model, opt, corpus, args, device, 2, timed)))
    del model, opt
    # bf16 autocast: warm-up, timed, then learning on; the draft model learns alongside
    model = GPT(cfg, seed=0).to(device)
    draft = GPT(dcfg, seed=1).to(device)
    args = train_args("autocast-bf16", size, 1e-3)
    args.steps = learn_steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    dopt = torch.optim.AdamW(draft.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    timed_steps(model, opt, corpus, args, device, 0, 2)
    rows.append(train_row("train autocast-bf16", model, args, device,
                          timed_steps(model, opt, corpus, args, device, 2, timed)))
    t0, loss = time.perf_counter(), float("nan")
    for step in range(learn_steps):
        if step >= 2 + timed:
            loss = timed_steps(model, opt, corpus, args, device, step, 1, measure=False)[1]
        timed_steps(draft, dopt, corpus, args, device, step, 1, measure=False)
        if step % 50 == 0 or step == learn_steps - 1:
            print(f"learn step {step} | target loss {loss:.3f}", file=log, flush=True)
    print(f"learnt {learn_steps} steps in {time.perf_counter() - t0:.0f} s, final loss "
          f"{loss:.3f}", file=log, flush=True)
    return rows, model.eval(), draft.eval(), loss


# ----------------------------------------------------------------------------------------
# decode: batch 1, bf16 weights; the roofline's bytes per token

def bench_decode(target, corpus, device, n_tokens, repeats=3):
    """generate()'s decode step, timed alone: the prompt is prefilled into a KVCache, then
    n_tokens steps of one token each (greedy), synchronised before and after."""
    model = copy.deepcopy(target)
    for p in model.parameters():          # weights only: the RoPE tables stay fp32
        p.data = p.data.to(torch.bfloat16)
    cfg = model.config
    prompt = torch.from_numpy(corpus.val[:min(32, cfg.block_size // 4)].astype("int64"))
    n_tokens = min(n_tokens, cfg.block_size - len(prompt) - 1)

    @torch.no_grad()
    def once():
        cache = KVCache(cfg, 1, len(prompt) + n_tokens + 1, device=device, dtype=torch.bfloat16)
        nxt = model(prompt[None].to(device), cache=cache)[0][:, -1].argmax(-1)
        sync(device)
        t = time.perf_counter()
        for _ in range(n_tokens):
            nxt = model(nxt[:, None], cache=cache)[0][:, -1].argmax(-1)
        sync(device)
        return (time.perf_counter() - t) / n_tokens
    once()                                                # warm-up: kernels, allocator
    per_token = min(once() for _ in range(repeats))
    # a decode step reads every weight once (the embedding table only one row of it; a tied
    # head is the same tensor, counted once) plus the K/V of its context
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_embeddings:
        emb = model.tok_embeddings.weight
        weights -= emb.numel() * emb.element_size()
    context = len(prompt) + n_tokens / 2
    kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 2 * context
    achieved = (weights + kv) / per_token
    peak = peak_bandwidth(device)
    vs = f"{100 * achieved / peak:.1f}% of HBM peak {peak / 1e12:.2f} TB/s" if peak else \
        "peak bandwidth unknown"
    return [("decode B=1 bf16", f"{per_token * 1e3:.2f} ms/token", vs,
             f"{fmt_bytes(weights)} weights + {fmt_bytes(kv)} KV per token at context "
             f"{context:.0f} = {achieved / 1e9:.1f} GB/s")]


# ----------------------------------------------------------------------------------------
# serve: scripts/serve_bench.py (its command line), on a checkpoint of the target

def bench_serve(target, corpus, device, out_dir, tiny, log):
    path = os.path.join(out_dir, "target.pt")
    torch.save(dict(config=asdict(target.config), model=target.state_dict(),
                    tokenizer=data.encoding_to_state(corpus.enc)), path)
    argv = ["--checkpoint", path, "--device", str(device), "--threads", "0",
            "--repeats", "1", "--seed", "0"]
    argv += (["--num-requests", "4", "--prompt-len", "4:16", "--output-len", "4:12",
              "--block-size", "4", "--num-blocks", "80", "--max-num-batched-tokens", "32",
              "--static-batch", "4", "--clock", "cpu"] if tiny else
             ["--num-requests", "64", "--prompt-len", "32:256", "--output-len", "32:256",
              "--block-size", "16", "--num-blocks", "2048", "--max-num-batched-tokens",
              "2048", "--static-batch", "16"])
    with contextlib.redirect_stdout(log):
        rows, outs, _ = serve_bench.main(argv)
    base = rows[0][1]["tok_s"]
    table = []
    for (name, s), key in zip(rows, outs):
        same = sum(a == b for a, b in zip(outs[key], outs["sequential"]))
        table.append((f"serve {name}", f"{s['tok_s']:.0f} out tok/s", f"{s['tok_s'] / base:.2f}x "
                      f"sequential", f"greedy == sequential {same}/{len(outs[key])}; wall "
                      f"{s['wall']:.2f} s"))
    return table


# ----------------------------------------------------------------------------------------
# spec: every drafter, trained here on the target's own outputs, at T = 0, batch 1

def bench_spec(target, draft, corpus, device, tiny, methods, train_steps, log):
    pool_n, seq, new, n_prompts = (16, 24, 8, 2) if tiny else (384, 96, 128, 4)
    gamma = 4
    with contextlib.redirect_stdout(log):
        pool = sd.distill_pool(target, corpus, pool_n, seq, prompt_len=8 if tiny else 16)
        feature = {"medusa": lambda: sd.MedusaHeads(target, gamma),
                   "mtp": lambda: sd.FeatureDrafter(target, "mtp"),
                   "eagle": lambda: sd.FeatureDrafter(target, "eagle"),
                   "dflash": lambda: sd.DFlashDrafter(target, gamma + 1)}
        todo = {m: feature[m]().to(device) for m in methods if m in feature}
        drafters = sd.train_drafters(todo, target, pool, train_steps, 8, 3e-3) if todo else {}
    drafters.update({m: sd.ModelDrafter(draft) for m in methods if m in ("draft", "tree")})
    plen = min(32, target.config.block_size // 4)
    prompts = [corpus.val[i * 997:i * 997 + plen].astype("int64").tolist()
               for i in range(n_prompts)]
    run = types.SimpleNamespace(repeats=1 if tiny else 2, max_new_tokens=new, seed=0)
    for m in methods:                     # warm-up: first calls allocate and dispatch
        sd.run_method(target, drafters[m], [prompts[:1]], run, 0.0, gamma,
                      sd.DEFAULT_WIDTH.get(m, 1))
    entries = [(m, drafters[m], gamma, sd.DEFAULT_WIDTH.get(m, 1)) for m in methods]
    plain, *rows = sd.compared(target, entries, [[p] for p in prompts], run, 0.0)
    table = []
    for (m, _, _, width), row in zip(entries, rows):     # one plain baseline for all rows
        table.append((f"spec {m} γ={gamma} w={width}", f"{row['tps']:.0f} tok/s",
                      f"{row['speedup']:.2f}x plain ({plain['tps']:.0f} tok/s)",
                      f"α {row['alpha']:.2f}, τ {row['tau']:.2f} tokens/call, == greedy "
                      f"{row['same']}"))
    return table


# ----------------------------------------------------------------------------------------
# the table: every section's rows under one header, printed and written to table.txt

def run_sections(args, size, device, t0):
    """train (always: it makes the target), then decode, serve and spec unless --skip;
    sub-benchmarks' output goes to <out-dir>/bench.log. -> (rows, the target)."""
    corpus = data.load_corpus(args.data, vocab_size=size["vocab"])
    skip = args.skip
    with open(os.path.join(args.out_dir, "bench.log"), "w") as log:
        rows, target, draft, loss = bench_train(size, corpus, device, args.learn_steps,
                                                args.timed_steps, log)
        print(f"[{time.perf_counter() - t0:.0f} s] train done (target loss {loss:.3f})",
              flush=True)
        if "decode" not in skip:
            rows += bench_decode(target, corpus, device, args.decode_tokens)
        if "serve" not in skip:
            rows += bench_serve(target, corpus, device, args.out_dir, args.tiny, log)
            print(f"[{time.perf_counter() - t0:.0f} s] serve done", flush=True)
        if "spec" not in skip and args.spec_methods:
            rows += bench_spec(target, draft, corpus, device, args.tiny, args.spec_methods,
                               args.spec_train_steps, log)
    return rows, target


def header(device, target, size):
    """The table's first line: the device and its peaks, the target's size, the batch."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        top, bw = gpu_peak_flops(device), peak_bandwidth(device)
        peaks = (f"peak bf16 {top / 1e12:.0f} TFLOP/s" if top else "bf16 peak unknown") + ", " + \
            (f"HBM {bw / 1e12:.2f} TB/s" if bw else "bandwidth unknown")
    else:
        name, peaks = f"CPU, {torch.get_num_threads()} thread(s)", "no peaks for a CPU"
    return (f"gpu_bench: {name} ({peaks}); torch {torch.__version__}; target "
            f"{target.num_params() / 1e6:.1f}M params ({size['n_layer']} layers, d="
            f"{size['n_embd']}, {size['n_head']}/{size['n_kv_head']} heads, vocab "
            f"{target.config.vocab_size}), train batch {size['batch']}×{size['seq']} tokens")


def write_table(rows, head, out_dir, t0, warning=None):
    """The rows under the header, printed and written to <out-dir>/table.txt; `warning`:
    core.runtime.TimingConditions' line when the machine was too busy to trust the times."""
    widths = (28, 16, 34)
    lines = [head,
             f"{'row':<{widths[0]}} {'measured':>{widths[1]}}  {'against':<{widths[2]}}  detail"]
    lines += [f"{a:<{widths[0]}} {b:>{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    lines.append(f"total {time.perf_counter() - t0:.0f} s; sub-benchmark output in "
                 f"{os.path.join(out_dir, 'bench.log')}")
    lines += [warning] if warning else []
    print("\n".join(lines), flush=True)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------
# The command line: a row per knob (core/cli.py makes the flags and --help from it); the
# knobs whose default depends on --tiny have none here, parse_args fills them in

KNOBS = [
    knob("--device", "auto", "auto, cuda or cpu (default: auto)"),
    knob("--tiny", False, "toy sizes (the CPU test of this file)"),
    knob("--data", None, "text file (default: the built-in corpus)"),
    knob("--threads", 0, "torch CPU threads (default: 0 = torch's own; 1 is steadier on a "
         "busy CPU)"),
    knob("--batch-size", int, "train sequences per step (default: 16 of 1024 tokens; tiny 4 "
         "of 64; lower it on a 24 GB GPU)"),
    knob("--learn-steps", int, "steps the target learns before decoding (default: 300, tiny "
         "8)"),
    knob("--timed-steps", int, "timed train steps per row, median kept (default: 10, tiny 2)"),
    knob("--decode-tokens", int, "tokens of the batch-1 decode (default: 256, tiny 8)"),
    knob("--spec-methods", "draft,tree,medusa,mtp,eagle,dflash", "drafters of the spec rows, "
         "'' = none (default: all six)"),
    knob("--spec-train-steps", int, "drafter training steps (default: 400, tiny 5)"),
    knob("--skip", "", "comma-separated sections to skip: decode, serve, spec; train always "
         "runs, it makes the target (default: none)"),
    knob("--out-dir", "out/gpu_bench", "logs, checkpoint, table.txt (default: out/gpu_bench)"),
]


def parse_args(argv=None):
    args = command_line("The GPU table: train tokens/s and MFU, decode bandwidth, serving, "
                        "speculative decoding, in one run.", {None: KNOBS}).parse_args(argv)
    tiny = args.tiny
    for name, full, toy in (("learn_steps", 300, 8), ("timed_steps", 10, 2),
                            ("decode_tokens", 256, 8), ("spec_train_steps", 400, 5)):
        if getattr(args, name) is None:
            setattr(args, name, toy if tiny else full)
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    args.learn_steps = max(args.learn_steps, args.timed_steps + 2)
    args.skip = {part for part in args.skip.split(",") if part}
    if args.skip - {"decode", "serve", "spec"}:
        raise UserError(f"--skip takes decode, serve, spec; got {args.skip}")
    args.spec_methods = [m for m in args.spec_methods.split(",") if m]
    for m in args.spec_methods:
        if m not in sd.METHODS:
            raise UserError(f"unknown spec method {m!r}: choose from {', '.join(sd.METHODS)}")
    return args


def main(argv=None):
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
        raise UserError(f"scripts/gpu_bench.py requires torch >= 2.11, found {torch.__version__}")
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    size = dict(SIZES["tiny" if args.tiny else "full"])
    size["batch"] = args.batch_size or size["batch"]
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    # the load as the first section starts and the last ends (a GPU's times suffer from a
    # busy host too: every kernel is launched from Python on the CPU)
    with TimingConditions() as conditions:
        rows, target = run_sections(args, size, device, t0)
    write_table(rows, header(device, target, size), args.out_dir, t0, conditions.verdict())
    return rows


if __name__ == "__main__":
    run_cli(main)
