"""
scripts/curate_mix.py -- in what proportions the model sees each domain:

    python -m scripts.curate_mix --weights lib=0.5,tests=0.2,prose=0.2,arith=0.1

An entry point in scripts/ (nothing imports it), built on curate.py: curate.py decides which
documents exist and which are
copies or junk; this file decides how many tokens of each domain the model trains on and
writes them as one file `train.py --data` reads (scripts/curate_sweep.py trains on
several such mixtures to measure what one domain gains and another loses).

What it teaches, and what each step saves / adds / sacrifices
- One tokenizer for every mixture (a BPE on an equal-bytes sample of each domain), so the
  losses of different mixtures compare token for token.
- Weights: given (--weights), or temperature sampling p_d ∝ n_d^(1/T) (XLM, Conneau &
  Lample 2019): T = 1 keeps the natural shares, a larger T upsamples the small domains.
- Exact token shares by taking whole documents in seeded epochs until each quota is
  filled: a small domain with a large weight is *repeated* (epochs > 1; Muennighoff et al.
  2023: up to ~4 epochs is nearly as good as new data, past that repeats are worth little).
"""
import json
import math
import os
import time
import zlib

import numpy as np
import torch

import curate
from core import data
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import run_cli


def union_tokenizer(domains: dict[str, list[curate.Document]], vocab_size: int,
                    bytes_per_domain: int = 150_000):
    """One BPE (data.train_bpe) for every mixture, trained on an equal-bytes sample of each
    domain: losses of different mixtures are then comparable token for token."""
    texts = []
    for docs in domains.values():
        n = 0
        for d in sorted(docs, key=lambda d: curate.stable_unit("tok", d.domain, d.path)):
            if n >= bytes_per_domain:
                break
            texts.append(d.text[: bytes_per_domain - n])
            n += len(texts[-1].encode())
    return data.make_encoding(data.train_bpe(texts, vocab_size))


