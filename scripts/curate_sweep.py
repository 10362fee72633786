"""
scripts/curate_sweep.py -- what curation does to what the model learns:

    python -m scripts.curate_sweep [--steps 1500] [--subset 0.1]

An entry point in scripts/ (nothing imports it), built on curate.py: curate.py decides what goes
into the corpus (domains,
dedup, quality rules) and scripts/curate_mix.py in what proportions; this file trains the tiny
model briefly on several mixtures, and on deduplicated vs raw data, at the same token
budget, and reports the validation loss PER DOMAIN (nats/token and bits/byte, one
tokenizer for every run) -- the table that shows mixing is a trade-off (what one domain
gains, another loses) and what duplicates cost (the loss of repeated documents falls:
memorised, not learnt). A second seed of the same run is the noise floor every
difference is read against.

The training loop here is ~30 lines of plain AdamW on purpose: train.py reads one corpus
file and carries data parallelism and checkpoints that a sweep of short runs does not need.
"""
import json
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

import curate
from scripts import curate_mix
from core import data
from model import GPT, get_config
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import run_cli, seed_everything


def split_by_cluster(docs: list[curate.Document], clusters: list[list[int]], args) -> dict:
    """Whole near-dup clusters, never single copies: a seeded --subset of each domain's
    clusters (so the domains keep their natural sizes and duplicates their share), a val
    set such that no near-copy of a val document is trained on (raw data would otherwise
    look better on val by memorizing). Each domain keeps >= 1 val cluster. Returns
    documents: raw train (every copy), dedup train (one per cluster), val (one per
    cluster), and the train representatives repeated in the raw data vs unique ones."""
    members = {i: [i] for i in range(len(docs))}
    for c in clusters:
        for i in c:
            members[i] = c
    reps = {min(m, key=lambda i: curate.canonical(docs[i])): m for m in members.values()}
    score = {r: curate.stable_unit(args.seed, "split", docs[r].domain, docs[r].path) for r in reps}
    # the synthetic domain's size is set by --arith-docs, not by the subset
    chosen = [r for r in sorted(reps) if score[r] < args.subset or docs[r].domain == "arith"]
    val = set()
    for r in chosen:  # val: a hash-chosen share of the clusters, independent of the subset
        if curate.stable_unit(args.seed, "val", docs[r].domain, docs[r].path) < args.val_fraction:
            val.add(r)
    for domain in {docs[r].domain for r in chosen}:
        mine = [r for r in chosen if docs[r].domain == domain]
        if not val.intersection(mine):
            val.add(mine[-1])
    train = sorted(r for r in chosen if r not in val)
    return {"raw": [docs[i] for r in train for i in sorted(reps[r])],
            "dedup": [docs[r] for r in train],
            "val": [docs[r] for r in sorted(val)],
            "repeated": [docs[r] for r in train if len(reps[r]) > 1],
            "unique": [docs[r] for r in train if len(reps[r]) == 1]}


def token_stream(token_lists: list[list[int]], eot: int) -> np.ndarray:
    ids = []
    for toks in token_lists:
        ids.extend(toks)
        ids.append(eot)
    return np.array(ids, dtype=np.uint16)


