"""
curate.py -- the corpus before the tokenizer: where the documents come from, which ones
are copies, which ones are junk, and in what proportions the model sees each domain.

    python curate.py stats                 # documents, bytes, tokens per domain; dups; rules
    python curate.py dedup                 # exact + MinHash/LSH near-dup clusters, S-curve
    python curate.py filter                # each quality rule: what it removes, examples
    python -m scripts.curate_mix --weights lib=0.5,tests=0.2,prose=0.2,arith=0.1
    python train.py --data out/curate/mix.txt --preset tiny   # train on that mixture
    python -m scripts.curate_sweep                 # mixtures and dedup vs raw: val loss per domain

What it teaches, and what each step saves / adds / sacrifices
- Domains. The raw material is the standard library cut into domains that really differ:
  top-level modules (lib), packages (pkgs), the test suite (tests: large, repetitive), the
  docstrings and comments as prose, C headers, and core/data.py's synthetic arithmetic. A model
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
  in scripts/curate_mix.py, the sweep in scripts/curate_sweep.py; this file builds the
  corpus they read.
"""
import argparse
import ast
import dataclasses
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

from core import data
from core.cli import ArgumentParser, HelpFormatter, add_knobs, fmt_bytes, fmt_count, knob
from core.errors import UserError
from core.runtime import run_cli

OUT_DIR = os.path.join("out", "curate")
# The names this file builds itself. A --data folder may not take one of them
# (load_domains refuses it): its documents would silently merge into that domain.
BUILTIN_DOMAINS = ("lib", "pkgs", "tests", "prose", "headers", "arith")
# Why a prime: x -> (a·x + b) mod p is a bijection of Z_p for every a != 0 only when p is
# prime (a has an inverse mod p), and a bijection is what makes each MinHash row a
# random permutation. Why < 2^32: see the trailing comment; a larger p would wrap mod
# 2^64 silently inside numpy and the rows would stop being permutations.
PRIME = 4294967291            # largest prime < 2^32: (a·x + b) mod p fits in uint64
# Knuth's multiplicative-hashing constant (TAOCP vol. 3, §6.4). Odd, so multiplying by it
# is itself a bijection mod 2^64: rolling it over the word ids loses no information.
MIX64 = np.uint64(0x9E3779B97F4A7C15)  # odd constant (2^64/φ) to roll word hashes together