def parse_weights(spec: str, domains: dict) -> dict[str, float]:
    """'lib=0.5,tests=0.2' -> normalized weights; every mistake is one UserError."""
    weights = {}
    for item in curate._names(spec):
        name, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--weights: {item!r} is not domain=weight")
        if name not in domains:
            raise UserError(f"--weights: unknown domain {name!r}; domains: {', '.join(domains)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise UserError(f"--weights: {value!r} for {name} is not a number") from None
        if not weights[name] >= 0 or math.isinf(weights[name]):
            raise UserError(f"--weights: {name}={value} must be a finite number >= 0")
    total = sum(weights.values())
    if not total > 0:
        raise UserError(f"--weights {spec!r} must sum to a positive number (got {total})")
    return {name: w / total for name, w in weights.items() if w > 0}


def domain_names(extra) -> dict:
    """The domains --weights may name, in a fixed order: the built-in ones, then `extra`
    (the loaded or the --data folder's); a built-in domain that loaded nothing (e.g.
    --arith-docs 0) is empty, not unknown."""
    return dict.fromkeys([*curate.BUILTIN_DOMAINS, *extra])


def temperature_weights(tokens: dict[str, int], temperature: float) -> dict[str, float]:
    """p_d ∝ n_d^(1/T) (XLM, Conneau & Lample 2019; mT5's α = 1/T = 0.3): T = 1 keeps the
    natural shares, T → ∞ makes them uniform, upsampling the small domains."""
    if not temperature > 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")
    raw = {d: n ** (1.0 / temperature) for d, n in tokens.items() if n > 0}
    if not raw:
        raise UserError("every domain is empty (no tokens left after curation)")
    return {d: v / sum(raw.values()) for d, v in raw.items()}


def sample_mixture(doc_tokens: dict[str, list[int]], weights: dict[str, float], total: int,
                   seed: int) -> dict:
    """Pick documents so that domain d holds weights[d]·total tokens: whole documents, in
    a fresh seeded permutation per epoch, until the quota is reached (so each domain is
    off by less than one of its documents). Returns {domain: {docs, tokens, epochs}}."""
    out = {}
    for name, w in weights.items():
        sizes = doc_tokens.get(name, [])
        available = sum(sizes)
        if available == 0:
            raise UserError(f"domain {name!r} is empty (no tokens left after curation); "
                            f"drop its weight")
        quota = w * total
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # crc32: not salted
        picked = []
        taken = 0
        passes = 0
        while taken < quota:
            passes += 1
            for i in rng.permutation(len(sizes)):
                if taken >= quota:
                    break
                picked.append(int(i))
                taken += sizes[i]
        out[name] = {"docs": picked, "tokens": taken, "available": available,
                     "epochs": taken / available, "passes": passes, "largest_doc": max(sizes)}
    return out


def largest_unrepeated(tokens: dict[str, int], weights: dict[str, float]) -> int:
    """The biggest mixture in which no domain repeats: min over d of n_d / w_d."""
    return int(min(tokens.get(d, 0) / w for d, w in weights.items()))


def encode_docs(enc, docs: list[curate.Document]) -> list[list[int]]:
    # EOT is the separator, so a literal "<|endoftext|>" inside a text would split it:
    # encode_ordinary reads it as plain characters, and mix.txt drops it (write_mixture).
    return enc.encode_ordinary_batch([d.text for d in docs])


def write_mixture(docs: list[curate.Document], manifest: dict, out_dir: str, seed: int) -> str:
    """One UTF-8 file, documents in a seeded shuffle separated by data.EOT (what
    `train.py --data` reads; its val split is the last 5% of the stream, so shuffling
    puts every domain in it), plus a JSON manifest next to it."""
    os.makedirs(out_dir, exist_ok=True)
    order = np.random.default_rng([seed, 7]).permutation(len(docs))
    path = os.path.join(out_dir, "mix.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(data.EOT.join(docs[i].text.replace(data.EOT, "") for i in order))
    with open(os.path.join(out_dir, "mix.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return path


# ---------------------------------------------------------------------------------------
# The mode: filter (opt-in) -> exact/near dedup -> repeated spans -> token counts -> sample
# ---------------------------------------------------------------------------------------
def curated_documents(loaded: dict, args) -> list:
    """The documents left after the curation steps --filter, --dedup and --spans ask for."""
    docs = curate.flatten(loaded)
    if args.filter:
        docs = curate.quality_filter(docs, args)[0]
    if args.dedup != "none":
        exact, near, _ = curate.duplicate_clusters(docs, args)
        clusters = near if args.dedup == "near" else exact
        docs = curate.drop_all_but_one(docs, clusters)[0]
    if args.spans != "none":
        docs = curate.dedup_spans(docs, args.spans, args.min_span_chars)[0]
    return docs


def print_mixture(mix: dict, weights: dict, total: int, taken: int) -> None:
    print(f"{'domain':<10}{'weight':>8}{'available':>11}{'taken':>10}{'share':>8}{'epochs':>8}")
    for name, m in mix.items():
        print(f"{name:<10}{weights[name]:8.3f}{m['available']:>11,}{m['tokens']:>10,}"
              f"{m['tokens'] / taken:8.3f}{m['epochs']:8.2f}")
        if m["tokens"] - weights[name] * total > 0.05 * taken:  # whole documents overshoot
            print(f"  note: {name}'s documents (up to {m['largest_doc']:,} tokens) are big next "
                  f"to its quota; a larger --tokens brings every share closer to its weight")
        if m["epochs"] > 4:  # Muennighoff et al. 2023: repeated data loses value past ~4 epochs
            print(f"  note: {name} is repeated {m['epochs']:.1f} times; "
                  f"past ~4 epochs repeats are worth little")


def cmd_mix(args) -> None:
    t0 = time.perf_counter()
    loaded = curate._load(args)
    docs = curated_documents(loaded, args)
    by_domain = {name: [d for d in docs if d.domain == name] for name in loaded}
    enc = union_tokenizer(by_domain, args.vocab_size)
    doc_tokens = {name: list(map(len, encode_docs(enc, ds))) for name, ds in by_domain.items()}
    tokens = {name: sum(v) for name, v in doc_tokens.items()}
    # --weights wins; without it, temperature sampling over the domains' token counts
    if args.weights:
        weights = parse_weights(args.weights, domain_names(loaded))
    else:
        weights = temperature_weights(tokens, args.temperature)
    total = args.tokens or largest_unrepeated(tokens, weights)
    mix = sample_mixture(doc_tokens, weights, total, args.seed)
    taken = sum(m["tokens"] for m in mix.values())
    print_mixture(mix, weights, total, taken)
    chosen = [by_domain[name][i] for name, m in mix.items() for i in m["docs"]]
    per_domain = {}
    for n, m in mix.items():
        summary = {k: v for k, v in m.items() if k != "docs"}
        per_domain[n] = {**summary, "documents": len(m["docs"])}
    manifest = {
        "weights": weights,
        "tokens": taken,
        "documents": len(chosen),
        "seed": args.seed,
        "tokenizer": f"curate_mix.union_tokenizer, vocab {args.vocab_size}",
        "filter": args.filter,
        "dedup": args.dedup,
        "spans": args.spans,
        "domains": per_domain,
    }
    path = write_mixture(chosen, manifest, args.out_dir, args.seed)
    print(f"wrote {path} ({len(chosen)} documents, {taken:,} tokens) and mix.json in "
          f"{time.perf_counter() - t0:.1f} s\ntrain on it: python train.py --data {path}")


# ---------------------------------------------------------------------------------------
# The command line: curate.py's corpus flags, and the mixture's own

MIX_KNOBS = [
    knob("--weights", "", "domain=weight,... (empty = --temperature over sizes)"),
    knob("--temperature", 1.0, "p_d ∝ tokens_d^(1/T) without --weights"),
    knob("--tokens", 0, "mixture size (0 = largest with no domain repeated)"),
    knob("--vocab-size", data.DEFAULT_VOCAB_SIZE, "BPE used to count tokens"),
]

# the whole command line, one list under "options": curate.py's corpus, dedup (MinHash),
# quality-rule and pipeline-stage knobs, then the mixture's
KNOBS = [*curate.CORPUS_KNOBS, *curate.LSH_KNOBS, *curate.RULE_KNOBS, *curate.PIPELINE_KNOBS,
         *MIX_KNOBS]


def check_weights(args) -> None:
    """Names and numbers of --weights before minutes of loading: unknown names are those
    that are neither built in nor the --data folder's."""
    if args.weights:
        folder = [os.path.basename(os.path.normpath(args.data))] if args.data else []
        parse_weights(args.weights, domain_names(folder))


def main(argv=None) -> None:
    p = command_line("Write a mixture of the curated domains that train.py --data can read "
                     "(mix.txt + mix.json).", {None: KNOBS})
    args = p.parse_args(argv)
    curate.check_args(args)
    check_weights(args)
    torch.set_num_threads(args.threads)
    cmd_mix(args)


if __name__ == "__main__":
    run_cli(main)
