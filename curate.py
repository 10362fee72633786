"""
curate.py -- the corpus before the tokenizer: where the documents come from, which ones
are copies, which ones are junk, and in what proportions the model sees each domain.

    python curate.py stats                 # documents, bytes, tokens per domain; dups; rules
    python curate.py dedup                 # exact + MinHash/LSH near-dup clusters, S-curve
    python curate.py filter                # each quality rule: what it removes, examples
    python curate.py mix --weights lib=0.5,tests=0.2,prose=0.2,arith=0.1
    python train.py --data out/curate/mix.txt --preset tiny   # train on that mixture
    python curate.py sweep                 # mixtures and dedup vs raw: val loss per domain

What it teaches, and what each step saves / adds / sacrifices
- Domains. The raw material is the standard library cut into domains that really differ:
  top-level modules (lib), packages (pkgs), the test suite (tests: large, repetitive), the
  docstrings and comments as prose, C headers, and data.py's synthetic arithmetic. A model
  is only as good on a domain as the share of its training tokens that domain gets.
- Exact dedup: a hash of the normalized text (case, whitespace) finds copies in O(n); the
  repeated-paragraph pass removes spans that recur across documents (C4, Raffel et al.
  2020, did this for three-sentence spans). Saves tokens spent re-reading the same bytes.
- Near-dup dedup: MinHash (Broder 1997): for a random permutation of all shingles,
  P[min h(A) = min h(B)] = |A∩B|/|A∪B| (the Jaccard similarity), so k permutations estimate
  it with std sqrt(J(1-J)/k). LSH banding: b bands of r rows; a pair becomes a candidate
  when any band matches entirely, with probability 1 - (1 - s^r)^b (the S-curve): sub-
  quadratic search for similar pairs at the price of a few misses near the threshold and
  a few false candidates below it. FineWeb's setting: 5-word shingles, 112 hashes in
  14 bands of 8 (threshold ~ (1/14)^(1/8) = 0.72). Costs: k hashes per shingle.
- Quality rules (Gopher, Rae et al. 2021; C4; Codex, Chen et al. 2021): cheap document-
  level heuristics. Written for web prose, they remove real code (measured in `filter`):
  a rule is a bet on what "junk" looks like in one domain.
- Mixture: exact token shares per domain by taking each domain's documents in seeded
  epochs until its quota is filled; a small domain with a large weight is *repeated*
  (epochs > 1, Muennighoff et al. 2023: up to ~4 epochs is nearly as good as new data).
  What one domain gains, another loses: `sweep` measures it per domain. The mixture lives
  in curate_mix.py, the sweep in curate_sweep.py; this file builds the corpus they read.
"""
import argparse
import ast
import glob
import hashlib
import io
import math
import os
import re
import sysconfig
import time
import tokenize
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

import data
from plumbing import ArgumentParser, HelpFormatter, UserError, fmt_bytes, fmt_count, run_cli

OUT_DIR = os.path.join("out", "curate")
BUILTIN_DOMAINS = ("lib", "pkgs", "tests", "prose", "headers", "arith")
PRIME = 4294967291            # largest prime < 2^32: (a·x + b) mod p fits in uint64
MIX64 = np.uint64(0x9E3779B97F4A7C15)  # odd constant (2^64/φ) to roll word hashes together


@dataclass(frozen=True)
class Document:
    domain: str
    path: str                 # where it came from (relative to its root), or a synthetic name
    text: str                 # decoded with errors="replace": a bad byte becomes U+FFFD


# ---------------------------------------------------------------------------------------
# Domains. Everything is read from the interpreter's own installation: no download.
# ---------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, "rb") as f:  # keep undecodable files: the bad-bytes rule must see them
        return f.read().decode("utf-8", errors="replace")


