"""
scripts/mla_bench.py -- what multi-head latent attention (core/mla.py) saves and costs,
measured: KV bytes per token from the real caches (model.KVCache and the paged pool of
kvcache.py, fp32 and int8) next to the formula, and decode time per step for MHA, GQA and
MLA on both of its paths (absorbed and unabsorbed), with the multiply-adds and bytes a
decode step spends per cached token.

    python -m scripts.mla_bench [--preset small] [--context 192] [--new-tokens 32]

A harness over model.py and kvcache.py (an entry point; nothing imports it).
"""
import torch

from core.mla import mla_dims, set_absorb
from core.cli import command_line, fmt_bytes, knob
from core.errors import UserError
from core.meters import StepTimer
from core.runtime import pick_device, run_cli, TimingConditions
from kvcache import PagedKVCache
from model import GPT, KVCache, get_config


# ----------------------------------------------------------------------------------------
# The ledger: KV bytes per token from the caches, decode time per token

def formula_bytes_per_token(cfg, value_bytes, scale_bytes=0):
    """The cache's bytes per token: L · heads · (key width + value width) · bytes, plus an
    int8 cache's fp32 scale per (token, head) for its keys and for its values.
    MLA: (d_c + d_R)·L·bytes; GQA/MHA: 2·n_kv·d_h·L·bytes."""
    heads, k_dim, v_dim = cfg.kv_cache_dims
    return cfg.n_layer * heads * ((k_dim + v_dim) * value_bytes + 2 * scale_bytes)


def measured_bytes_per_token(cfg, kv_dtype):
    """Bytes per token of the real caches: model.KVCache (fp32 only) and the paged pool."""
    paged = PagedKVCache(cfg, num_blocks=4, block_size=16, kv_dtype=kv_dtype)
    dense = KVCache(cfg, batch_size=1, max_len=64).nbytes // 64 if kv_dtype == "float32" else None
    return dense, paged.bytes_per_token


def attention_params(model):
    return sum(p.numel() for p in model.layers[0].attention.parameters())


def bench_configs(args):
    """MHA, GQA and MLA at the preset's width. MLA defaults to DeepSeek-V2's proportions:
    d_c = 4·d_h, d_R = d_h/2."""
    base = get_config(args.preset)
    d_h = base.head_dim
    # a longer context than the preset's only lengthens the RoPE table (random weights)
    block = max(base.block_size, args.context + args.new_tokens)
    return {
        "MHA": get_config(args.preset, n_kv_head=base.n_head, block_size=block),
        f"GQA {args.gqa_kv_heads} kv heads": get_config(args.preset, block_size=block,
                                                        n_kv_head=args.gqa_kv_heads),
        "MLA": get_config(args.preset, kv_lora_rank=args.kv_lora_rank or 4 * d_h,
                          qk_rope_head_dim=args.rope_dim or d_h // 2,
                          q_lora_rank=args.q_lora_rank, block_size=block),
    }


def print_bytes_table(configs):
    print("KV cache bytes per token (all layers), measured from the caches vs the formula:")
    print(f"{'config':<18}{'attn params/layer':>18}{'formula fp32':>14}{'KVCache':>10}"
          f"{'paged fp32':>12}{'formula int8':>14}{'paged int8':>12}")
    rows = {}
    for name, cfg in configs.items():
        model = GPT(cfg, seed=0)
        dense, paged = measured_bytes_per_token(cfg, "float32")
        _, paged8 = measured_bytes_per_token(cfg, "int8")
        want, want8 = formula_bytes_per_token(cfg, 4), formula_bytes_per_token(cfg, 1, 4)
        rows[name] = dict(formula=want, dense=dense, paged=paged, formula_int8=want8,
                          paged_int8=paged8, attn_params=attention_params(model))
        print(f"{name:<18}{rows[name]['attn_params']:>18,}{want:>14,}{dense:>10,}{paged:>12,}"
              f"{want8:>14,}{paged8:>12,}")
    return rows


@torch.no_grad()
def decode_seconds(model, prompt, new_tokens):
    """Prefill the prompt into a fresh KVCache, then time `new_tokens` greedy decode
    steps. -> (seconds per decoded token, the tokens)."""
    device = prompt.device
    cache = KVCache(model.config, prompt.shape[0], prompt.shape[1] + new_tokens,
                    device=device)
    logits, _ = model(prompt, cache=cache)
    tokens = [logits[:, -1].argmax(-1, keepdim=True)]
    with StepTimer(device) as timer:
        for _ in range(new_tokens):
            logits, _ = model(tokens[-1], cache=cache)
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return timer.seconds / new_tokens, torch.cat(tokens, dim=1)


def macs_per_cached_token(cfg, absorb=None):
    """Multiply-adds one decoded query spends per cached token per layer: scores plus
    weighted sum, H·(d_k + d_v) -- GQA/MHA H·2·d_h; absorbed MLA H·(d_c + d_R + d_c);
    unabsorbed MLA also up-projects the token's latent, d_c·H·(d_nope + d_v)."""
    H = cfg.n_head
    if not cfg.mla:
        return H * 2 * cfg.head_dim
    d = mla_dims(cfg)
    if absorb:
        return H * (2 * d["d_c"] + d["d_rope"])
    return d["d_c"] * H * (d["d_nope"] + d["d_v"]) + H * (d["d_nope"] + d["d_rope"] + d["d_v"])


