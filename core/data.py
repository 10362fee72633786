"""
core/data.py -- from text to training batches: a byte-level BPE tokenizer trained right here,
the built-in corpus, random batches that resume exactly, and a synthetic task with
answers a program can check (used by lora.py and rl.py).

What it teaches
- Why BPE (Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword
  Units"): a model sees tokens, not characters. Raw bytes (vocab 256) never meet an unknown
  symbol but make sequences long; whole words make them short but leave every rare word
  unknown. BPE starts from the 256 bytes (byte-level, GPT-2, Radford et al. 2019: any
  string encodes, nothing is ever unknown) and repeatedly merges the most frequent adjacent
  pair into a new token until the vocabulary is full.
- The pre-split (GPT-4's cl100k regex): text is first cut into chunks (words with their
  leading space, numbers of 1-3 digits, punctuation runs, whitespace) and merges never
  cross a chunk boundary, so " the" becomes a token but "e." never does, and numbers are
  tokenized in aligned groups of at most three digits.
- What it costs. Training: counting pairs once, then updating only the chunks a merge
  touches: seconds (printed by `python -m core.data`); recounting every pair before every
  merge, like the reference in the tests, would take minutes (~0.07 s x 3839 merges).
  Vocab size V trades parameters for sequence length: embedding and LM head hold
  V x d_model weights each and the softmax costs V per token, while a bigger V packs more
  bytes into each token (bytes/token, printed), so the same context window and the same
  attention FLOPs cover more text. Rare tokens, in exchange, are seen less often in
  training.
- Encoding is not ours: the learned ranks are handed to tiktoken (Rust, multithreaded),
  which runs the same pre-split and merges. Checkpoints carry the ranks
  (`encoding_to_state`), so any script rebuilds the exact tokenizer without the corpus.
"""
import argparse
import glob
import hashlib
import heapq
import json
import math
import os
import pathlib
import random
import re
import sysconfig
import time
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch

from core.cli import command_line, knob
from core.errors import UserError
from core.files import atomic_write
from core.runtime import run_cli

DEFAULT_VOCAB_SIZE = 4096     # = enc.n_vocab: 256 bytes + 3839 merges + <|endoftext|>
EOT = "<|endoftext|>"         # the one special token: separates documents
VAL_FRACTION = 0.05           # val = the last 5% of the token stream (see load_corpus)
TOKENIZER_TRAIN_BYTES = 10_000_000  # cap on the text BPE trains on (~1 s per MB here)
MAX_VOCAB_SIZE = 65535        # token ids are stored as uint16 on disk, like nanoGPT

# ---------------------------------------------------------------------------------------
# The pre-split pattern. GPT-4's (cl100k) pattern is
#   '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*
#   |\s*[\r\n]|\s+(?!\S)|\s+
# Python's `re` (which the trainer uses) has no \p{L} (letter) / \p{N} (number), and its
# \w \d \s disagree with the Rust regex inside tiktoken on some characters (combining
# marks, the zero-width joiner in emoji, U+001C..1F). So we spell the three classes out
# as explicit code point ranges taken from `unicodedata`: both engines then read the very
# same character sets and cut every string identically (tests/test_data.py checks it).
# On the stdlib corpus the chunks equal GPT-4's exactly. The string is long (~35 KB) but
# it is built, not typed. Letters and numbers all live below U+40000.
# ---------------------------------------------------------------------------------------
def _ranges(category_letter: str) -> str:
    """Regex class body of all code points whose Unicode category starts with the letter."""
    def esc(cp):  # \uXXXX / \UXXXXXXXX: the escapes both Python re and Rust regex accept
        return f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"
    out, start = [], None
    for cp in range(0x40001):
        inside = cp < 0x40000 and unicodedata.category(chr(cp))[0] == category_letter
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append(esc(start) if cp - 1 == start else f"{esc(start)}-{esc(cp - 1)}")
            start = None
    return "".join(out)