# frozen: a Document is a value passed between dedup, the rules and the mixture; no stage
# may edit one in place (dedup_spans builds a new Document with the shortened text).
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
    # lib: "*.py" does not recurse, so only the files directly in the stdlib folder
    # (os.py, argparse.py, ...): the single-file modules.
    out = {"lib": sorted(glob.glob(os.path.join(root, "*.py"))), "pkgs": [], "tests": []}
    # "*/**/*.py" with recursive=True: every .py at least one folder down, i.e. inside a
    # package. sorted(): glob returns the file system's order, and nothing downstream
    # (subset, the canonical copy, the mixture) may depend on the machine.
    for f in sorted(glob.glob(os.path.join(root, "*", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(f, root)
        # a CPython built from source keeps site-packages inside the stdlib folder:
        # third-party code that differs per machine, so skipped
        if rel.startswith("site-packages"):
            continue
        parts = rel.split(os.sep)
        # parts[0] is the top folder, parts[1:-1] the folders between it and the file:
        # Lib/test/... and the packages' own tkinter/test/, idlelib/idle_test/ are tests.
        # The test suite is its own domain because it is large and repetitive (asserts
        # on near-identical fixtures), and its share of the tokens is a knob of its own.
        in_test_folder = any(p in ("test", "tests", "idle_test") for p in parts[1:-1])
        is_test = parts[0] == "test" or in_test_folder
        out["tests" if is_test else "pkgs"].append(f)
    return out


def extract_prose(source: str) -> str:
    """Docstrings (ast) and comments (tokenize) of one source file, one paragraph each:
    the natural-language part of code."""
    paragraphs = []
    try:
        # ast.walk is breadth-first (the module's docstring, then its classes' and
        # functions', level by level): not source order, which does not matter when
        # every docstring is a paragraph of its own.
        for node in ast.walk(ast.parse(source)):
            documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, documented):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs.append(doc)
        # Comments exist only in the token stream (ast drops them). Comments on
        # consecutive rows form one paragraph; trailing comments (`x = 1  # why`) are
        # COMMENT tokens too, so a run of commented lines also reads as one paragraph.
        comment, last_row = [], -2
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            if tok.start[0] != last_row + 1 and comment:  # a gap ends the comment block
                paragraphs.append(" ".join(comment))
                comment = []
            comment.append(tok.string.lstrip("#").strip())
            last_row = tok.start[0]
        if comment:                # the last block has no gap after it to flush it
            paragraphs.append(" ".join(comment))
    except (SyntaxError, tokenize.TokenError, ValueError):
        # ValueError: what some Python versions raise for a NUL byte in the source. A
        # file that fails to parse gives no prose at all, its comments included.
        return ""  # a few test files are deliberately broken Python
    return "\n\n".join(p for p in paragraphs if p.strip())


def arithmetic_documents(n_docs: int, lines: int, seed: int) -> list[Document]:
    """core/data.py's synthetic task as a domain: documents of `lines` solved problems."""
    # One seeded draw of n_docs·lines problems, then cut into documents. make_problems'
    # default split is "train" (core/data.py picks the split by a hash of the prompt),
    # so no document here holds one of the held-out "test" problems evaluate.py scores.
    # Draws are with replacement: a sum can recur across documents, but the documents
    # as a whole differ, so exact dedup leaves them alone.
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
    # normpath first: "mine/" would otherwise have the empty basename ""
    name = os.path.basename(os.path.normpath(folder))
    # glob skips names that start with '.' (.git/, .DS_Store): a checked-out repository
    # can be passed as it is. isfile() drops the folders "**" also matches.
    found = glob.glob(os.path.join(folder, "**", "*"), recursive=True)
    files = sorted(f for f in found if os.path.isfile(f))
    docs = [Document(name, os.path.relpath(f, folder), _read(f)) for f in files]
    # an all-blank folder would load "fine" and vanish in load_domains' last pass; then a
    # mixture weight on it could never be filled. Fail here, naming the domain.
    if not any(d.text.strip() for d in docs):
        raise UserError(f"domain {name!r} from --data {folder} is empty (no text in its files)")
    return docs


def stable_unit(*parts) -> float:
    """A number in [0, 1) from a SHA-256 of the parts: the same on every machine and run
    (Python's hash() of a str is salted per process)."""
    # "\0" between the parts keeps ("ab", "c") and ("a", "bc") apart
    h = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    # 64 bits into a double (53-bit mantissa): values within 2^-54 of 1 round to 1.0,
    # so "[0, 1)" fails with odds ~2^-54 per call -- harmless for a sort key.
    return int.from_bytes(h[:8], "big") / 2 ** 64


def subset(docs: list[Document], max_bytes: int, seed: int) -> list[Document]:
    """A seeded subset of at most max_bytes (documents in stable-hash order; 0 = all)."""
    if max_bytes <= 0:
        return docs
    kept, n = [], 0
    # A seeded shuffle by stable hash, then a greedy fill: a document too big for what is
    # left is skipped and a later, smaller one may still fit, so the budget is nearly
    # used up. The budget is UTF-8 bytes (the unit every table prints), not characters.
    # `or not kept`: a domain whose first document alone exceeds max_bytes still keeps
    # that one instead of vanishing.
    for d in sorted(docs, key=lambda d: stable_unit(seed, d.domain, d.path)):
        if n + len(d.text.encode()) <= max_bytes or not kept:
            kept.append(d)
            n += len(d.text.encode())
    # back to path order: the seed decides which documents are in, never their order
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
    # paths relative to the stdlib root: the same document has the same path (and so the
    # same stable_unit key and canonical rank) on every machine and Python install
    for name, files in _stdlib_sources().items():
        docs = [Document(name, os.path.relpath(f, root), _read(f)) for f in files]
        domains[name] = subset(docs, max_bytes, seed)
    # prose comes from the *kept* lib and pkgs sources (not tests), so under max_bytes
    # it describes the same modules those domains hold; the walrus skips a source with
    # no docstring or comment. A prose document keeps its source's path, and differs
    # from it only in the domain: stable_unit and canonical see both parts.
    prose = [Document("prose", d.path, p) for d in domains["lib"] + domains["pkgs"]
             if (p := extract_prose(d.text))]
    domains["prose"] = subset(prose, max_bytes, seed)
    include = sysconfig.get_paths()["include"]
    headers = sorted(glob.glob(os.path.join(include, "**", "*.h"), recursive=True))
    if headers:  # present when the Python development headers are installed
        docs = [Document("headers", os.path.relpath(f, include), _read(f)) for f in headers]
        domains["headers"] = subset(docs, max_bytes, seed)
    # arith is sized by --arith-docs and --arith-lines, not by max_bytes
    domains["arith"] = arithmetic_documents(arith_docs, arith_lines, seed)
    if extra:
        domains[extra[0].domain] = subset(extra, max_bytes, seed)
    # blank documents go (an empty __init__.py is 0 tokens and would still count as a
    # document), then every domain left with none: each domain returned has tokens
    return {name: [d for d in docs if d.text.strip()] for name, docs in domains.items()
            if any(d.text.strip() for d in docs)}


def flatten(domains: dict[str, list[Document]]) -> list[Document]:
    """Every domain's documents in one list, domain by domain: dedup's clusters are
    indices into this list, so it is built once per command and not reordered."""
    return [d for docs in domains.values() for d in docs]


# ---------------------------------------------------------------------------------------
# Exact deduplication
# ---------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """Copies rarely match byte for byte (CRLF, trailing spaces, case): compare NFKC,
    lower-cased text with every whitespace run collapsed to one space."""
    # NFKC folds compatibility forms onto plain ones (full-width letters, the "ﬁ"
    # ligature, U+00A0 no-break space); split() with no argument splits on every
    # Unicode whitespace run, newlines and tabs included.
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def content_key(text: str) -> bytes:
    """The dict key of exact dedup: SHA-256 of the normalized text, 32 bytes per document
    instead of the whole text; a collision between two different texts does not happen
    at any corpus size (the birthday bound is 2^128 documents)."""
    return hashlib.sha256(normalize(text).encode()).digest()


def canonical(doc: Document) -> tuple:
    """Which copy survives: the smallest (domain, path, text). Not the first one seen, so
    the result does not depend on the order documents arrive in."""
    # Tuples compare left to right, so the domain name decides first: a file present in
    # lib and in tests survives as lib ("lib" < "tests"); the path, then the text break
    # the remaining ties. Rename a domain and which copy survives can change.
    return doc.domain, doc.path, doc.text


def exact_clusters(docs: list[Document]) -> list[list[int]]:
    """Groups (size >= 2) of documents with the same normalized content."""
    groups = defaultdict(list)
    # one pass of hashing and dict inserts: O(n) total, against O(n²) comparisons of
    # every pair; only the indices are kept, so a cluster costs a few ints
    for i, d in enumerate(docs):
        groups[content_key(d.text)].append(i)
    return [g for g in groups.values() if len(g) > 1]


def drop_all_but_one(docs: list[Document], clusters: list[list[int]]):
    """(kept, removed): each cluster keeps its canonical member; input order is kept."""
    # a set: the two list comprehensions below test membership once per document
    removed = set()
    for g in clusters:
        # min by canonical(), not g[0]: the survivor is the same whatever order the
        # documents arrive in (tests/test_curate.py shuffles them and checks)
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
    # The capturing group makes re.split return the separators too, at the odd indices:
    # every kept span is re-joined with its own separator, so a document with nothing
    # removed comes back byte for byte. A paragraph ends at a line of only blanks.
    split = re.compile(r"(\n[ \t]*\n)") if unit == "paragraph" else re.compile(r"(\n)")
    # SHA-256 of every long span kept so far, over all domains: a licence paragraph kept
    # in lib also removes its copies from tests and pkgs
    seen = set()
    n_spans = 0
    n_bytes = 0
    out = {}
    # canonical order, not input order: the first occurrence (the copy that stays) is
    # the same however the documents arrive (the test feeds them reversed)
    for i in sorted(range(len(docs)), key=lambda i: canonical(docs[i])):
        pieces = split.split(docs[i].text)  # text, separator, text, separator, ...
        kept = []
        for j in range(0, len(pieces), 2):
            span = pieces[j]
            sep = pieces[j + 1] if j + 1 < len(pieces) else ""
            norm = normalize(span)
            # the length test is on the normalized span, so indentation does not make a
            # short line "long"; raise --min-span-chars and fewer, longer spans go
            if len(norm) >= min_chars:
                key = hashlib.sha256(norm.encode()).digest()
                if key in seen:
                    # a repeat: dropped with its separator, and those are the bytes the
                    # corpus loses (UTF-8, as nbytes counts)
                    n_spans += 1
                    n_bytes += len((span + sep).encode())
                    continue
                seen.add(key)
            kept.append(span + sep)
        out[i] = Document(docs[i].domain, docs[i].path, "".join(kept))
    # back to input order; a document reduced to whitespace is dropped, not kept empty
    result = [out[i] for i in range(len(docs)) if out[i].text.strip()]
    return result, n_spans, n_bytes


# ---------------------------------------------------------------------------------------
# MinHash + LSH (Broder 1997; Indyk & Motwani 1998 for the banding)
# ---------------------------------------------------------------------------------------
def word_ids(text: str) -> np.ndarray:
    """64-bit ids of the lower-cased words (\\w+; punctuation dropped, as FineWeb's
    normalization does), from BLAKE2b: deterministic across processes and machines."""
    # \w+ on lower-cased text: "Return", "return" and "return;" are one word, so case
    # and punctuation edits do not break the shingles around them
    words = re.findall(r"\w+", text.lower())
    ids = {}
    # each distinct word hashed once (code repeats its identifiers many times), then the
    # word list mapped through the dict. 64-bit digests: two distinct words collide with
    # probability ~2^-64, and a collision only merges two words.
    for w in set(words):
        digest = hashlib.blake2b(w.encode(), digest_size=8).digest()
        ids[w] = int.from_bytes(digest, "little")
    # count= preallocates the array instead of growing it
    return np.fromiter((ids[w] for w in words), dtype=np.uint64, count=len(words))


def shingle_set(ids: np.ndarray, k: int) -> np.ndarray:
    """Sorted unique 64-bit hashes of the k-word shingles (a text shorter than k words is
    one shingle). Rolling h = h·C + w (mod 2^64) then a xor-shift so the low bits mix."""
    if k < 1:
        raise UserError(f"shingle size must be >= 1, got {k}")
    if len(ids) == 0:
        return np.zeros(0, dtype=np.uint64)
    # a text shorter than k words is one shingle of all its words: a short document still
    # has a signature, and two equal short documents still match
    k = min(k, len(ids))
    # After the loop h[i] = Σ_j ids[i+j]·C^(k-1-j) mod 2^64 (C = MIX64): a polynomial
    # hash of the window i..i+k-1, order-sensitive, for all len(ids) - k + 1 windows at
    # once with k vector multiply-adds: O(k·n) work and no Python loop over windows.
    # Array arithmetic in uint64 wraps mod 2^64 without a warning: that wrap is the mod.
    h = np.zeros(len(ids) - k + 1, dtype=np.uint64)
    for j in range(k):
        h = h * MIX64 + ids[j: len(ids) - k + 1 + j]  # the j-th word of every window
    # Multiplication only carries upward, so h's low bits depend only on the ids' low
    # bits: the xor-shift folds the high bits down. np.unique sorts and drops repeats --
    # Jaccard is over sets, and a shingle that recurs in a document counts once.
    return np.unique(h ^ (h >> np.uint64(29)))


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|A∩B| / |A∪B| of two shingle sets, the quantity MinHash estimates; used to check the
    estimate and to bin the S-curve, never by the dedup itself (that is the point)."""
    # assume_unique: both come from shingle_set (np.unique), so intersect1d may skip its
    # own de-duplication. Two empty sets count as identical: J = 1.
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b, assume_unique=True)) / union if union else 1.0