def _stdlib_sources() -> dict[str, list[str]]:
    """lib: top-level *.py; tests: Lib/test plus the packages' own test folders; pkgs: the
    rest of every package. site-packages is not the standard library."""
    root = sysconfig.get_paths()["stdlib"]
    out = {"lib": sorted(glob.glob(os.path.join(root, "*.py"))), "pkgs": [], "tests": []}
    for f in sorted(glob.glob(os.path.join(root, "*", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(f, root)
        if rel.startswith("site-packages"):
            continue
        parts = rel.split(os.sep)
        in_test_folder = any(p in ("test", "tests", "idle_test") for p in parts[1:-1])
        is_test = parts[0] == "test" or in_test_folder
        out["tests" if is_test else "pkgs"].append(f)
    return out


def extract_prose(source: str) -> str:
    """Docstrings (ast) and comments (tokenize) of one source file, one paragraph each:
    the natural-language part of code."""
    paragraphs = []
    try:
        for node in ast.walk(ast.parse(source)):
            documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, documented):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs.append(doc)
        comment, last_row = [], -2
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            if tok.start[0] != last_row + 1 and comment:  # a gap ends the comment block
                paragraphs.append(" ".join(comment))
                comment = []
            comment.append(tok.string.lstrip("#").strip())
            last_row = tok.start[0]
        if comment:
            paragraphs.append(" ".join(comment))
    except (SyntaxError, tokenize.TokenError, ValueError):
        return ""  # a few test files are deliberately broken Python
    return "\n\n".join(p for p in paragraphs if p.strip())


def arithmetic_documents(n_docs: int, lines: int, seed: int) -> list[Document]:
    """data.py's synthetic task as a domain: documents of `lines` solved problems."""
    problems = data.make_problems(n_docs * lines, seed) if n_docs else []
    docs = []
    for i in range(n_docs):
        chunk = problems[i * lines:(i + 1) * lines]
        text = "".join(data.format_example(p) for p in chunk)
        docs.append(Document("arith", f"arith/{i:05d}", text))
    return docs


def folder_documents(folder: str) -> list[Document]:
    """--data DIR: every regular file under the folder is one document of domain <DIR name>."""
    if not os.path.isdir(folder):
        raise UserError(f"--data {folder}: not a folder")
    name = os.path.basename(os.path.normpath(folder))
    found = glob.glob(os.path.join(folder, "**", "*"), recursive=True)
    files = sorted(f for f in found if os.path.isfile(f))
    docs = [Document(name, os.path.relpath(f, folder), _read(f)) for f in files]
    if not any(d.text.strip() for d in docs):
        raise UserError(f"domain {name!r} from --data {folder} is empty (no text in its files)")
    return docs


def stable_unit(*parts) -> float:
    """A number in [0, 1) from a SHA-256 of the parts: the same on every machine and run
    (Python's hash() of a str is salted per process)."""
    h = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


def subset(docs: list[Document], max_bytes: int, seed: int) -> list[Document]:
    """A seeded subset of at most max_bytes (documents in stable-hash order; 0 = all)."""
    if max_bytes <= 0:
        return docs
    kept, n = [], 0
    for d in sorted(docs, key=lambda d: stable_unit(seed, d.domain, d.path)):
        if n + len(d.text.encode()) <= max_bytes or not kept:
            kept.append(d)
            n += len(d.text.encode())
    return sorted(kept, key=lambda d: d.path)


def load_domains(data_dir=None, arith_docs=300, arith_lines=64, max_bytes=0, seed=0):
    """All domains, {name: [Document]}; max_bytes > 0 keeps a seeded subset of each (the
    prose is extracted from the kept sources). Blank files (empty __init__.py) carry no
    tokens: dropped."""
    extra = folder_documents(data_dir) if data_dir else []  # its errors first: no waiting
    if extra and extra[0].domain in BUILTIN_DOMAINS:
        raise UserError(f"--data folder name {extra[0].domain!r} collides with a built-in domain")
    root = sysconfig.get_paths()["stdlib"]
    domains = {}
    for name, files in _stdlib_sources().items():
        docs = [Document(name, os.path.relpath(f, root), _read(f)) for f in files]
        domains[name] = subset(docs, max_bytes, seed)
    prose = [Document("prose", d.path, p) for d in domains["lib"] + domains["pkgs"]
             if (p := extract_prose(d.text))]
    domains["prose"] = subset(prose, max_bytes, seed)
    include = sysconfig.get_paths()["include"]
    headers = sorted(glob.glob(os.path.join(include, "**", "*.h"), recursive=True))
    if headers:  # present when the Python development headers are installed
        docs = [Document("headers", os.path.relpath(f, include), _read(f)) for f in headers]
        domains["headers"] = subset(docs, max_bytes, seed)
    domains["arith"] = arithmetic_documents(arith_docs, arith_lines, seed)
    if extra:
        domains[extra[0].domain] = subset(extra, max_bytes, seed)
    return {name: [d for d in docs if d.text.strip()] for name, docs in domains.items()
            if any(d.text.strip() for d in docs)}


def flatten(domains: dict[str, list[Document]]) -> list[Document]:
    return [d for docs in domains.values() for d in docs]


# ---------------------------------------------------------------------------------------
# Exact deduplication
# ---------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """Copies rarely match byte for byte (CRLF, trailing spaces, case): compare NFKC,
    lower-cased text with every whitespace run collapsed to one space."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def content_key(text: str) -> bytes:
    return hashlib.sha256(normalize(text).encode()).digest()


def canonical(doc: Document) -> tuple:
    """Which copy survives: the smallest (domain, path, text). Not the first one seen, so
    the result does not depend on the order documents arrive in."""
    return doc.domain, doc.path, doc.text


def exact_clusters(docs: list[Document]) -> list[list[int]]:
    """Groups (size >= 2) of documents with the same normalized content."""
    groups = defaultdict(list)
    for i, d in enumerate(docs):
        groups[content_key(d.text)].append(i)
    return [g for g in groups.values() if len(g) > 1]


def drop_all_but_one(docs: list[Document], clusters: list[list[int]]):
    """(kept, removed): each cluster keeps its canonical member; input order is kept."""
    removed = set()
    for g in clusters:
        keep = min(g, key=lambda i: canonical(docs[i]))
        removed.update(i for i in g if i != keep)
    return ([d for i, d in enumerate(docs) if i not in removed],
            [d for i, d in enumerate(docs) if i in removed])


def dedup_spans(docs: list[Document], unit: str = "paragraph", min_chars: int = 200):
    """Remove every repeat of a line or paragraph (>= min_chars normalized characters)
    after its first occurrence, documents visited in canonical order. Short spans are
    kept: `return None` or `}` repeats everywhere and means nothing. Returns
    (documents, spans removed, bytes removed); documents left empty are dropped."""
    if unit not in ("paragraph", "line"):
        raise UserError(f"span unit must be paragraph or line, got {unit!r}")
    split = re.compile(r"(\n[ \t]*\n)") if unit == "paragraph" else re.compile(r"(\n)")
    seen = set()
    n_spans = 0
    n_bytes = 0
    out = {}
    for i in sorted(range(len(docs)), key=lambda i: canonical(docs[i])):
        pieces = split.split(docs[i].text)  # text, separator, text, separator, ...
        kept = []
        for j in range(0, len(pieces), 2):
            span = pieces[j]
            sep = pieces[j + 1] if j + 1 < len(pieces) else ""
            norm = normalize(span)
            if len(norm) >= min_chars:
                key = hashlib.sha256(norm.encode()).digest()
                if key in seen:
                    n_spans += 1
                    n_bytes += len((span + sep).encode())
                    continue
                seen.add(key)
            kept.append(span + sep)
        out[i] = Document(docs[i].domain, docs[i].path, "".join(kept))
    result = [out[i] for i in range(len(docs)) if out[i].text.strip()]
    return result, n_spans, n_bytes


# ---------------------------------------------------------------------------------------
# MinHash + LSH (Broder 1997; Indyk & Motwani 1998 for the banding)
# ---------------------------------------------------------------------------------------
def word_ids(text: str) -> np.ndarray:
    """64-bit ids of the lower-cased words (\\w+; punctuation dropped, as FineWeb's
    normalization does), from BLAKE2b: deterministic across processes and machines."""
    words = re.findall(r"\w+", text.lower())
    ids = {}
    for w in set(words):
        digest = hashlib.blake2b(w.encode(), digest_size=8).digest()
        ids[w] = int.from_bytes(digest, "little")
    return np.fromiter((ids[w] for w in words), dtype=np.uint64, count=len(words))


def shingle_set(ids: np.ndarray, k: int) -> np.ndarray:
    """Sorted unique 64-bit hashes of the k-word shingles (a text shorter than k words is
    one shingle). Rolling h = h·C + w (mod 2^64) then a xor-shift so the low bits mix."""
    if k < 1:
        raise UserError(f"shingle size must be >= 1, got {k}")
    if len(ids) == 0:
        return np.zeros(0, dtype=np.uint64)
    k = min(k, len(ids))
    h = np.zeros(len(ids) - k + 1, dtype=np.uint64)
    for j in range(k):
        h = h * MIX64 + ids[j: len(ids) - k + 1 + j]
    return np.unique(h ^ (h >> np.uint64(29)))


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b, assume_unique=True)) / union if union else 1.0


