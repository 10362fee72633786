"""Tests for core/data.py: tokenizer (trainer vs a from-scratch reference, tiktoken agreement,
round trips, cache), corpus, batches, baseline, the arithmetic task, errors, CLI."""
import math
import os
import random
import re
import sys
from collections import Counter

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from core import data  # noqa: E402
from harness import python_cmd, run_together  # noqa: E402

UNICODE_SAMPLES = [
    "", "a", " ", "\n", "\r\n", "\r\n\r\n  \t", "\x00", "a\x00b", "\x1c\x1d\x1e\x1f",
    "hello world", "  leading and trailing  ", "I'm we'll they've YOU'RE it's",
    "naïve café — “quotes” ½ ² Ⅻ", "e\u0301 a\u0300\u0316 combining",
    "日本語のテキスト、中文字符。한국어", "مرحبا بالعالم שלום עולם",
    "emoji 🙂👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷", "\u00a0nbsp\u2003em\u3000ideo",
    "numbers 1 12 123 1234 12345 ١٢٣ ４５６", "\U0010ffff\U000e0001\U00020000",
    "def f(x):\n\treturn x ** 2  # comment\n", "__init__ self.__dict__ ___",
]


def random_text(rng: random.Random, n: int) -> str:
    """Mix of ASCII, common non-ASCII and any code point (no surrogates: not UTF-8)."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice("abcXYZ 0123456789 \n\r\t.,'s'll_-()é"))
        elif r < 0.8:
            out.append(chr(rng.randrange(0x80, 0x3400)))
        else:
            cp = rng.randrange(0x110000)
            out.append(chr(cp if not 0xD800 <= cp < 0xE000 else cp + 0x800))
    return "".join(out)


@pytest.fixture(scope="module")
def small_text() -> str:
    _, docs = data.read_documents()  # stdlib: always present
    return "\n".join(d[:4000] for d in docs[:12]) + "\n" + "\n".join(UNICODE_SAMPLES)


@pytest.fixture(scope="module")
def small_enc(small_text):
    return data.make_encoding(data.train_bpe([small_text], 600))


# ---------------------------------------------------------------------------- pre-split
def test_split_pattern_same_in_python_re_and_tiktoken():
    """The trainer splits with Python's re, tiktoken with Rust regex: same pattern string,
    same chunks. Probe: make every re-chunk one token; tiktoken returns exactly those
    tokens only if it cut the text at the same places."""
    rng = random.Random(0)
    texts = UNICODE_SAMPLES + [random_text(rng, 400) for _ in range(50)]
    text = "|".join(texts)
    chunks = re.findall(data.SPLIT_PATTERN, text)
    assert "".join(chunks) == text
    ranks = {bytes([i]): i for i in range(256)}
    for c in sorted({c.encode() for c in chunks}):
        ranks.setdefault(c, len(ranks))
    enc = data.make_encoding(ranks)
    assert enc.encode_ordinary(text) == [ranks[c.encode()] for c in chunks]


def test_split_pattern_matches_gpt4_examples():
    split = lambda s: re.findall(data.SPLIT_PATTERN, s)  # noqa: E731
    assert split("Hello world's 12345!!\n\n  x") == ["Hello", " world", "'s", " ", "123", "45", "!!\n\n", " ", " x"]
    assert split("    return self._x") == ["   ", " return", " self", "._", "x"]


# ---------------------------------------------------------------------------- trainer
def reference_bpe(texts, vocab_size, pat):
    """Obviously correct, slow BPE: recount every pair from scratch before each merge."""
    counts = Counter(c for t in texts for c in re.findall(pat, t))
    words = [[list(c.encode()), f] for c, f in counts.items()]
    ranks = {bytes([i]): i for i in range(256)}
    tb = [bytes([i]) for i in range(256)]
    while len(ranks) < vocab_size - 1:
        pairs = Counter()
        for w, f in words:
            for p in zip(w, w[1:]):
                pairs[p] += f
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, then smallest ids
        merged = tb[a] + tb[b]
        if merged not in ranks:
            ranks[merged] = len(tb)
            tb.append(merged)
        new = ranks[merged]
        for item in words:
            w, out, i = item[0], [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            item[0] = out
    return ranks, {bytes(c.encode()): w for (c, _), (w, _) in zip(counts.items(), words)}


@pytest.mark.parametrize("which", ["stdlib", "repetitive"])
def test_trainer_equals_reference(small_text, which):
    if which == "stdlib":
        texts, vocab = [small_text[:12000]], 450
    else:  # overlapping runs, ties everywhere, runs out of pairs before the vocab fills
        texts, vocab = ["aaaaaaa aaa abababab abab bbbb ab ba aab " * 3, "xyzxyz zyx"], 400
    fast = data.train_bpe(texts, vocab)
    ref, ref_words = reference_bpe(texts, vocab, data.SPLIT_PATTERN)
    assert list(fast.items()) == list(ref.items())  # same merges, same order
    if which == "repetitive":
        assert len(fast) < vocab - 1  # stopped early
    # tiktoken, handed the ranks, reproduces the trainer's own tokenization of every chunk
    enc = data.make_encoding(fast)
    for chunk, word in ref_words.items():
        assert enc.encode_ordinary(chunk.decode()) == word


def test_trainer_deterministic_and_ranks_contiguous(small_text):
    a = data.train_bpe([small_text], 520)
    assert a == data.train_bpe([small_text], 520)
    assert sorted(a.values()) == list(range(519))
    assert all(a[bytes([i])] == i for i in range(256))


# ---------------------------------------------------------------------------- round trips
def test_roundtrip_unicode_and_random(small_enc):
    enc = small_enc
    assert enc.n_vocab == 600 and enc.eot_token == 599
    rng = random.Random(1234)
    texts = UNICODE_SAMPLES + [random_text(rng, rng.randrange(1, 300)) for _ in range(200)]
    for t in texts:
        ids = enc.encode_ordinary(t)
        assert enc.decode(ids) == t
        assert enc.decode_bytes(ids) == t.encode("utf-8")
        assert b"".join(enc.decode_single_token_bytes(i) for i in ids) == t.encode("utf-8")
        assert max(ids, default=0) < enc.eot_token
    # random valid UTF-8 from random bytes: whatever survives decoding round-trips
    for _ in range(50):
        raw = bytes(rng.randrange(256) for _ in range(200))
        t = raw.decode("utf-8", errors="replace")
        assert enc.decode_bytes(enc.encode_ordinary(t)) == t.encode("utf-8")
    # the separator is one special token, and only when allowed
    ids = enc.encode("a<|endoftext|>b", allowed_special={data.EOT})
    assert enc.eot_token in ids and enc.decode(ids) == "a<|endoftext|>b"


def test_encoding_state_roundtrip(small_enc, tmp_path):
    # through a checkpoint file read the safe way: the state must be plain data
    torch.save(data.encoding_to_state(small_enc), tmp_path / "tok.pt")
    state = torch.load(tmp_path / "tok.pt", weights_only=True)
    enc2 = data.encoding_from_state(state)
    assert enc2.n_vocab == small_enc.n_vocab and enc2.name == small_enc.name
    assert enc2.special_tokens_set == small_enc.special_tokens_set
    for t in UNICODE_SAMPLES + ["x<|endoftext|>y"]:
        assert enc2.encode(t, allowed_special="all") == small_enc.encode(t, allowed_special="all")


def test_compresses_better_than_bytes(small_enc, small_text):
    assert len(small_text.encode()) / len(small_enc.encode_ordinary(small_text)) > 1.8


# ---------------------------------------------------------------------------- corpus + cache
def write(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(p)


def test_custom_corpus_and_cache_hit(tmp_path, monkeypatch, small_text):
    monkeypatch.setenv("NANOSCALE_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path, "mine.txt", small_text + "<|endoftext|>second document")
    c = data.load_corpus(path, vocab_size=400)
    assert c.name == "mine" and c.n_docs == 2 and c.enc.n_vocab == 400
    assert c.train.dtype == np.uint16 and len(c.val) == int((len(c.train) + len(c.val)) * data.VAL_FRACTION)
    assert c.bytes_per_token > 1.5
    whole = np.concatenate([c.train, c.val]).tolist()
    assert whole.count(c.enc.eot_token) == 1
    assert c.enc.decode(whole) == small_text + "<|endoftext|>second document"
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 3 and not any(f.startswith(".tmp") for f in files)

    # second call: nothing is retrained or re-tokenized
    def boom(*a, **k):
        raise AssertionError("cache miss")
    monkeypatch.setattr(data, "train_bpe", boom)
    monkeypatch.setattr(data.tiktoken.Encoding, "encode_ordinary_batch", boom)
    c2 = data.load_corpus(path, vocab_size=400)
    assert np.array_equal(c2.train, c.train) and np.array_equal(c2.val, c.val)
    assert data.get_tokenizer(path, 400).encode(small_text) == c.enc.encode(small_text)
    with pytest.raises(AssertionError, match="cache miss"):  # other vocab: another key
        data.get_tokenizer(path, 401)


def test_tokenizer_cache_is_json_and_an_old_pickle_is_never_opened(tmp_path, monkeypatch, small_text):
    """The cache holds data only; a planted tokenizer-*.pkl (what older versions wrote) is
    not unpickled: nothing it asks for runs, and the tokenizer is trained again."""
    import json
    import pickle
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOSCALE_CACHE", str(cache))
    path = write(tmp_path, "mine.txt", small_text)
    enc = data.get_tokenizer(path, 300)
    (tok_file,) = [f for f in os.listdir(cache) if f.startswith("tokenizer-")]
    assert tok_file.endswith(".json")
    saved = json.loads((cache / tok_file).read_text())
    assert len(saved["mergeable_ranks"]) == enc.n_vocab - 1
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))
    (cache / tok_file.replace(".json", ".pkl")).write_bytes(pickle.dumps(Evil()))
    (cache / tok_file).write_text("{not json")        # a corrupt cache: rebuilt, not fatal
    enc2 = data.get_tokenizer(path, 300)
    assert not marker.exists()
    assert enc2.encode(small_text) == enc.encode(small_text)
    assert json.loads((cache / tok_file).read_text())["name"] == enc.name


def test_default_corpus():
    """The one test on the built-in corpus at the default vocab (cached for later runs)."""
    c = data.load_corpus()
    assert c.enc.n_vocab == data.DEFAULT_VOCAB_SIZE and c.n_docs > 100
    assert c.bytes_per_token > 2.5  # measured 3.67 on Python 3.11
    assert len(c.val) > 10_000 and len(c.train) > 15 * len(c.val)
    assert int(c.train.max()) < c.enc.n_vocab
    _, docs = data.read_documents()
    n = len(c.enc.encode_ordinary(docs[0]))
    assert c.enc.decode(c.train[:n].tolist()) == docs[0] and c.train[n] == c.enc.eot_token
    loss = data.unigram_baseline_loss(c.train, c.val, c.enc.n_vocab)
    assert 4.0 < loss < math.log(c.enc.n_vocab) - 1.0
    assert data.get_tokenizer().encode("def f(): pass") == c.enc.encode("def f(): pass")


@pytest.mark.parametrize("content,match", [
    ("", "empty"), ("   \n\t\n", "empty"), (b"ok \xff\xfe bad", "not UTF-8"), ("hi", "too small"),
])
def test_bad_corpus_errors(tmp_path, monkeypatch, content, match):
    monkeypatch.setenv("NANOSCALE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=match):
        data.load_corpus(write(tmp_path, "bad.txt", content), vocab_size=300)


def test_missing_file_and_bad_vocab(tmp_path):
    with pytest.raises(ValueError, match="not found: .*nope.txt"):
        data.load_corpus(str(tmp_path / "nope.txt"))
    for v in (257, 65536, 0):
        with pytest.raises(ValueError, match="vocab_size must be in"):
            data.get_tokenizer(vocab_size=v)


# ---------------------------------------------------------------------------- batches
def test_get_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = data.get_batch(tokens, 4, 16, seed=7, step=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)  # consecutive slices
    x2, y2 = data.get_batch(tokens, 4, 16, seed=7, step=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # pure function of (seed, step, rank)
    assert not torch.equal(x, data.get_batch(tokens, 4, 16, seed=7, step=4)[0])
    assert not torch.equal(x, data.get_batch(tokens, 4, 16, seed=7, step=3, rank=1)[0])
    x, y = data.get_batch(tokens[:17], 8, 16, seed=0, step=0)  # exactly seq_len + 1 tokens
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[0], torch.arange(1, 17))
    with pytest.raises(ValueError, match="seq_len"):
        data.get_batch(tokens[:16], 2, 16, seed=0, step=0)


def test_unigram_baseline():
    assert data.unigram_baseline_loss(np.array([0, 0, 1]), np.array([0]), 3) == pytest.approx(math.log(2))
    rng = np.random.default_rng(0)
    skewed = rng.zipf(1.5, 20000) % 500
    loss = data.unigram_baseline_loss(skewed[:15000], skewed[15000:], 500)
    assert 0 < loss < math.log(500) - 0.5


# ---------------------------------------------------------------------------- task
def test_task_problems():
    ps = data.make_problems(300, seed=1, digits=2, ops="+-*")
    assert ps == data.make_problems(300, seed=1, digits=2, ops="+-*")
    assert ps != data.make_problems(300, seed=2, digits=2, ops="+-*")
    assert {p.prompt[:-1].strip("0123456789")[0] for p in ps} == {"+", "-", "*"}
    for p in ps:
        a, op, b = re.fullmatch(r"(\d+)([+*-])(\d+)=", p.prompt).groups()
        assert len(a) <= 2 and len(b) <= 2 and int(p.answer) >= 0
        assert int(p.answer) == eval(p.prompt[:-1])
        assert data.format_example(p) == p.prompt + p.answer + "\n"
        assert data.score(p.answer + "\n", p.answer) == 1.0


def test_task_heldout_split_disjoint():
    train = data.make_problems(3000, seed=0, digits=2, split="train")
    test = data.make_problems(500, seed=0, digits=2, split="test")
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert all(data.problem_split(p.prompt) == "test" for p in test)
    assert len(data.make_problems(20, seed=3, digits=1, ops="+", split="test")) == 20


def test_task_scoring():
    assert data.extract_answer(" 82\n37+1=38\n") == "82"
    assert data.extract_answer("82<|endoftext|>junk") == "82"
    assert data.score("82\n", "82") == 1.0 and data.score("82", "82") == 1.0
    assert data.score("820\n", "82") == 0.0 and data.score("8\n2", "82") == 0.0
    assert data.format_reward("17\n") == 1.0 and data.format_reward("17") == 0.0
    assert data.format_reward("seventeen\n") == 0.0
    with pytest.raises(ValueError):
        data.make_problems(3, seed=0, ops="/")


# ---------------------------------------------------------------------------- CLI
def test_cli(tmp_path, small_text):
    """`python -m core.data`'s modes, the four runs side by side (no shared files)."""
    helped, task, missing, trained = run_together([
        python_cmd("-m core.data", "--help"),
        python_cmd("-m core.data", "task", "--n", "4"),
        python_cmd("-m core.data", "--data", tmp_path / "missing.txt"),
        python_cmd("-m core.data", "--data", write(tmp_path, "t.txt", small_text),
                   "--vocab-size", "300")],
        timeout=120, env={"NANOSCALE_CACHE": str(tmp_path)})
    assert helped.returncode == 0
    for knob in ("--data", "--vocab-size", "--n", "--seed", "--digits", "--ops", "4096"):
        assert knob in helped.output
    assert task.returncode == 0 and task.output.count("example") == 4 and "test " in task.output
    assert missing.returncode != 0 and "error: data file not found" in missing.output
    assert "Traceback" not in missing.output
    assert trained.returncode == 0 and "bytes/tok" in trained.output, trained.output
    assert "unigram" in trained.output