_L, _N = _ranges("L"), _ranges("N")
# \s as the Unicode White_Space property (what Rust's \s means), written out
_S = "\\t\\n\\v\\f\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
SPLIT_PATTERN = (
    "'(?:[sdmtSDMT]|[lL][lL]|[vV][eE]|[rR][eE])"  # contractions: 's 't 'll 've 're ...
    f"|[^\\r\\n{_L}{_N}]?+[{_L}]+"                # a word, with one leading space/punct
    f"|[{_N}]{{1,3}}"                             # numbers, in groups of 1-3 digits
    f"| ?[^{_S}{_L}{_N}]++[\\r\\n]*"              # punctuation runs (+ trailing newlines)
    f"|[{_S}]*[\\r\\n]"                           # whitespace ending in a newline
    f"|[{_S}]+(?![^{_S}])"                        # spaces, leaving the last for the word
    f"|[{_S}]+"
)


# ---------------------------------------------------------------------------------------
# The BPE trainer
# ---------------------------------------------------------------------------------------
def _merge_word(word: tuple, a: int, b: int, new: int) -> tuple:
    """Replace every (a, b) in word by new, left to right, non-overlapping."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _count_pairs(texts: list[str], pat_str: str):
    """Steps 1-2 of train_bpe: the unique chunks (as byte tuples) and their counts, every
    adjacent pair's count, and which chunks contain each pair."""
    # 1. Pre-split and count UNIQUE chunks: "self" appears 100k times but is tokenized once.
    counts = Counter()
    for text in texts:
        counts.update(re.findall(pat_str, text))
    words = [tuple(chunk.encode("utf-8")) for chunk in counts]
    freqs = list(counts.values())
    # 2. Count every adjacent pair once, and remember which chunks contain it.
    pair_counts, where = defaultdict(int), defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_counts[p] += freqs[i]
            where[p].add(i)
    return words, freqs, pair_counts, where


def train_bpe(texts: list[str], vocab_size: int, pat_str: str = SPLIT_PATTERN) -> dict[bytes, int]:
    """Learn byte-level BPE merges; returns tiktoken's mergeable_ranks (bytes -> rank).

    Ranks 0..255 are the single bytes, then one rank per merge in the order learned.
    vocab_size counts the <|endoftext|> special too, so we learn vocab_size - 257 merges,
    or fewer if the text runs out of pairs (every chunk already a single token)."""
    words, freqs, pair_counts, where = _count_pairs(texts, pat_str)
    # 3. A max-heap of (-count, pair). Counts change after every merge; instead of fixing
    #    entries in place we push a fresh entry for each changed pair and, when popping,
    #    drop entries whose count is no longer the pair's count (lazy invalidation).
    #    Ties go to the smallest (left id, right id): deterministic on every machine.
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    ranks = {bytes([i]): i for i in range(256)}
    token_bytes = [bytes([i]) for i in range(256)]
    while len(ranks) < vocab_size - 1 and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue  # stale entry
        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        # Rarely two different pairs spell the same bytes ("ab"+"c" vs "a"+"bc"): reuse the
        # existing token, since tiktoken identifies tokens by their bytes.
        new = ranks.get(merged)
        if new is None:
            new = ranks[merged] = len(token_bytes)
            token_bytes.append(merged)
        # 4. Incremental update: only chunks containing the pair change. Take their pairs
        #    out of the counts, merge, put the new pairs back in.
        changed = set()
        for i in where.pop(pair):
            w = words[i]
            nw = _merge_word(w, a, b, new)
            if len(nw) == len(w):
                continue  # the index is lazy too: this chunk lost the pair earlier
            for p in zip(w, w[1:]):
                pair_counts[p] -= freqs[i]
                changed.add(p)
            for p in zip(nw, nw[1:]):
                pair_counts[p] += freqs[i]
                changed.add(p)
                where[p].add(i)
            words[i] = nw
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
                where.pop(p, None)
    return ranks


def make_encoding(ranks: dict[bytes, int], pat_str: str = SPLIT_PATTERN) -> tiktoken.Encoding:
    """Hand our ranks to tiktoken; <|endoftext|> gets the id right after the last merge."""
    return tiktoken.Encoding(name=f"nanoscale_bpe_{len(ranks) + 1}", pat_str=pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT: len(ranks)})