def check_lsh(permutations: int, bands: int, rows: int) -> None:
    if permutations < 1 or bands < 1 or rows < 1 or bands * rows != permutations:
        raise UserError(f"LSH needs bands × rows = permutations (each hash in exactly one band), "
                        f"all >= 1; got {bands} × {rows} vs {permutations}")


class MinHasher:
    """k hash functions h_i(x) = (a_i·x + b_i) mod p, a random permutation each of Z_p
    (p prime, a_i != 0): the signature is the k minima over a document's shingles."""

    def __init__(self, permutations: int, seed: int = 0):
        rng = np.random.default_rng([seed, 1997])
        self.a = rng.integers(1, PRIME, size=(permutations, 1), dtype=np.uint64)
        self.b = rng.integers(0, PRIME, size=(permutations, 1), dtype=np.uint64)

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        sig = np.full(len(self.a), PRIME, dtype=np.uint64)  # PRIME = "no shingle" (empty doc)
        x = shingles % np.uint64(PRIME)
        for start in range(0, len(x), 4096):  # (k × 4096) at a time: bounded memory
            chunk = (self.a * x[None, start:start + 4096] + self.b) % np.uint64(PRIME)
            sig = np.minimum(sig, chunk.min(axis=1))
        return sig


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))


def s_curve(s: float, bands: int, rows: int) -> float:
    """P[a pair of Jaccard s shares at least one whole band] = 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - s ** rows) ** bands


def lsh_buckets(sigs: np.ndarray, bands: int, rows: int) -> list[list[int]]:
    """Documents whose signatures agree on all r rows of some band share a bucket; only
    buckets of >= 2 documents are returned. Empty documents never match anything."""
    buckets = []
    valid = [i for i in range(len(sigs)) if sigs[i, 0] != PRIME]
    for band in range(bands):
        table = defaultdict(list)
        for i in valid:
            table[sigs[i, band * rows:(band + 1) * rows].tobytes()].append(i)
        buckets.extend(g for g in table.values() if len(g) > 1)
    return buckets


def union_find(n: int, groups: list[list[int]]) -> list[list[int]]:
    """Connected components (size >= 2) of the graph where each group is a clique."""
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i
    for g in groups:
        root = find(g[0])
        for j in g[1:]:
            parent[find(j)] = root
    comps = defaultdict(list)
    for i in range(n):
        comps[find(i)].append(i)
    return [c for c in comps.values() if len(c) > 1]


def duplicate_clusters(docs: list[Document], args):
    """(exact clusters, near-dup clusters incl. the exact ones, details for printing).
    Like FineWeb, an LSH bucket is taken as a duplicate group without a check of the
    exact similarity (cheap; a chain of similar pairs can merge two distant documents)."""
    check_lsh(args.permutations, args.bands, args.rows)
    exact = exact_clusters(docs)
    hasher = MinHasher(args.permutations, args.seed)
    sets = [shingle_set(word_ids(d.text), args.shingle) for d in docs]
    if sets:
        sigs = np.stack([hasher.signature(s) for s in sets])
    else:
        sigs = np.zeros((0, args.permutations), np.uint64)
    buckets = lsh_buckets(sigs, args.bands, args.rows)
    near = union_find(len(docs), exact + buckets)
    pairs = {(a, b) for g in buckets for i, a in enumerate(g) for b in g[i + 1:]}
    return exact, near, {"sets": sets, "sigs": sigs, "pairs": pairs}


def planted_detection(docs: list[Document], args, n_pairs: int = 1000):
    """Measure the S-curve on real text: take a document, replace a random fraction of
    its words with new ones, and ask LSH whether the pair collides. Returns
    (exact Jaccard, estimated Jaccard, candidate?) per pair."""
    rng = np.random.default_rng([args.seed, 42])
    hasher = MinHasher(args.permutations, args.seed)
    pool = [ids for d in docs if len(ids := word_ids(d.text)) >= 200]
    out = []
    for _ in range(n_pairs if pool else 0):
        ids = pool[rng.integers(len(pool))]
        # aim at a Jaccard J uniform in [0, 1]: keeping each word with prob. 1 - p keeps a
        # k-shingle with q = (1 - p)^k, and J = q / (2 - q), so q = 2J / (1 + J)
        target = rng.uniform(0, 1)
        p = 1 - (2 * target / (1 + target)) ** (1 / args.shingle)
        mutated = ids.copy()
        where = rng.random(len(ids)) < p
        mutated[where] = rng.integers(0, 2 ** 63, size=int(where.sum()), dtype=np.uint64)
        a = shingle_set(ids, args.shingle)
        b = shingle_set(mutated, args.shingle)
        sa = hasher.signature(a)
        sb = hasher.signature(b)
        hit = any(np.array_equal(sa[i:i + args.rows], sb[i:i + args.rows])
                  for i in range(0, args.permutations, args.rows))
        out.append((exact_jaccard(a, b), estimated_jaccard(sa, sb), hit))
    return out


# ---------------------------------------------------------------------------------------
# Quality rules. Each takes the document's features and its threshold; True = remove.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str                 # = its threshold flag: min_* removes below, max_* above
    feature: str              # the key of doc_features() it reads
    default: float
    source: str


RULES = (
    Rule("min_words", "words", 50, "Gopher: fewer than 50 words"),
    Rule("max_words", "words", 100_000, "Gopher: more than 100,000 words"),
    Rule("min_word_len", "mean_word_len", 3, "Gopher: mean word length below 3"),
    Rule("max_word_len", "mean_word_len", 10, "Gopher: mean word length above 10"),
    Rule("max_symbol_ratio", "symbol_ratio", 0.1,
         "Gopher: ('#' + '...') per word above 0.1"),
    Rule("min_alpha_words", "alpha_words", 0.8,
         "Gopher: under 80% of words contain a letter"),
    Rule("max_dup_lines", "dup_lines", 0.3,
         "Gopher: over 30% of non-blank lines repeat one"),
    Rule("max_mean_line", "mean_line", 100,
         "Codex: mean line longer than 100 characters"),
    Rule("max_line", "max_line", 1000, "Codex: a line longer than 1000 characters"),
    Rule("min_alnum", "alnum", 0.25, "StarCoder: under 25% alphanumeric characters"),
    Rule("max_bad_chars", "bad_chars", 0.0,
         "non-UTF-8 bytes (U+FFFD) or binary control chars"),
    Rule("max_curly", "curly", 0,
         "C4: the page contains '{' (off unless removed from --skip-rules)"),
)
RULE_NAMES = tuple(r.name for r in RULES)


def removes(rule: Rule, features: dict, threshold: float) -> bool:
    value = features[rule.feature]
    return value < threshold if rule.name.startswith("min_") else value > threshold


def doc_features(text: str) -> dict:
    words = text.split()                 # Gopher counts whitespace-separated words
    lines = text.splitlines() or [""]
    nonblank = [line.strip() for line in lines if line.strip()]
    n = max(len(text), 1)
    n_words = max(len(words), 1)
    symbols = text.count("#") + text.count("...") + text.count("\u2026")
    return {
        "words": len(words),
        "mean_word_len": sum(map(len, words)) / n_words,
        "symbol_ratio": symbols / n_words,
        "alpha_words": sum(1 for w in words if re.search(r"[^\W\d_]", w)) / n_words,
        "dup_lines": 1 - len(set(nonblank)) / len(nonblank) if nonblank else 0.0,
        "mean_line": len(text) / len(lines),
        "max_line": max(map(len, lines)),
        "alnum": (n - len(re.sub(r"[^\W_]", "", text))) / n,
        "bad_chars": len(re.findall(r"[\x00-\x08\x0e-\x1f\x7f\ufffd]", text)) / n,
        "curly": int("{" in text),
    }


def failed_rules(text: str, thresholds: dict, skip=()) -> list[str]:
    f = doc_features(text)
    return [r.name for r in RULES if r.name not in skip and removes(r, f, thresholds[r.name])]


def quality_filter(docs: list[Document], args):
    """(kept, {rule: [removed documents]}); a document fails every rule it breaks, and is
    removed once. Exempt domains (default: the synthetic arithmetic, which the prose rules
    would remove entirely: '37+45=82' has no letter) pass untouched."""
    thresholds = {r.name: getattr(args, r.name) for r in RULES}
    skip = set(_names(args.skip_rules))
    exempt = set(_names(args.exempt))
    unknown = skip - set(RULE_NAMES)
    if unknown:
        raise UserError(f"--skip-rules: unknown rule(s) {', '.join(sorted(unknown))}; "
                        f"rules: {', '.join(RULE_NAMES)}")
    kept = []
    removed = {r.name: [] for r in RULES}
    for d in docs:
        failed = [] if d.domain in exempt else failed_rules(d.text, thresholds, skip)
        for name in failed:
            removed[name].append(d)
        if not failed:
            kept.append(d)
    return kept, removed


def _names(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


# ---------------------------------------------------------------------------------------
# The mixture (token counts, weights, the sampler, mix.txt) lives in curate_mix.py, split
# out by concept: what proportions the model sees, not which documents exist. Imported at
# the mode's call because it imports this file.
# ---------------------------------------------------------------------------------------
def cmd_mix(args) -> None:
    import curate_mix
    curate_mix.cmd_mix(args)


# ---------------------------------------------------------------------------------------
# The sweep lives in curate_sweep.py (split out by concept: training on the corpus, not
# building it); imported at the mode's call because it imports this file.
# ---------------------------------------------------------------------------------------
def sweep(args) -> dict:
    import curate_sweep
    return curate_sweep.sweep(args)


# ---------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------
def _load(args) -> dict[str, list[Document]]:
    return load_domains(args.data, args.arith_docs, args.arith_lines,
                        args.max_bytes_per_domain, args.seed)


def nbytes(docs: list[Document]) -> int:
    return sum(len(d.text.encode()) for d in docs)


def print_rules(docs: list[Document], args, show: int) -> list[Document]:
    """Each rule's removals (a document can fail several), by domain, with examples."""
    kept, removed = quality_filter(docs, args)
    for rule in RULES:
        gone = removed[rule.name]
        off = " (skipped)" if rule.name in _names(args.skip_rules) else ""
        print(f"{rule.name:<17}{len(gone):>6} docs {fmt_bytes(nbytes(gone)):>10}  {rule.source}; "
              f"threshold {getattr(args, rule.name):g}{off}")
        if gone:
            counts = Counter(d.domain for d in gone).most_common()
            print(f"{'':<19}by domain: " + ", ".join(f"{k} {v}" for k, v in counts))
        for d in gone[:show]:
            value = doc_features(d.text)[rule.feature]
            print(f"{'':<19}{d.domain}/{d.path} [{rule.feature} = {value:.3g}] "
                  f"{' '.join(d.text[:60].split())!r}")
    print(f"all rules: remove {len(docs) - len(kept)} of {len(docs)} documents, "
          f"{fmt_bytes(nbytes(docs) - nbytes(kept))} of {fmt_bytes(nbytes(docs))}")
    return kept