def check_lsh(permutations: int, bands: int, rows: int) -> None:
    """lsh_buckets cuts the signature into b consecutive bands of r rows, and s_curve
    assumes exactly that split: with b·r < k a hash would sit in no band, and
    planted_detection's range(0, k, r) would test a short last band that lsh_buckets
    never builds."""
    if permutations < 1 or bands < 1 or rows < 1 or bands * rows != permutations:
        raise UserError(f"LSH needs bands × rows = permutations (each hash in exactly one band), "
                        f"all >= 1; got {bands} × {rows} vs {permutations}")


class MinHasher:
    """k hash functions h_i(x) = (a_i·x + b_i) mod p, a random permutation each of Z_p
    (p prime, a_i != 0): the signature is the k minima over a document's shingles."""

    def __init__(self, permutations: int, seed: int = 0):
        # [seed, 1997]: a stream of its own, so the hash functions stay the same when
        # other draws from `seed` change (planted_detection uses [seed, 42]). Every
        # caller must build its hasher with the same seed: signatures from two different
        # hashers are not comparable.
        rng = np.random.default_rng([seed, 1997])
        # a in [1, p) (integers' high is exclusive): a = 0 would map every shingle to b,
        # give every document the same signature, and make every pair a candidate.
        # Shape (k, 1) broadcasts against a (1, n) row of shingles into (k, n) hashes.
        self.a = rng.integers(1, PRIME, size=(permutations, 1), dtype=np.uint64)
        self.b = rng.integers(0, PRIME, size=(permutations, 1), dtype=np.uint64)

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        sig = np.full(len(self.a), PRIME, dtype=np.uint64)  # PRIME = "no shingle" (empty doc)
        # into Z_p first, so a·x + b < 2^64 below. Two shingles equal mod p collide in every
        # row at once; for a 1,000-shingle document the odds of one such pair are ~10^-4.
        x = shingles % np.uint64(PRIME)
        for start in range(0, len(x), 4096):  # (k × 4096) at a time: bounded memory
            # (k × 4096) uint64 = 3.7 MB at k = 112, whatever the file's size; the cost is
            # the header's "k hashes per shingle": k multiply-add-mods per shingle
            chunk = (self.a * x[None, start:start + 4096] + self.b) % np.uint64(PRIME)
            # the running minimum per row over the chunks = the minimum over all shingles
            sig = np.minimum(sig, chunk.min(axis=1))
        return sig


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Share of rows whose minima agree. A row agrees with probability J for a truly
    random permutation (Broder 1997), so the mean of k rows has std sqrt(J(1-J)/k);
    (a·x + b) mod p is close enough (tests/test_curate.py: within 0.05 at k = 2048)."""
    return float(np.mean(sig_a == sig_b))


def s_curve(s: float, bands: int, rows: int) -> float:
    """P[a pair of Jaccard s shares at least one whole band] = 1 - (1 - s^r)^b."""
    # s^r: all r rows of one band agree (rows taken as independent); (1 - s^r)^b: no band
    # agrees. The threshold ~ (1/b)^(1/r): more rows per band move it up and steepen the
    # curve (fewer false candidates), more bands move it down (fewer misses).
    return 1.0 - (1.0 - s ** rows) ** bands


def lsh_buckets(sigs: np.ndarray, bands: int, rows: int) -> list[list[int]]:
    """Documents whose signatures agree on all r rows of some band share a bucket; only
    buckets of >= 2 documents are returned. Empty documents never match anything."""
    buckets = []
    # an empty document's signature stays all PRIME, in every band: without this filter
    # all the empty documents would land in one bucket and count as duplicates
    valid = [i for i in range(len(sigs)) if sigs[i, 0] != PRIME]
    for band in range(bands):
        # one hash table per band, keyed by the band's r uint64 values as 8·r raw bytes:
        # documents meet only when the whole band agrees, and finding them is a dict
        # insert per document -- no pair is ever compared, hence sub-quadratic
        table = defaultdict(list)
        for i in valid:
            table[sigs[i, band * rows:(band + 1) * rows].tobytes()].append(i)
        # a pair that agrees on several bands appears in several buckets: union_find
        # does not mind, and duplicate_clusters' pair set removes the repeats
        buckets.extend(g for g in table.values() if len(g) > 1)
    return buckets


def union_find(n: int, groups: list[list[int]]) -> list[list[int]]:
    """Connected components (size >= 2) of the graph where each group is a clique."""
    parent = list(range(n))

    # Path halving (Tarjan & van Leeuwen 1984) points each visited node at its grandparent,
    # so the trees stay shallow. There is no union by rank, which leaves O(log n)
    # amortized per find: ample for the thousands of documents here.
    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i
    for g in groups:
        # a group is a clique, so linking each member to the first member's root joins
        # all of it. The trap: link find(j), not j itself -- re-pointing j would cut it
        # from its own tree and leave the rest of that tree behind.
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
    # one hasher for every document: only signatures from the same hash functions compare
    hasher = MinHasher(args.permutations, args.seed)
    sets = [shingle_set(word_ids(d.text), args.shingle) for d in docs]
    if sets:
        sigs = np.stack([hasher.signature(s) for s in sets])
    else:
        sigs = np.zeros((0, args.permutations), np.uint64)
    buckets = lsh_buckets(sigs, args.bands, args.rows)
    # exact + buckets: exact copies share every band anyway, except copies with no word
    # at all (a file of only punctuation): empty signature, no bucket. The exact
    # clusters bring those in, so the near clusters contain every exact one.
    near = union_find(len(docs), exact + buckets)
    # every pair inside a bucket, only for cmd_dedup's estimated-vs-exact sample. A bucket
    # of m documents gives m(m-1)/2 pairs: ~500k tuples for 1,000 identical files.
    pairs = {(a, b) for g in buckets for i, a in enumerate(g) for b in g[i + 1:]}
    return exact, near, {"sets": sets, "sigs": sigs, "pairs": pairs}


def planted_detection(docs: list[Document], args, n_pairs: int = 1000):
    """Measure the S-curve on real text: take a document, replace a random fraction of
    its words with new ones, and ask LSH whether the pair collides. Returns
    (exact Jaccard, estimated Jaccard, candidate?) per pair."""
    rng = np.random.default_rng([args.seed, 42])
    hasher = MinHasher(args.permutations, args.seed)
    # >= 200 words: enough shingles that the realised Jaccard can land near any target;
    # a 20-word document has 16 shingles and its J moves in coarse steps
    pool = [ids for d in docs if len(ids := word_ids(d.text)) >= 200]
    out = []
    for _ in range(n_pairs if pool else 0):
        ids = pool[rng.integers(len(pool))]
        # aim at a Jaccard J uniform in [0, 1]: keeping each word with prob. 1 - p keeps a
        # k-shingle with q = (1 - p)^k, and J = q / (2 - q), so q = 2J / (1 + J)
        target = rng.uniform(0, 1)
        p = 1 - (2 * target / (1 + target)) ** (1 / args.shingle)
        # replacements are random 63-bit ids, not real words: a replaced word matches no
        # other word, so every shingle that touches it is new. The target is only aimed
        # at (repeated shingles and the draws move J), hence the exact J is what is kept.
        mutated = ids.copy()
        where = rng.random(len(ids)) < p
        mutated[where] = rng.integers(0, 2 ** 63, size=int(where.sum()), dtype=np.uint64)
        a = shingle_set(ids, args.shingle)
        b = shingle_set(mutated, args.shingle)
        sa = hasher.signature(a)
        sb = hasher.signature(b)
        # the same bands as lsh_buckets (rows i..i+r-1): a hit means exactly "these two
        # would share a bucket", without building the tables for one pair
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
    default: float            # the threshold's default: the paper's value
    source: str               # the paper and its rule: filter's output and the flag's help


# Gopher: Rae et al. 2021, appendix A (MassiveText's quality filters). Codex: Chen et
# al. 2021, §3.1, dropped files with mean line length > 100, a line > 1000, or few
# alphanumeric characters. C4 (Raffel et al. 2020, §2.2) drops any page with a '{' to
# remove code -- here code is the data, so the rule is listed but skipped by default.
# Raise a threshold to loosen a max_* rule; `filter` prints what each one costs.
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
    # threshold 0 on a ratio: a single bad character is enough to remove the document
    Rule("max_bad_chars", "bad_chars", 0.0,
         "non-UTF-8 bytes (U+FFFD) or binary control chars"),
    Rule("max_curly", "curly", 0,
         "C4: the page contains '{' (off unless removed from --skip-rules)"),
)
RULE_NAMES = tuple(r.name for r in RULES)


def removes(rule: Rule, features: dict, threshold: float) -> bool:
    """True = remove. The direction is in the name: min_* removes a value below the
    threshold, max_* one above it; a value equal to the threshold stays (Gopher's
    "fewer than 50 words": 50 words pass, as tests/test_curate.py checks)."""
    value = features[rule.feature]
    return value < threshold if rule.name.startswith("min_") else value > threshold


def doc_features(text: str) -> dict:
    """Every feature the rules read, computed once per document: one pass per feature
    over the text, however many rules share it (min_words and max_words, ...)."""
    words = text.split()                 # Gopher counts whitespace-separated words
    # the guards: an empty text has one empty line, n = 1 and n_words = 1, so no ratio
    # below divides by zero and max() has a line to look at
    lines = text.splitlines() or [""]
    nonblank = [line.strip() for line in lines if line.strip()]
    n = max(len(text), 1)
    n_words = max(len(words), 1)
    # Gopher's symbol-to-word ratio: '#' and ellipses, "..." and the one character "…".
    # Every Python comment adds a '#', so comment-dense code drifts toward this limit.
    symbols = text.count("#") + text.count("...") + text.count("\u2026")
    return {
        "words": len(words),
        "mean_word_len": sum(map(len, words)) / n_words,
        "symbol_ratio": symbols / n_words,
        # [^\W\d_]: a word character that is neither a digit nor '_', i.e. a letter
        "alpha_words": sum(1 for w in words if re.search(r"[^\W\d_]", w)) / n_words,
        # share of non-blank lines that repeat another (1 - distinct / all); stripped
        # first, so indentation alone does not make two copies differ
        "dup_lines": 1 - len(set(nonblank)) / len(nonblank) if nonblank else 0.0,
        # len(text) includes the newlines: ~1 character per line above the visible mean
        "mean_line": len(text) / len(lines),
        "max_line": max(map(len, lines)),
        # re.sub deletes the alphanumerics ([^\W_]: word characters except '_'), so the
        # length it takes away is their count
        "alnum": (n - len(re.sub(r"[^\W_]", "", text))) / n,
        # C0 controls except \t \n \v \f \r (0x09-0x0d), DEL, and the U+FFFD that
        # _read put in for undecodable bytes
        "bad_chars": len(re.findall(r"[\x00-\x08\x0e-\x1f\x7f\ufffd]", text)) / n,
        "curly": int("{" in text),       # 0/1, not a ratio: C4's rule is any '{' at all
    }


def failed_rules(text: str, thresholds: dict, skip=()) -> list[str]:
    """Names of the rules `text` breaks, in RULES order; skip: rule names turned off.
    The features are computed once and shared by all the rules."""
    f = doc_features(text)
    return [r.name for r in RULES if r.name not in skip and removes(r, f, thresholds[r.name])]


def quality_filter(docs: list[Document], args):
    """(kept, {rule: [removed documents]}); a document fails every rule it breaks, and is
    removed once. Exempt domains (default: the synthetic arithmetic, which the prose rules
    would remove entirely: '37+45=82' has no letter) pass untouched."""
    thresholds = {r.name: getattr(args, r.name) for r in RULES}
    skip = set(_names(args.skip_rules))
    exempt = set(_names(args.exempt))
    # an unknown --skip-rules name is an error, not a no-op: a typo (max_curley) would
    # leave the rule on without a word. --exempt is not checked: exempting an absent
    # domain changes nothing.
    unknown = skip - set(RULE_NAMES)
    if unknown:
        raise UserError(f"--skip-rules: unknown rule(s) {', '.join(sorted(unknown))}; "
                        f"rules: {', '.join(RULE_NAMES)}")
    kept = []
    removed = {r.name: [] for r in RULES}
    for d in docs:
        failed = [] if d.domain in exempt else failed_rules(d.text, thresholds, skip)
        # listed under every rule it fails (filter shows each reason), kept or dropped
        # once: the per-rule counts overlap, the kept list does not
        for name in failed:
            removed[name].append(d)
        if not failed:
            kept.append(d)
    return kept, removed


def _names(spec: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: the comma lists of --skip-rules, --exempt and
    scripts/curate_mix.py's --weights, blanks and stray commas ignored."""
    return [s.strip() for s in spec.split(",") if s.strip()]