def encoding_to_state(enc: tiktoken.Encoding) -> dict:
    """Plain data (strings, bytes -> int, str -> int) that goes into checkpoints and that
    torch.load(weights_only=True) reads back: rebuilds enc anywhere, no corpus.
    (tiktoken keeps its constructor arguments as these underscore attributes.)"""
    return {"name": enc.name, "pat_str": enc._pat_str,
            "mergeable_ranks": dict(enc._mergeable_ranks),
            "special_tokens": dict(enc._special_tokens)}


def encoding_from_state(state: dict) -> tiktoken.Encoding:
    """The inverse of encoding_to_state. The state comes from a file a user named (a
    checkpoint's "tokenizer"): anything but the four fields of the right types is one
    UserError, not a KeyError from deep inside tiktoken."""
    shape = dict(name=str, pat_str=str, mergeable_ranks=dict, special_tokens=dict)
    if not isinstance(state, dict) or not all(isinstance(state.get(k), t)
                                              for k, t in shape.items()):
        raise UserError("the checkpoint's tokenizer is not a tokenizer state of this repo "
                        "(needs name, pat_str, mergeable_ranks, special_tokens)")
    try:
        return tiktoken.Encoding(name=state["name"], pat_str=state["pat_str"],
                                 mergeable_ranks=state["mergeable_ranks"],
                                 special_tokens=state["special_tokens"])
    except Exception as e:        # bad regex, non-bytes ranks, ...: the same answer
        raise UserError(f"the checkpoint's tokenizer cannot be rebuilt "
                        f"({type(e).__name__}: {str(e)[:80]})") from None


# ---------------------------------------------------------------------------------------
# Cache: trained tokenizers and tokenized corpora live on disk, keyed by a hash of what
# produced them. Several torchrun ranks may build the same file at once, so every write
# goes through files.atomic_write (a temp file renamed into place, atomically): a reader
# sees the whole file or none. (Ranks may duplicate the work the very first time.)
# ---------------------------------------------------------------------------------------
def cache_dir() -> str:
    # the repo's .cache/ (this file lives in core/), or NANOSCALE_CACHE (the tests set it)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = os.environ.get("NANOSCALE_CACHE") or os.path.join(repo, ".cache")
    os.makedirs(d, exist_ok=True)
    return d


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# The corpus. Built in, no download: the top-level *.py files of the Python standard
# library of the interpreter running this script (Python 3.11: 168 files, 4.7 MB of real,
# varied, well-written code and docstrings), sorted by file name, one document per file.
# Any UTF-8 text file can replace it (--data PATH); a literal <|endoftext|> in it is read
# as a document separator.
# ---------------------------------------------------------------------------------------
def read_documents(data_path: str | None = None) -> tuple[str, list[str]]:
    """Returns (name, documents). Raises a one-line error a user can act on."""
    if data_path is None:
        stdlib = sysconfig.get_paths()["stdlib"]
        files = sorted(glob.glob(os.path.join(stdlib, "*.py")), key=os.path.basename)
        docs = [pathlib.Path(f).read_text(encoding="utf-8") for f in files]  # all UTF-8
        name = f"python{sysconfig.get_python_version()}-stdlib"
    else:
        if not os.path.isfile(data_path):
            raise UserError(f"data file not found: {data_path}")
        with open(data_path, "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{data_path} is not UTF-8 text "
                            f"(bad byte at offset {e.start})") from None
        docs = [d for d in text.split(EOT) if d]
        name = os.path.splitext(os.path.basename(data_path))[0]
    if not any(d.strip() for d in docs):
        raise UserError(f"corpus {data_path or name} is empty (no text to train on)")
    return name, docs


def _check_vocab_size(vocab_size: int) -> None:
    if not 258 <= vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(f"vocab_size must be in [258, {MAX_VOCAB_SIZE}] (256 bytes + >=1 merge"
                         f" + <|endoftext|>; ids are stored as uint16), got {vocab_size}")