def cmd_stats(args) -> None:
    t0 = time.perf_counter()
    domains = _load(args)
    docs = flatten(domains)
    enc = data.get_tokenizer()  # data.py's default BPE: the tokens train.py would count
    exact, near, _ = duplicate_clusters(docs, args)
    gone_exact = {id(d) for d in drop_all_but_one(docs, exact)[1]}
    gone_near = {id(d) for d in drop_all_but_one(docs, near)[1]}
    kept = {id(d) for d in print_rules(docs, args, show=1)}
    print(f"\n{'domain':<10}{'docs':>7}{'bytes':>11}{'tokens':>10}"
          f"{'exact dup':>11}{'near dup':>10}{'rules':>8}")
    for name, ds in domains.items():
        n_tok = sum(map(len, enc.encode_ordinary_batch([d.text for d in ds])))
        n_exact = sum(id(d) in gone_exact for d in ds)
        n_near = sum(id(d) in gone_near for d in ds)
        n_ruled_out = sum(id(d) not in kept for d in ds)
        print(f"{name:<10}{len(ds):>7}{fmt_bytes(nbytes(ds)):>11}{fmt_count(n_tok):>10}"
              f"{n_exact:>11}{n_near:>10}{n_ruled_out:>8}")
    print(f"stats in {time.perf_counter() - t0:.1f} s")