def train_on(stream: np.ndarray, cfg, args, seed: int) -> GPT:
    """A plain loop (AdamW, warmup + cosine, clipping), written here because train.py's
    loop reads one corpus file and brings its distributed machinery; this one reads a
    token array. One pass over the stream in seeded order, windows not overlapping:
    every token of the mixture is seen once (random windows would repeat some)."""
    seed_everything(seed)
    model = GPT(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    seq, batch = cfg.block_size, args.batch_size
    order = np.random.default_rng([seed, 3]).permutation((len(stream) - 1) // seq)
    if len(order) < args.steps * batch:
        raise UserError(f"the mixture has {len(order)} windows, the run needs {args.steps * batch}")
    warmup = max(1, args.steps // 20)
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine to lr/10
        for group in opt.param_groups:
            group["lr"] = lr
        rows = [stream[s * seq: s * seq + seq + 1] for s in order[step * batch:(step + 1) * batch]]
        xy = torch.from_numpy(np.stack(rows).astype(np.int64))
        _, loss = model(xy[:, :-1], xy[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model


@torch.no_grad()
def eval_loss(model: GPT, token_lists: list[list[int]], byte_len: np.ndarray, eot: int,
              max_tokens: int) -> tuple[float, float]:
    """(nats per token, bits per byte) on up to max_tokens of these documents, an equal
    share from each (one long file must not stand for the group). Targets that are the
    separator are skipped (not text, and their 'bytes' are not data). bits/byte =
    Σ nats / ln 2 / Σ bytes: comparable across tokenizers."""
    seq = model.config.block_size
    per_doc = max(seq + 1, max_tokens // max(len(token_lists), 1))
    stream = token_stream([t[:per_doc] for t in token_lists], eot)
    stream = stream[: max_tokens + 1].astype(np.int64)
    n = (len(stream) - 1) // seq
    if n == 0:  # e.g. no repeated documents in this subset
        return float("nan"), float("nan")
    x = torch.from_numpy(stream[: n * seq].reshape(n, seq))
    y = torch.from_numpy(stream[1: n * seq + 1].reshape(n, seq))
    y = torch.where(y == eot, -1, y)
    nats = 0.0
    tokens = 0
    nbytes = 0
    for start in range(0, n, 64):
        logits, _ = model(x[start:start + 64])
        yy = y[start:start + 64]
        loss = F.cross_entropy(logits.flatten(0, 1), yy.flatten(), ignore_index=-1,
                               reduction="sum")
        nats += loss.item()
        valid = yy[yy >= 0].numpy()
        tokens += len(valid)
        nbytes += int(byte_len[valid].sum())
    if tokens == 0:  # every target a separator: a group of empty documents (tiny --subset)
        return float("nan"), float("nan")
    return nats / tokens, nats / math.log(2) / nbytes


def sweep_runs(tokens: dict, args) -> list[tuple[str, str, dict]]:
    """(label, train set, weights) per run. 'natural' = T = 1 over the dedup'd token
    counts; the raw and filtered runs use those same weights, so only the documents
    inside each domain differ. The last run repeats 'natural' with another seed (init,
    sampling, order): differences smaller than its distance to 'natural' are noise."""
    natural = curate_mix.temperature_weights(tokens["dedup"], 1.0)
    runs = []
    for spec in [s.strip() for s in args.mixtures.split(";") if s.strip()]:
        if spec == "natural":
            runs.append(("natural", "dedup", natural))
        elif spec == "uniform":
            runs.append(("uniform", "dedup", {d: 1 / len(natural) for d in natural}))
        elif spec.startswith("T="):
            try:
                temperature = float(spec[2:])
            except ValueError:
                raise UserError(f"--mixtures: {spec!r} is not T=<number>") from None
            weights = curate_mix.temperature_weights(tokens["dedup"], temperature)
            runs.append((spec, "dedup", weights))
        else:
            runs.append((spec, "dedup", curate_mix.parse_weights(spec, tokens["dedup"])))
    runs.append(("natural, raw (not dedup'd)", "raw", natural))
    runs.append(("natural, dedup'd + quality rules", "filtered", natural))
    runs.append(("natural, seed + 1 (the noise)", "dedup", natural))
    return runs


def prepare_sweep(args, cfg) -> dict:
    """Domains -> clusters -> split -> one tokenizer (on the dedup'd train documents) ->
    token ids of every set, grouped by domain."""
    docs = curate.flatten(curate._load(args))
    _, near, _ = curate.duplicate_clusters(docs, args)
    split = split_by_cluster(docs, near, args)
    split["filtered"] = curate.quality_filter(split["dedup"], args)[0]
    by_domain = defaultdict(list)
    for d in split["dedup"]:
        by_domain[d.domain].append(d)
    enc = curate_mix.union_tokenizer(by_domain, cfg.vocab_size)
    ids = {name: curate_mix.encode_docs(enc, split[name]) for name in split}
    per_domain = {}
    for name in ("raw", "dedup", "filtered"):
        per_domain[name] = defaultdict(list)
        for d, t in zip(split[name], ids[name]):
            per_domain[name][d.domain].append(t)
    tokens = {}
    for n in per_domain:
        tokens[n] = {d: sum(map(len, v)) for d, v in per_domain[n].items()}
    return {"enc": enc, "split": split, "ids": ids, "per_domain": per_domain,
            "tokens": tokens, "domains": sorted(by_domain)}


def sweep(args) -> dict:
    t0 = time.perf_counter()
    cfg = get_config(args.preset)
    prep = prepare_sweep(args, cfg)
    enc = prep["enc"]
    split = prep["split"]
    ids = prep["ids"]
    domains = prep["domains"]
    eot = enc.encode_single_token(data.EOT)
    # bytes per token id, for bits/byte; the separator is not text
    byte_len = np.array([0 if t == eot else len(enc.decode_single_token_bytes(t))
                         for t in range(enc.n_vocab)])
    tokens = prep["tokens"]
    print(f"sweep: {len(domains)} domains, train tokens {sum(tokens['raw'].values()):,} raw / "
          f"{sum(tokens['dedup'].values()):,} dedup'd / "
          f"{sum(tokens['filtered'].values()):,} filtered, "
          f"{len(split['val'])} val and {len(split['repeated'])} repeated train documents; "
          f"prepared in {time.perf_counter() - t0:.0f} s", flush=True)
    budget = args.steps * args.batch_size * cfg.block_size
    results = []
    for label, which, weights in sweep_runs(tokens, args):
        t1 = time.perf_counter()
        pool = prep["per_domain"][which]
        seed = args.seed + 1 if "seed + 1" in label else args.seed
        doc_tokens = {d: list(map(len, v)) for d, v in pool.items()}
        mix = curate_mix.sample_mixture(doc_tokens, weights, budget, seed)
        picked = [pool[d][i] for d, m in mix.items() for i in m["docs"]]
        order = np.random.default_rng([seed, 7]).permutation(len(picked))
        model = train_on(token_stream([picked[i] for i in order], eot), cfg, args, seed).eval()
        row = {"run": label, "data": which, "weights": weights,
               "epochs": {d: m["epochs"] for d, m in mix.items()}, "val": {}}
        for d in domains:
            val_ids = [t for doc, t in zip(split["val"], ids["val"]) if doc.domain == d]
            row["val"][d] = eval_loss(model, val_ids, byte_len, eot, args.eval_tokens)
        for group in ("repeated", "unique"):
            row[group] = eval_loss(model, ids[group], byte_len, eot, args.eval_tokens)
        row["seconds"] = time.perf_counter() - t1
        results.append(row)
        print(f"  {label}: {row['seconds']:.0f} s", flush=True)
    report = {"preset": args.preset, "steps": args.steps, "tokens_per_run": budget,
              "domains": domains, "runs": results, "seconds": time.perf_counter() - t0}
    print_sweep(report)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def print_sweep(report: dict) -> None:
    domains = report["domains"]
    print(f"\nval loss per domain, nats/token (bits/byte below); {report['preset']}, "
          f"{report['tokens_per_run']:,} training tokens per run; total {report['seconds']:.0f} s")
    head = f"{'run':<38}" + "".join(f"{d:>9}" for d in domains) + f"{'repeated':>10}{'unique':>8}"
    print(head)
    for col in (0, 1):
        for r in report["runs"]:
            cells = "".join(f"{r['val'][d][col]:9.3f}" for d in domains)
            print(f"{r['run'][:38]:<38}{cells}{r['repeated'][col]:10.3f}{r['unique'][col]:8.3f}")
        print()
    print("training share (epochs) per domain")
    print(f"{'run':<38}" + "".join(f"{d:>13}" for d in domains))
    for r in report["runs"]:
        cells = "".join(f"{r['weights'].get(d, 0):7.2f} ({r['epochs'].get(d, 0):3.1f})"
                        for d in domains)
        print(f"{r['run'][:38]:<38}{cells}")


# ---------------------------------------------------------------------------------------
# The command line: curate.py's corpus flags, and the sweep's own

SWEEP_KNOBS = [
    knob("--subset", 0.1, "share of each domain's clusters used"),
    knob("--mixtures", "natural;uniform;lib=0.5,tests=0.2,prose=0.2,arith=0.1",
         "';'-separated: natural, uniform, T=<temperature> or domain=weight,..."),
    knob("--preset", "tiny", "model.py preset (its vocab sizes the tokenizer)"),
    knob("--steps", 1500, "optimizer steps per run"),
    knob("--batch-size", 16, "sequences of block_size tokens per step"),
    knob("--lr", 3e-3, "AdamW peak learning rate"),
    knob("--val-fraction", 0.1, "share of clusters held out"),
    knob("--eval-tokens", 16384, "tokens scored per domain"),
]

# the whole command line, one list under "options": curate.py's corpus, dedup (MinHash)
# and quality-rule knobs, then the sweep's
KNOBS = [*curate.CORPUS_KNOBS, *curate.LSH_KNOBS, *curate.RULE_KNOBS, *SWEEP_KNOBS]


def main(argv=None) -> dict:
    p = command_line("Train short runs on several mixtures and on deduplicated vs raw data; "
                     "validation loss per domain.", {None: KNOBS})
    args = p.parse_args(argv)
    curate.check_args(args)
    torch.set_num_threads(args.threads)
    return sweep(args)


if __name__ == "__main__":
    run_cli(main)