# ---------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------
def _load(args) -> dict[str, list[Document]]:
    """load_domains with the command-line flags (scripts/curate_mix.py and
    scripts/curate_sweep.py load through it too, so every tool sees the same corpus)."""
    return load_domains(args.data, args.arith_docs, args.arith_lines,
                        args.max_bytes_per_domain, args.seed)


def nbytes(docs: list[Document]) -> int:
    """UTF-8 bytes: the unit of --max-bytes-per-domain and of every size printed."""
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
        # the first examples in corpus order, each with the feature value that made it
        # fail: the reader judges the rule's bet on what junk looks like
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
    enc = data.get_tokenizer()  # core/data.py's default BPE: the tokens train.py would count
    exact, near, _ = duplicate_clusters(docs, args)
    # Each column is one stage alone on the raw documents, not a pipeline (the mixture in
    # scripts/curate_mix.py chains rules -> dedup -> spans). Sets of id(): the very same
    # Document objects flow through every stage, so identity is exact and cheap, where
    # value equality would compare whole texts on every hash collision.
    gone_exact = {id(d) for d in drop_all_but_one(docs, exact)[1]}
    gone_near = {id(d) for d in drop_all_but_one(docs, near)[1]}
    kept = {id(d) for d in print_rules(docs, args, show=1)}
    print(f"\n{'domain':<10}{'docs':>7}{'bytes':>11}{'tokens':>10}"
          f"{'exact dup':>11}{'near dup':>10}{'rules':>8}")
    for name, ds in domains.items():
        # encode_ordinary: an "<|endoftext|>" inside a source file is text, not the
        # special token; the _batch form tokenizes on tiktoken's threads, in Rust
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
    # sorted, then a seeded permutation: the same sample every run, independent of how
    # the set happens to iterate
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
    # bins of width 0.1 by exact Jaccard; J = 1.0 exactly (no word replaced) joins the
    # last bin, which [lo, lo + 0.1) alone would leave out
    for lo in np.arange(0.0, 1.0, 0.1):
        rows = [p for p in planted if lo <= p[0] < lo + 0.1 or (lo >= 0.9 and p[0] == 1.0)]
        if rows:
            # theory is the S-curve averaged over the pairs' own J, not taken at the bin's
            # centre: with 14 × 8 it climbs from 0.57 at J = 0.7 to 0.92 at J = 0.8.
            # err vs expected: independent hashes give mean |est - J| = σ·sqrt(2/π);
            # a clearly larger err would mean the hash rows are correlated.
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
    # per domain: where the web-prose rules cut into real code shows up here
    for name, ds in domains.items():
        n_kept = sum(d.domain == name for d in kept)
        print(f"  {name:<10} keeps {n_kept:>5} / {len(ds):<5} documents")
    print(f"filter in {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables), shared with
# scripts/curate_mix.py and scripts/curate_sweep.py through add_flags.
# ---------------------------------------------------------------------------------------
CORPUS_KNOBS = [
    knob("--data", None, "a folder of text files: one more domain, named after it (not "
         "given: the built-in domains only)"),
    knob("--arith-docs", 300, "documents of synthetic arithmetic"),
    knob("--arith-lines", 64, "problems per arithmetic document"),
    knob("--max-bytes-per-domain", 0, "keep a seeded subset of each domain (0 = everything)"),
    knob("--seed", 0, "seeds subsets, hashes, sampling, training"),
    knob("--threads", 1, "torch CPU threads (tiny matrices: a second thread mostly waits, "
         "and on a shared box it spins)"),
    knob("--show", 3, "examples / clusters to print"),
    knob("--out-dir", OUT_DIR, "where mix.txt, mix.json, sweep.json go"),
]

# FineWeb's MinHash settings (Penedo et al. 2024): 5-word shingles, 14 bands × 8
LSH_KNOBS = [
    knob("--shingle", 5, "words per shingle (FineWeb: 5)"),
    knob("--permutations", 112, "MinHash hashes (FineWeb: 112)"),
    knob("--bands", 14, "LSH bands (FineWeb: 14)"),
    knob("--rows", 8, "hashes per band (FineWeb: 8)"),
    knob("--min-span-chars", 200, "shortest repeated line/paragraph removed"),
]

# min_words -> --min-words, defaulting to the paper's threshold; argparse stores it back
# as args.min_words, which is how quality_filter finds it by rule.name. A threshold is a
# float even where the paper's is whole (type=float; the default is shown as written).
RULE_KNOBS = [knob(f"--{r.name.replace('_', '-')}", r.default,
                   r.source.replace("%", "%%"), type=float)   # argparse formats help with %
              for r in RULES] + [
    knob("--skip-rules", "max_curly", "rules to turn off, comma-separated"),
    # '37+45=82' has no letter: min_alpha_words alone would remove all the arithmetic
    knob("--exempt", "arith", "domains the rules do not touch"),
]

# the mixture's stages (scripts/curate_mix.py)
PIPELINE_KNOBS = [
    knob("--filter", False, "apply the quality rules (written for web prose they remove "
         "about half of the code: see `filter`)"),
    knob("--dedup", "near", "drop copies: none, exact (normalized hash) or near (+ "
         "MinHash/LSH)", choices=["none", "exact", "near"]),
    knob("--spans", "none", "also drop repeated paragraphs/lines",
         choices=["none", "paragraph", "line"]),
]


def add_flags(p: argparse.ArgumentParser, max_bytes: int, lsh=True, rules=False,
              pipeline=False) -> None:
    """The flags of every corpus tool, defined once: this file's modes, and the parsers of
    scripts/curate_mix.py (pipeline=True) and scripts/curate_sweep.py. lsh: the MinHash
    flags; rules: one threshold flag per rule; pipeline: the mixture's stage choices."""
    add_knobs(p, [dataclasses.replace(k, default=max_bytes)
                  if k.dest == "max_bytes_per_domain" else k for k in CORPUS_KNOBS])
    for wanted, knobs in ((lsh, LSH_KNOBS), (rules, RULE_KNOBS), (pipeline, PIPELINE_KNOBS)):
        if wanted:
            add_knobs(p, knobs)


# mode: (command, help, which of add_flags' groups it takes)
MODES = {"stats": (cmd_stats, "documents, bytes, tokens; dups; rules", dict(rules=True)),
         "dedup": (cmd_dedup, "exact + MinHash/LSH near-duplicates, S-curve", {}),
         "filter": (cmd_filter, "quality rules: removals and examples",
                    dict(lsh=False, rules=True))}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description="Curate the corpus: domains, dedup, filters. The mixture "
                       "and the sweep run on their own: python -m scripts.curate_mix | "
                       "scripts.curate_sweep.",
                       formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, (_, help, groups) in MODES.items():
        add_flags(sub.add_parser(mode, help=help, formatter_class=HelpFormatter), 0, **groups)
    return p.parse_args(argv)


def check_args(args) -> None:
    """One validator for this file's parsers and those of scripts/curate_mix.py and
    scripts/curate_sweep.py: hasattr / getattr skip the flags a parser lacks (steps,
    tokens, subset, ... exist only in the scripts'). Runs before any loading, so a bad
    --bands × --rows fails in milliseconds, not after the corpus is read."""
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


def main(argv=None) -> None:
    args = parse_args(argv)
    check_args(args)
    # torch's threads only: this file's own work is numpy, hashlib and tiktoken; the
    # flag matters to the sweep, which trains models on the shared flags
    torch.set_num_threads(args.threads)
    MODES[args.mode][0](args)


if __name__ == "__main__":
    # run_cli (core/runtime.py): a UserError becomes one "error:" line and exit code 2
    run_cli(main)