def cmd_dedup(args) -> None:
    t0 = time.perf_counter()
    docs = flatten(_load(args))
    exact, near, info = duplicate_clusters(docs, args)
    gone = drop_all_but_one(docs, exact)[1]
    print(f"exact: {len(exact)} clusters, {len(gone)} copies removed "
          f"({fmt_bytes(nbytes(gone))} of {fmt_bytes(nbytes(docs))})")
    gone = drop_all_but_one(docs, near)[1]
    print(f"near (shingle {args.shingle}, {args.bands} bands × {args.rows} rows): "
          f"{len(near)} clusters, {len(gone)} documents removed ({fmt_bytes(nbytes(gone))}); "
          f"largest clusters:")
    for c in sorted(near, key=len, reverse=True)[:args.show]:
        names = ", ".join(f"{docs[i].domain}/{docs[i].path}" for i in sorted(c)[:3])
        print(f"  {len(c):>4} docs  {names}{', ...' if len(c) > 3 else ''}")
    for unit in ("paragraph", "line"):
        _, n, b = dedup_spans(docs, unit, args.min_span_chars)
        print(f"repeated {unit}s (>= {args.min_span_chars} chars) across documents: "
              f"{n}, {fmt_bytes(b)}")
    pairs = sorted(info["pairs"])
    print(f"\n{len(pairs)} candidate pairs; a sample, estimated vs exact Jaccard:")
    for k in np.random.default_rng(args.seed).permutation(len(pairs))[:args.show]:
        a, b = pairs[k]
        estimate = estimated_jaccard(info["sigs"][a], info["sigs"][b])
        exact_value = exact_jaccard(info["sets"][a], info["sets"][b])
        print(f"  est {estimate:.3f}  exact {exact_value:.3f}  {docs[a].path} ~ {docs[b].path}")
    print_s_curve(planted_detection(docs, args), args)
    print(f"dedup in {time.perf_counter() - t0:.1f} s")