def _tokenizer_from_docs(docs: list[str], vocab_size: int) -> tuple[tiktoken.Encoding, float]:
    """Train (or load from cache) the BPE for these documents. Returns (enc, train seconds)."""
    # Train on the first 95% of the text (about the part that becomes the train split, so
    # the tokenizer has not seen val), capped at TOKENIZER_TRAIN_BYTES for big --data files.
    total = sum(len(d.encode("utf-8")) for d in docs)
    budget = min(int(total * (1 - VAL_FRACTION)), TOKENIZER_TRAIN_BYTES)
    train_docs, n = [], 0
    for d in docs:
        if n >= budget:
            break
        train_docs.append(d[: budget - n])  # slices characters: budget is approximate
        n += len(train_docs[-1].encode("utf-8"))
    key = _hash(EOT.join(train_docs), vocab_size, SPLIT_PATTERN)
    # JSON, not a pickle: reading a cache must never run code. (A tokenizer-*.pkl left by an
    # older version is simply never opened: the tokenizer is trained again, once.)
    path = os.path.join(cache_dir(), f"tokenizer-{key}.json")
    saved = _read_tokenizer_cache(path)
    if saved is not None:
        return encoding_from_state(saved["state"]), saved["train_seconds"]
    print(f"[data] training BPE tokenizer: vocab {vocab_size} on {n / 1e6:.2f} MB ...", flush=True)
    t0 = time.perf_counter()
    ranks = train_bpe(train_docs, vocab_size)
    seconds = time.perf_counter() - t0
    enc = make_encoding(ranks)
    if enc.n_vocab < vocab_size:
        print(f"[data] the text ran out of pairs: vocab is {enc.n_vocab}, not {vocab_size}")
    print(f"[data] trained {len(ranks) - 256} merges in {seconds:.1f} s -> {path}", flush=True)
    atomic_write(path, lambda f: f.write(_tokenizer_cache_json(enc, seconds)))
    return enc, seconds


def _tokenizer_cache_json(enc: tiktoken.Encoding, seconds: float) -> bytes:
    """The cache file: the tokenizer's state with each token's bytes as hex, rank order."""
    state = encoding_to_state(enc)
    ranks = sorted(state["mergeable_ranks"].items(), key=lambda kv: kv[1])
    return json.dumps({"name": state["name"], "pat_str": state["pat_str"],
                       "special_tokens": state["special_tokens"],
                       "mergeable_ranks": [[b.hex(), r] for b, r in ranks],
                       "train_seconds": seconds}).encode("utf-8")