def print_decode_table(configs, args, device, conditions=None):
    """Decode time per step, best of `repeats` runs, the runs of all rows alternated; next
    to it what one step does per cached token and layer: multiply-adds and KV bytes read
    (their ratio: the arithmetic intensity that decides CPU vs bandwidth-bound GPU). Then
    one warning line when core.runtime.TimingConditions (None: the machine's own) doubts
    the times."""
    conditions = conditions or TimingConditions()
    runs, costs = {}, {}
    for name, cfg in configs.items():
        paths = (("absorbed", True), ("unabsorbed", False)) if cfg.mla else (("", None),)
        for path, absorb in paths:           # the same weights (seed 0) on both MLA rows
            model = GPT(cfg, seed=0).to(device).eval()
            label = f"{name} {path}".strip()
            runs[label] = set_absorb(model, absorb) if cfg.mla else model
            costs[label] = (macs_per_cached_token(cfg, absorb),
                            formula_bytes_per_token(cfg, 4) // cfg.n_layer)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(configs["MHA"].vocab_size, (args.batch_size, args.context),
                           generator=gen).to(device)
    timed, outs = {k: [] for k in runs}, {}
    with conditions:                      # the load as the first run starts, the last ends
        for repeat in range(args.repeats + 1):             # round 0 warms up, not counted
            for label, model in runs.items():
                seconds, outs[label] = decode_seconds(model, prompt, args.new_tokens)
                if repeat:
                    timed[label].append(seconds)
    best = {k: min(v) for k, v in timed.items()}
    same = torch.equal(outs["MLA absorbed"], outs["MLA unabsorbed"])
    ref = next(k for k in runs if k.startswith("GQA"))
    print(f"\ndecode time per step (one token for each of {args.batch_size} sequence(s)) on "
          f"{device}, {args.threads} thread(s), {args.context} tokens of context, "
          f"{args.new_tokens} steps, best of {args.repeats}; MLA absorbed and unabsorbed "
          f"decode the same tokens: {'yes' if same else 'NO'}")
    print(f"{'path':<18}{'ms/step':>9}{'vs ' + ref:>20}{'MAC/cached tok/layer':>22}"
          f"{'KV B read':>11}{'MAC/B':>7}")
    for label in runs:
        macs, nbytes = costs[label]
        print(f"{label:<18}{best[label] * 1e3:>9.2f}{best[label] / best[ref]:>19.2f}x"
              f"{macs:>22,}{nbytes:>11,}{macs / nbytes:>7.1f}")
    conditions.report(timed)
    return best, same


# ----------------------------------------------------------------------------------------
# The command line: a row per knob (core/cli.py makes the flags and --help from it)

KNOBS = [
    knob("--preset", "small", "model size (model.PRESETS)"),
    knob("--kv-lora-rank", 0, "d_c; 0 = 4 x head_dim"),
    knob("--rope-dim", 0, "d_R; 0 = head_dim / 2"),
    knob("--q-lora-rank", 0, "0 = queries straight from x"),
    knob("--gqa-kv-heads", 2, "the GQA row's kv heads"),
    knob("--batch-size", 1, "sequences decoded together"),
    knob("--context", 192, "prompt tokens before decoding (past the preset's block size: the "
         "RoPE table grows)"),
    knob("--new-tokens", 32, "decode steps timed"),
    knob("--repeats", 3, "timed runs per row (best kept)"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--device", "cpu", "cpu, cuda or auto"),
    knob("--seed", 0, "prompt seed"),
]


def parse_args(argv=None):
    args = command_line("Multi-head latent attention, measured: KV bytes per token and "
                        "decode time, against MHA and GQA.", {None: KNOBS}).parse_args(argv)
    for name in ("batch_size", "context", "new_tokens", "repeats", "threads", "gqa_kv_heads"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.kv_lora_rank, args.rope_dim, args.q_lora_rank) < 0:
        raise UserError("--kv-lora-rank, --rope-dim and --q-lora-rank must be >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    configs = bench_configs(args)
    cfg = configs["MLA"]
    print(f"preset {args.preset}: {cfg.n_layer} layers, {cfg.n_head} heads of d_h = "
          f"{cfg.head_dim}; MLA d_c = {cfg.kv_lora_rank}, d_R = {cfg.qk_rope_head_dim}, "
          f"q_lora_rank = {cfg.q_lora_rank}")
    rows = print_bytes_table(configs)
    mla, mha = rows["MLA"]["formula"], rows["MHA"]["formula"]
    per_layer = mla / (4 * cfg.n_layer * 2 * cfg.head_dim)
    print(f"MLA caches {fmt_bytes(mla)}/token: {mha / mla:.2f}x less than MHA, the size of "
          f"GQA with {per_layer:.2f} kv heads")
    best, same = print_decode_table(configs, args, device)
    return dict(bytes=rows, decode=best, same_tokens=same)


if __name__ == "__main__":
    run_cli(main)