def print_s_curve(planted: list, args) -> None:
    """Measured detection per Jaccard bin next to the S-curve, and the estimate's mean
    error next to E|N(0, J(1-J)/k)| = sqrt(2/π)·sqrt(J(1-J)/k)."""
    print(f"\nS-curve on planted edits of real documents ({len(planted)} pairs, "
          f"{args.permutations} hashes): detected vs 1 - (1 - s^{args.rows})^{args.bands}")
    print(f"  {'Jaccard':<12}{'pairs':>6}{'detected':>10}{'theory':>8}"
          f"{'|est-exact|':>13}{'expected':>10}")
    for lo in np.arange(0.0, 1.0, 0.1):
        rows = [p for p in planted if lo <= p[0] < lo + 0.1 or (lo >= 0.9 and p[0] == 1.0)]
        if rows:
            detected = np.mean([h for _, _, h in rows])
            theory = np.mean([s_curve(j, args.bands, args.rows) for j, _, _ in rows])
            err = np.mean([abs(e - j) for j, e, _ in rows])
            std = np.mean([math.sqrt(j * (1 - j) / args.permutations) for j, _, _ in rows])
            expected = std * math.sqrt(2 / math.pi)
            print(f"  {lo:.1f}-{lo + 0.1:.1f}{len(rows):>10}{detected:10.3f}"
                  f"{theory:8.3f}{err:13.3f}{expected:10.3f}")