def _read_tokenizer_cache(path: str) -> dict | None:
    """{'state', 'train_seconds'} from the cache, or None if absent or unreadable (then the
    tokenizer is simply trained again and the file rewritten)."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        state = {"name": saved["name"], "pat_str": saved["pat_str"],
                 "special_tokens": dict(saved["special_tokens"]),
                 "mergeable_ranks": {bytes.fromhex(h): r for h, r in saved["mergeable_ranks"]}}
        return {"state": state, "train_seconds": float(saved["train_seconds"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def get_tokenizer(data_path: str | None = None,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> tiktoken.Encoding:
    """The BPE for a corpus (built-in stdlib when data_path is None), trained once, cached."""
    _check_vocab_size(vocab_size)
    return _tokenizer_from_docs(read_documents(data_path)[1], vocab_size)[0]


@dataclass
class Corpus:
    enc: tiktoken.Encoding
    train: np.memmap          # uint16 token ids, documents joined by <|endoftext|>
    val: np.memmap
    name: str
    bytes_per_token: float    # UTF-8 bytes / token; raw bytes would be 1.0
    n_docs: int
    n_bytes: int
    tokenizer_seconds: float  # how long training the BPE took (when it was trained)


def load_corpus(data_path: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Corpus:
    """Tokenize the corpus once into train.bin / val.bin (uint16 memmaps, as in nanoGPT).

    Split: the token stream (documents in file-name order) is cut at 95%: val is the tail,
    i.e. whole files the model never trains on, not a random sample of the same files."""
    _check_vocab_size(vocab_size)
    name, docs = read_documents(data_path)
    enc, seconds = _tokenizer_from_docs(docs, vocab_size)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    ranks_key = _hash(*sorted(enc._mergeable_ranks.items()))
    key = _hash(EOT.join(docs), enc.name, ranks_key, VAL_FRACTION)
    paths = [os.path.join(cache_dir(), f"tokens-{key}-{split}.bin") for split in ("train", "val")]
    if not all(os.path.exists(p) for p in paths):
        eot = enc.encode_single_token(EOT)
        ids = []
        for toks in enc.encode_ordinary_batch(docs):  # threads in Rust, fast
            ids.extend(toks)
            ids.append(eot)
        ids = np.array(ids[:-1], dtype=np.uint16)
        n_val = int(len(ids) * VAL_FRACTION)
        if n_val < 2 or len(ids) - n_val < 2:
            raise UserError(f"corpus {data_path or name} is too small: {len(ids)} tokens leave "
                             f"{n_val} for val ({VAL_FRACTION:.0%}); each split needs >= 2")
        for path, part in zip(paths, (ids[: len(ids) - n_val], ids[len(ids) - n_val:])):
            atomic_write(path, lambda f, part=part: f.write(part.tobytes()))
    train, val = (np.memmap(p, dtype=np.uint16, mode="r") for p in paths)
    n_tokens = len(train) + len(val) - (len(docs) - 1)  # separators are not text
    return Corpus(enc, train, val, name, n_bytes / n_tokens, len(docs), n_bytes, seconds)


# ---------------------------------------------------------------------------------------
# Batches. The offsets are a pure function of (seed, step, rank): resuming at step s
# reproduces the exact batch an uninterrupted run would have seen, and every data-parallel
# rank draws different rows without any communication.
# ---------------------------------------------------------------------------------------
def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int,
              rank: int = 0, device: str | torch.device = "cpu"):
    """(x, y): batch_size rows of seq_len tokens and the same rows shifted by one."""
    if len(tokens) < seq_len + 1:
        raise UserError(f"need at least seq_len + 1 = {seq_len + 1} tokens, "
                        f"the split has {len(tokens)}")
    rng = np.random.default_rng([seed, step, rank])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    rows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    xy = torch.from_numpy(rows).to(device)
    return xy[:, :-1], xy[:, 1:]  # y[t] = x[t + 1]: predict the next token


def unigram_baseline_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) on val of token frequencies counted on train (add-one
    smoothing). A model that ignores context gets this; a trained GPT must beat it."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val, dtype=np.int64)].mean())


# ---------------------------------------------------------------------------------------
# A task with checkable answers: "37+45=" -> "82". A program scores a completion exactly,
# which is what LoRA fine-tuning measures and what RL uses as its reward.
# The terminator is "\n": a normal token for any tokenizer, and generation can stop on it.
# Held-out split: a problem belongs to "test" iff a hash of its prompt says so (~10%), so
# train and test never share a problem, whatever seeds or sizes are asked for.
# ---------------------------------------------------------------------------------------
TERMINATOR = "\n"
TEST_FRACTION = 0.1


@dataclass(frozen=True)
class Problem:
    prompt: str   # "37+45="
    answer: str   # "82"


def problem_split(prompt: str) -> str:
    """'train' or 'test', from a hash of the prompt (stable across machines and runs)."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return "test" if h % 1000 < TEST_FRACTION * 1000 else "train"