def cmd_filter(args) -> None:
    t0 = time.perf_counter()
    domains = _load(args)
    kept = print_rules(flatten(domains), args, args.show)
    for name, ds in domains.items():
        n_kept = sum(d.domain == name for d in kept)
        print(f"  {name:<10} keeps {n_kept:>5} / {len(ds):<5} documents")
    print(f"filter in {time.perf_counter() - t0:.1f} s")


def add_flags(p: argparse.ArgumentParser, max_bytes: int, lsh=True, rules=False,
              pipeline=False) -> None:
    p.add_argument("--data", default=None,
                   help="a folder of text files: one more domain, named after it "
                        "(not given: the built-in domains only)")
    p.add_argument("--arith-docs", type=int, default=300, help="documents of synthetic arithmetic")
    p.add_argument("--arith-lines", type=int, default=64, help="problems per arithmetic document")
    p.add_argument("--max-bytes-per-domain", type=int, default=max_bytes,
                   help="keep a seeded subset of each domain (0 = everything)")
    p.add_argument("--seed", type=int, default=0, help="seeds subsets, hashes, sampling, training")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matrices: "
                   "a second thread mostly waits, and on a shared box it spins)")
    p.add_argument("--show", type=int, default=3, help="examples / clusters to print")
    p.add_argument("--out-dir", default=OUT_DIR, help="where mix.txt, mix.json, sweep.json go")
    if lsh:
        p.add_argument("--shingle", type=int, default=5, help="words per shingle (FineWeb: 5)")
        p.add_argument("--permutations", type=int, default=112,
                       help="MinHash hashes (FineWeb: 112)")
        p.add_argument("--bands", type=int, default=14, help="LSH bands (FineWeb: 14)")
        p.add_argument("--rows", type=int, default=8, help="hashes per band (FineWeb: 8)")
        p.add_argument("--min-span-chars", type=int, default=200,
                       help="shortest repeated line/paragraph removed")
    if rules:
        for r in RULES:
            p.add_argument(f"--{r.name.replace('_', '-')}", type=float, default=r.default,
                           help=r.source.replace("%", "%%"))  # argparse formats help with %
        p.add_argument("--skip-rules", default="max_curly",
                       help="rules to turn off, comma-separated")
        p.add_argument("--exempt", default="arith", help="domains the rules do not touch")
    if pipeline:
        p.add_argument("--filter", action="store_true",
                       help="apply the quality rules (written for web "
                            "prose they remove about half of the code: see `filter`)")
        p.add_argument("--dedup", default="near", choices=["none", "exact", "near"],
                       help="drop copies: none, exact (normalized hash) or near (+ MinHash/LSH)")
        p.add_argument("--spans", default="none", choices=["none", "paragraph", "line"],
                       help="also drop repeated paragraphs/lines")