def make_problems(n: int, seed: int, digits: int = 2, ops: str = "+-",
                  split: str = "train") -> list[Problem]:
    """n problems of the split, operands with up to `digits` digits, drawn with
    replacement. For "-" the larger operand comes first, so answers are never negative."""
    if not ops or set(ops) - set("+-*") or digits < 1 or split not in ("train", "test"):
        raise UserError(f"need ops from '+-*', digits >= 1, split train|test; "
                        f"got {ops!r}, {digits}, {split!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(1000 * (n + 10)):  # rejection sampling: keep the split's problems
        if len(out) == n:
            break
        a = rng.randrange(10 ** digits)
        b = rng.randrange(10 ** digits)
        op = rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if problem_split(prompt) == split:
            if op == "+":
                answer = a + b
            elif op == "-":
                answer = a - b
            else:
                answer = a * b
            out.append(Problem(prompt, str(answer)))
    if len(out) < n:
        raise UserError(f"too few {split} problems with digits={digits}, ops={ops!r}")
    return out


def format_example(problem: Problem) -> str:  # what the model trains on: "37+45=82\n"
    return problem.prompt + problem.answer + TERMINATOR


def extract_answer(completion: str) -> str:
    """The answer part of what a model wrote after the prompt: up to the first newline
    (or <|endoftext|>), stripped."""
    return completion.split(TERMINATOR, 1)[0].split(EOT, 1)[0].strip()


def score(completion: str, answer: str) -> float:
    return 1.0 if extract_answer(completion) == answer.strip() else 0.0


def pack_answers(prompts: list, answers: list) -> tuple:
    """Token rows prompt + answer, right-padded with 0. -> (seq (N, L) long, mask (N, L-1)
    bool: True where position t predicts an answer token). Fine-tuning (lora.py) trains on
    the masked positions only; RL (rl.py) weighs their log-probabilities. Causal attention
    means the padding never changes the real positions' outputs."""
    L = max(len(p) + len(a) for p, a in zip(prompts, answers))
    seq = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L - 1, dtype=torch.bool)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) - 1 + len(a)] = True
    return seq, mask


def format_reward(completion: str) -> float:
    """1.0 if the completion is shaped right (digits, then the terminator), right or not."""
    is_number = re.fullmatch(r"-?\d+", extract_answer(completion))
    return 1.0 if TERMINATOR in completion and is_number else 0.0


# ---------------------------------------------------------------------------------------
# `python -m core.data`: the corpus and its tokenizer at a glance, or a sample of the task

KNOBS = [
    knob("mode", "corpus", "corpus: tokenizer + corpus stats; task: sample arithmetic problems",
         nargs="?", choices=["corpus", "task"]),
    knob("--data", None, "UTF-8 text file; not given: the built-in Python stdlib corpus"),
    knob("--vocab-size", DEFAULT_VOCAB_SIZE, "total vocab incl. <|endoftext|>"),
    knob("--n", 8, "task: problems to show"),
    knob("--seed", 0, "task: problem seed"),
    knob("--digits", 2, "task: max digits per operand"),
    knob("--ops", "+-", "task: operators to use, from '+-*'"),
]


def main(argv=None) -> None:
    p = command_line("Train/load the BPE tokenizer and corpus, or show the task.", {None: KNOBS},
                     formatter=argparse.ArgumentDefaultsHelpFormatter)
    args = p.parse_args(argv)
    if args.mode == "task":
        for split in ("train", "test"):  # test = the ~10% of prompts the hash holds out
            for prob in make_problems(args.n // 2, args.seed, args.digits, args.ops, split):
                print(f"{split:5s} prompt {prob.prompt!r:10s} answer {prob.answer!r:7s} "
                      f"example {format_example(prob)!r}")
        return
    t0 = time.perf_counter()
    c = load_corpus(args.data, args.vocab_size)
    print(f"corpus     {c.name}: {c.n_docs} documents, {c.n_bytes / 1e6:.2f} MB  "
          f"(loaded in {time.perf_counter() - t0:.1f} s)")
    print(f"tokenizer  n_vocab {c.enc.n_vocab}, trained in {c.tokenizer_seconds:.1f} s "
          f"(cached in {cache_dir()})")
    print(f"tokens     train {len(c.train):,} | val {len(c.val):,}")
    print(f"bytes/tok  {c.bytes_per_token:.2f}  (raw bytes: 1.00)")
    loss = unigram_baseline_loss(c.train, c.val, c.enc.n_vocab)
    uniform = math.log(c.enc.n_vocab)
    print(f"unigram    val loss {loss:.3f} nats (uniform: ln {c.enc.n_vocab} = {uniform:.3f})")
    sample = "    def __init__(self, name='Zoë'):  # 12345 emoji 🙂\n"
    pieces = [c.enc.decode_single_token_bytes(t) for t in c.enc.encode(sample)]
    print(f"sample     {len(sample.encode())} bytes -> {len(pieces)} tokens: "
          + "|".join(b.decode("utf-8", "backslashreplace") for b in pieces).replace("\n", "\\n"))


if __name__ == "__main__":
    run_cli(main)      # a UserError: one `error:` line, exit status 2