def add_mix_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument("--weights", default="",
                   help="domain=weight,... (empty = --temperature over sizes)")
    q.add_argument("--temperature", type=float, default=1.0,
                   help="p_d ∝ tokens_d^(1/T) without --weights")
    q.add_argument("--tokens", type=int, default=0,
                   help="mixture size (0 = largest with no domain repeated)")
    q.add_argument("--vocab-size", type=int, default=data.DEFAULT_VOCAB_SIZE,
                   help="BPE used to count tokens")


def add_sweep_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument("--subset", type=float, default=0.1,
                   help="share of each domain's clusters used")
    q.add_argument("--mixtures", default="natural;uniform;lib=0.5,tests=0.2,prose=0.2,arith=0.1",
                   help="';'-separated: natural, uniform, T=<temperature> or domain=weight,...")
    q.add_argument("--preset", default="tiny",
                   help="model.py preset (its vocab sizes the tokenizer)")
    q.add_argument("--steps", type=int, default=1500, help="optimizer steps per run")
    q.add_argument("--batch-size", type=int, default=16,
                   help="sequences of block_size tokens per step")
    q.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    q.add_argument("--val-fraction", type=float, default=0.1, help="share of clusters held out")
    q.add_argument("--eval-tokens", type=int, default=16384, help="tokens scored per domain")


def parse_args(argv=None) -> argparse.Namespace:
    fmt = HelpFormatter
    p = ArgumentParser(description="Curate the corpus: domains, dedup, filters, mixtures.",
                       formatter_class=fmt)
    sub = p.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("stats", help="documents, bytes, tokens; dups; rules", formatter_class=fmt)
    add_flags(q, 0, rules=True)
    q = sub.add_parser("dedup", help="exact + MinHash/LSH near-duplicates, S-curve",
                       formatter_class=fmt)
    add_flags(q, 0)
    q = sub.add_parser("filter", help="quality rules: removals and examples", formatter_class=fmt)
    add_flags(q, 0, lsh=False, rules=True)
    q = sub.add_parser("mix", help="write a mixture train.py --data can read", formatter_class=fmt)
    add_flags(q, 0, rules=True, pipeline=True)
    add_mix_flags(q)
    q = sub.add_parser("sweep", help="train on several mixtures; val loss per domain",
                       formatter_class=fmt)
    add_flags(q, 0, rules=True)
    add_sweep_flags(q)
    return p.parse_args(argv)


def check_args(args) -> None:
    for name in ("arith_docs", "arith_lines", "max_bytes_per_domain", "show"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if hasattr(args, "shingle"):
        if args.shingle < 1:
            raise UserError(f"--shingle must be >= 1 (words per shingle), got {args.shingle}")
        check_lsh(args.permutations, args.bands, args.rows)
    for name in ("steps", "batch_size", "eval_tokens", "threads"):
        if hasattr(args, name) and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "tokens", 0) < 0:
        raise UserError(f"--tokens must be >= 0 (0 = the largest mixture with no repeats), "
                        f"got {args.tokens}")
    for name in ("subset", "val_fraction"):
        if hasattr(args, name) and not 0 < getattr(args, name) <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in (0, 1], "
                            f"got {getattr(args, name)}")


def check_weights(args) -> None:
    """Names and numbers of --weights before minutes of loading: unknown names are those
    that are neither built in nor the --data folder's."""
    if getattr(args, "weights", ""):
        names = set(BUILTIN_DOMAINS)
        if args.data:
            names.add(os.path.basename(os.path.normpath(args.data)))
        import curate_mix  # see cmd_mix: the mixture's file imports this one
        curate_mix.parse_weights(args.weights, names)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    check_weights(args)
    torch.set_num_threads(args.threads)
    modes = {"stats": cmd_stats, "dedup": cmd_dedup, "filter": cmd_filter, "mix": cmd_mix,
             "sweep": sweep}
    modes[args.mode](args)


if __name__ == "__main__":
    run_cli(main)
