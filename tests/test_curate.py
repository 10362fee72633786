"""Tests for curate.py: MinHash against exact Jaccard and a textbook signature, LSH recall
and its S-curve, exact and span dedup (planted copies, order independence), every quality
rule on crafted documents, the mixture sampler's token shares, epochs and seeds, the
per-domain loss against the model's own loss, bad input, and `mix` end to end."""
import argparse
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import curate
from scripts import curate_mix
from scripts import curate_sweep
from core import data
from harness import run_python
from model import GPT, get_config
from core.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lsh_args(permutations=100, bands=20, rows=5, shingle=5, seed=0):
    return argparse.Namespace(permutations=permutations, bands=bands, rows=rows, shingle=shingle, seed=seed)


def sets_with_jaccard(rng, j, n_union=400):
    """Two sets of random 64-bit ids whose exact Jaccard is (about) j."""
    ids = rng.integers(0, 2 ** 63, size=n_union, dtype=np.uint64)
    common = int(round(j * n_union))
    rest = n_union - common
    a = np.unique(np.concatenate([ids[:common], ids[common:common + rest // 2]]))
    b = np.unique(np.concatenate([ids[:common], ids[common + rest // 2:]]))
    return a, b


def random_words(rng, n, vocab):
    return [vocab[i] for i in rng.integers(0, len(vocab), size=n)]


@pytest.fixture(scope="module")
def vocab():
    rng = random.Random(0)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(5000)]


# ---------------------------------------------------------------------------- MinHash
def test_signature_equals_textbook_minimum():
    """Every row is min over shingles of (a·x + b) mod p, computed in exact Python ints."""
    rng = np.random.default_rng(1)
    shingles = np.unique(rng.integers(0, 2 ** 64, size=300, dtype=np.uint64))
    hasher = curate.MinHasher(16, seed=3)
    sig = hasher.signature(shingles)
    for i in range(16):
        a, b = int(hasher.a[i, 0]), int(hasher.b[i, 0])
        ref = min((a * (int(x) % curate.PRIME) + b) % curate.PRIME for x in shingles)
        assert int(sig[i]) == ref


def test_minhash_estimates_jaccard_within_005():
    """k = 2048 hashes: the estimate's std is sqrt(J(1-J)/k) <= 0.011, so ±0.05 is 4.5σ."""
    rng = np.random.default_rng(0)
    hasher = curate.MinHasher(2048, seed=0)
    errors = []
    for j in np.linspace(0.0, 1.0, 41):
        a, b = sets_with_jaccard(rng, j)
        exact = curate.exact_jaccard(a, b)
        est = curate.estimated_jaccard(hasher.signature(a), hasher.signature(b))
        assert abs(est - exact) <= 0.05, (j, exact, est)
        errors.append(est - exact)
    assert abs(np.mean(errors)) < 0.01  # unbiased: errors do not all lean one way


def test_shingle_jaccard_equals_python_sets(vocab):
    """Hashed shingles give the same Jaccard as sets of word tuples (no collisions)."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        words = random_words(rng, 200, vocab)
        other = [w if rng.random() > 0.1 else vocab[int(rng.integers(len(vocab)))] for w in words]
        ta, tb = " ".join(words), " ".join(other)
        ref_a = {tuple(words[i:i + 5]) for i in range(len(words) - 4)}
        ref_b = {tuple(other[i:i + 5]) for i in range(len(other) - 4)}
        ref = len(ref_a & ref_b) / len(ref_a | ref_b)
        got = curate.exact_jaccard(curate.shingle_set(curate.word_ids(ta), 5), curate.shingle_set(curate.word_ids(tb), 5))
        assert got == pytest.approx(ref, abs=1e-12)
    assert len(curate.shingle_set(curate.word_ids("one two"), 5)) == 1  # short text: one shingle


def test_hashes_are_the_same_in_another_process():
    text = "The quick brown fox jumps over the lazy dog again and again"
    here = curate.shingle_set(curate.word_ids(text), 3).tolist()
    code = (f"import curate; print(curate.shingle_set(curate.word_ids({text!r}), 3).tolist()); "
            f"print(curate.stable_unit('a', 1))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == str(here) and float(lines[1]) == curate.stable_unit("a", 1)


# ---------------------------------------------------------------------------- LSH
def test_lsh_finds_planted_near_duplicates(vocab):
    """200 documents, 60 of them with a planted copy at Jaccard >= 0.8: >= 95% found, and
    the unrelated documents stay apart. 20 bands × 5 rows: P(0.8) = 0.9996 by the S-curve
    (FineWeb's 14 × 8 gives 0.924 at 0.8: it trades recall for fewer false candidates)."""
    rng = np.random.default_rng(4)
    docs, planted = [], []
    for i in range(200):
        words = random_words(rng, 300, vocab)
        docs.append(curate.Document("t", f"d{i:03d}", " ".join(words)))
        if i < 60:
            copy = list(words)
            for k in rng.choice(300, size=int(rng.integers(1, 7)), replace=False):
                copy[k] = vocab[int(rng.integers(len(vocab)))]
            docs.append(curate.Document("t", f"d{i:03d}-copy", " ".join(copy)))
            planted.append((len(docs) - 2, len(docs) - 1))
    args = lsh_args()
    _, near, info = curate.duplicate_clusters(docs, args)
    same = {i: min(c) for c in near for i in c}
    found = 0
    for a, b in planted:
        assert curate.exact_jaccard(info["sets"][a], info["sets"][b]) >= 0.8
        found += a in same and same.get(a) == same.get(b)
    assert found >= 0.95 * len(planted)
    assert all(len(c) == 2 for c in near)  # nothing unrelated merged in


@pytest.mark.parametrize("s", [0.3, 0.5])
def test_lsh_false_candidates_follow_the_s_curve(s):
    """Pairs at exact Jaccard s: the share that becomes candidates matches
    1 - (1 - s^r)^b within 4 binomial standard errors."""
    rng = np.random.default_rng(int(s * 100))
    bands, rows, n = 20, 5, 400
    hasher = curate.MinHasher(bands * rows, seed=int(s * 10))
    hits, theory = 0, []
    for _ in range(n):
        a, b = sets_with_jaccard(rng, s, n_union=200)
        theory.append(curate.s_curve(curate.exact_jaccard(a, b), bands, rows))
        sigs = np.stack([hasher.signature(a), hasher.signature(b)])
        hits += bool(curate.lsh_buckets(sigs, bands, rows))
    p = float(np.mean(theory))
    stderr = math.sqrt(p * (1 - p) / n)
    assert abs(hits / n - p) <= 4 * stderr + 1e-9, (hits / n, p, stderr)


def test_lsh_parameters_are_checked():
    with pytest.raises(UserError, match="bands × rows"):
        curate.check_lsh(112, 14, 7)
    with pytest.raises(UserError, match="shingle"):
        curate.shingle_set(np.zeros(3, dtype=np.uint64), 0)


def test_union_find_joins_groups_that_share_a_member_through_long_chains():
    """Candidate groups overlap (one document in two buckets): the components must join
    across them. A chain built so that a member re-pointed by itself (parent[j] = root,
    not parent[find(j)]) leaves its own tree's other members behind."""
    groups = [[2, 3], [0, 3], [1, 0], [5, 6], [7, 6], [8, 9]]     # 3, then 6: not roots
    comps = sorted(sorted(c) for c in curate.union_find(10, groups))
    assert comps == [[0, 1, 2, 3], [5, 6, 7], [8, 9]]


def test_documents_without_a_shingle_are_never_candidates():
    """An empty (or shorter than one shingle) document's signature is all PRIME: without
    the filter every such document would share every bucket and count as duplicates."""
    hasher = curate.MinHasher(112, seed=0)
    empty = hasher.signature(np.zeros(0, dtype=np.uint64))
    other = hasher.signature(np.arange(50, dtype=np.uint64))
    sigs = np.stack([empty, empty, empty, other])
    assert curate.lsh_buckets(sigs, 14, 8) == []


# ---------------------------------------------------------------------------- exact dedup
def test_exact_dedup_removes_exactly_the_planted_copies(vocab):
    rng = np.random.default_rng(5)
    unique = [curate.Document("t", f"u{i:03d}", " ".join(random_words(rng, 50, vocab))) for i in range(100)]
    near_miss = curate.Document("t", "miss", unique[0].text + " extra")   # one word more: not a copy
    copies = [curate.Document("t", f"z{i:03d}", "  " + unique[i].text.upper().replace(" ", "\n\t ") + "\n")
              for i in range(0, 100, 7)]
    docs = unique + [near_miss] + copies
    kept, removed = curate.drop_all_but_one(docs, curate.exact_clusters(docs))
    assert sorted(d.path for d in removed) == sorted(d.path for d in copies)
    assert len(kept) == len(unique) + 1
    for trial in range(3):  # any order of arrival: the same documents survive
        shuffled = list(docs)
        random.Random(trial).shuffle(shuffled)
        kept2, _ = curate.drop_all_but_one(shuffled, curate.exact_clusters(shuffled))
        assert sorted(d.path for d in kept2) == sorted(d.path for d in kept)


def test_repeated_paragraphs_removed_after_first_occurrence():
    boiler = "Licensed under the Apache License. " * 8  # a long repeated paragraph
    docs = [curate.Document("t", f"d{i}", f"intro {i}\n\n{boiler}\n\nshort\n\nbody {i} " + "x" * 10)
            for i in range(3)]
    out, n, nbytes = curate.dedup_spans(docs, "paragraph", min_chars=100)
    assert n == 2 and nbytes == 2 * len((boiler + "\n\n").encode())
    assert [d.text.count("Licensed") for d in out] == [8, 0, 0]
    assert all("short" in d.text for d in out)        # short spans are never removed
    again, _, _ = curate.dedup_spans(docs[::-1], "paragraph", min_chars=100)
    assert sorted(d.text for d in again) == sorted(d.text for d in out)


# ---------------------------------------------------------------------------- rules
COMMON = ("the a reader file line text test number machine step function memory copy idea "
          "example small large clear first last each every when what why how keeps reads says "
          "prints checks returns follows comes runs holds fails works").split()


def lines_of(words, per=10):
    return "\n".join(" ".join(words[i:i + per]) for i in range(0, len(words), per)) + "\n"


def sentence_words(seed, n, pool=COMMON):
    rng = random.Random(seed)
    return [rng.choice(pool) for _ in range(n)]


def letters(seed, n, lo, hi):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


WORDS = sentence_words(0, 90)
GOOD = lines_of(WORDS)  # 90 ordinary words on 9 distinct lines of ~50 characters


def verdict(text, **overrides):
    thresholds = {r.name: r.default for r in curate.RULES}
    thresholds.update(overrides)
    return curate.failed_rules(text, thresholds)


def crafted():
    """rule -> (a document it must remove, a near one it must keep), all else passing."""
    lines = GOOD.splitlines()
    long_line = " ".join(sentence_words(1, 200))  # ~1,200 characters on one line
    return {
        "min_words": (lines_of(WORDS[:49]), lines_of(WORDS[:50])),
        "max_words": (GOOD + "extra words\n", GOOD),     # threshold set to GOOD's 90 words
        "min_word_len": (lines_of(letters(2, 80, 2, 3)[:40] + letters(3, 40, 2, 2)), lines_of(letters(2, 80, 3, 3))),
        "max_word_len": (lines_of(letters(4, 60, 11, 12), per=6), lines_of(letters(4, 60, 9, 10), per=6)),
        "max_symbol_ratio": (lines_of([("#" + w) if i % 5 == 0 else w for i, w in enumerate(WORDS)]),
                             lines_of([("#" + w) if i % 11 == 0 else w for i, w in enumerate(WORDS)])),
        "min_alpha_words": (GOOD + lines_of(["1"] * 30), GOOD + lines_of(["1"] * 15)),
        "max_dup_lines": ("\n".join(lines + [lines[0]] * 4), "\n".join(lines + [lines[0]] * 3)),
        "max_mean_line": (" ".join(WORDS[:40]) + "\n" + " ".join(WORDS[40:]), GOOD),
        "max_line": (lines_of(sentence_words(5, 400)) + long_line + "\n", lines_of(sentence_words(5, 400))),
        "min_alnum": (lines_of([w + "!!!!!!" for w in letters(6, 60, 2, 2)]),
                      lines_of([w + "!!!" for w in letters(6, 60, 2, 2)])),
        "max_bad_chars": (GOOD + "caf\ufffd\n", GOOD + "café\n"),
        "max_curly": (GOOD + "{ }\n", GOOD),
    }


def test_good_document_passes_every_rule():
    assert verdict(GOOD) == []


@pytest.mark.parametrize("rule", curate.RULE_NAMES)
def test_each_rule_removes_its_document_and_keeps_the_near_one(rule):
    bad, ok = crafted()[rule]
    extra = {"max_words": len(GOOD.split())} if rule == "max_words" else {}
    assert verdict(bad, **extra) == [rule], curate.doc_features(bad)
    assert verdict(ok, **extra) == [], curate.doc_features(ok)


def test_filter_exempts_domains_and_skips_rules():
    args = argparse.Namespace(**{r.name: r.default for r in curate.RULES}, skip_rules="max_curly", exempt="arith")
    docs = [curate.Document("arith", "a", "37+45=82\n" * 80), curate.Document("lib", "b", GOOD + "{}"),
            curate.Document("lib", "c", "37+45=82\n" * 80)]
    kept, removed = curate.quality_filter(docs, args)
    assert [d.path for d in kept] == ["a", "b"] and [d.path for d in removed["min_alpha_words"]] == ["c"]
    args.skip_rules = "no_such_rule"
    with pytest.raises(UserError, match="unknown rule"):
        curate.quality_filter(docs, args)


# ---------------------------------------------------------------------------- mixture
def test_mixture_hits_token_shares_within_one_document():
    rng = np.random.default_rng(6)
    doc_tokens = {"big": list(rng.integers(50, 400, size=500)), "mid": list(rng.integers(20, 300, size=100)),
                  "tiny": list(rng.integers(10, 60, size=8))}
    weights = curate_mix.parse_weights("big=5,mid=3,tiny=2", doc_tokens)
    mix = curate_mix.sample_mixture(doc_tokens, weights, 60_000, seed=1)
    total = sum(m["tokens"] for m in mix.values())
    longest = max(max(v) for v in doc_tokens.values())
    for name, m in mix.items():
        assert abs(m["tokens"] - weights[name] * total) <= longest
        assert m["tokens"] == sum(doc_tokens[name][i] for i in m["docs"])
        assert m["epochs"] == pytest.approx(m["tokens"] / sum(doc_tokens[name]))
        counts = np.bincount(m["docs"], minlength=len(doc_tokens[name]))
        assert counts.max() - counts.min() <= 1  # epochs: every document once per pass
    assert mix["tiny"]["epochs"] > 10 and mix["big"]["epochs"] < 1  # upsampled vs subsampled
    assert curate_mix.sample_mixture(doc_tokens, weights, 60_000, seed=1) == mix
    assert curate_mix.sample_mixture(doc_tokens, weights, 60_000, seed=2)["big"]["docs"] != mix["big"]["docs"]


def test_temperature_weights():
    tokens = {"a": 900, "b": 100}
    assert curate_mix.temperature_weights(tokens, 1.0) == pytest.approx({"a": 0.9, "b": 0.1})
    assert curate_mix.temperature_weights(tokens, 2.0) == pytest.approx({"a": 0.75, "b": 0.25})  # √900 : √100
    assert curate_mix.temperature_weights(tokens, 1e9)["b"] == pytest.approx(0.5)
    assert curate_mix.largest_unrepeated(tokens, {"a": 0.5, "b": 0.5}) == 200


@pytest.mark.parametrize("spec, message", [("lib=0,tests=0", "positive"), ("lib=-1,tests=1", ">= 0"),
                                           ("nope=1", "unknown domain"), ("lib", "domain=weight"),
                                           ("lib=x", "not a number")])
def test_bad_weights(spec, message):
    with pytest.raises(UserError, match=message):
        curate_mix.parse_weights(spec, {"lib": 1, "tests": 1})


def test_empty_domain_is_an_error():
    with pytest.raises(UserError, match="empty"):
        curate_mix.sample_mixture({"lib": [10], "tests": []}, {"lib": 0.5, "tests": 0.5}, 100, seed=0)


@pytest.mark.parametrize("argv, message", [
    (["mix", "--weights", "lib=0,tests=0"], "positive"),
    (["mix", "--weights", "klingon=1"], "unknown domain"),
    (["dedup", "--shingle", "0"], "shingle"),
    (["dedup", "--bands", "14", "--rows", "7"], "bands × rows"),
    (["sweep", "--subset", "0"], "--subset"),
    (["mix", "--tokens", "-5"], "--tokens"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    """curate.py's modes, and the mixture and the sweep (scripts/curate_mix.py,
    scripts/curate_sweep.py, built on curate.py's flags)."""
    mains = {"mix": curate_mix.main, "sweep": curate_sweep.main}
    main = mains.get(argv[0], curate.main)
    with pytest.raises(SystemExit) as e:
        curate.run_cli(main, argv[1:] if argv[0] in mains else argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error:") and message in err and "\n" not in err


def test_cli_empty_data_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "blank.txt").write_text("  \n")
    r = run_python("curate.py", ["stats", "--data", str(tmp_path / "mine")], timeout=300)
    assert r.returncode == 2 and "domain 'mine'" in r.output and "empty" in r.output
    assert r.output.strip().count("\n") == 0 and r.output.startswith("error:")


# ---------------------------------------------------------------------------- sweep pieces
def test_eval_loss_equals_the_models_loss():
    cfg = get_config("tiny")
    model = GPT(cfg, seed=0).eval()
    rng = np.random.default_rng(7)
    eot = cfg.vocab_size - 1
    docs = [list(rng.integers(0, eot, size=int(n))) for n in rng.integers(20, 200, size=12)]
    byte_len = np.full(cfg.vocab_size, 2)
    nats, bpb = curate_sweep.eval_loss(model, docs, byte_len, eot, max_tokens=10_000)
    stream = curate_sweep.token_stream(docs, eot).astype(np.int64)
    n = (len(stream) - 1) // cfg.block_size
    x = torch.from_numpy(stream[: n * cfg.block_size].reshape(n, -1))
    y = torch.from_numpy(stream[1: n * cfg.block_size + 1].reshape(n, -1))
    y = torch.where(y == eot, -1, y)
    with torch.no_grad():
        ref = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1).item()
    assert nats == pytest.approx(ref, rel=1e-5)
    assert bpb == pytest.approx(ref / math.log(2) / 2, rel=1e-5)
    # an equal share per document: a long one does not crowd out the rest
    long_short = [list(rng.integers(0, eot, size=3000)), list(rng.integers(0, eot, size=400))]
    capped = curate_sweep.eval_loss(model, long_short, byte_len, eot, max_tokens=1000)
    assert capped == curate_sweep.eval_loss(model, [long_short[0][:500], long_short[1][:500]], byte_len, eot, 10_000)


def test_split_keeps_every_copy_of_a_val_document_out_of_train(vocab):
    rng = np.random.default_rng(8)
    docs = []
    for i in range(120):
        docs.append(curate.Document("ab"[i % 2], f"d{i:03d}", " ".join(random_words(rng, 80, vocab))))
    clusters = [[i, i + 1, i + 2] for i in range(0, 60, 3)]
    args = argparse.Namespace(seed=0, subset=1.0, val_fraction=0.2)
    split = curate_sweep.split_by_cluster(docs, clusters, args)
    val, raw = {d.path for d in split["val"]}, {d.path for d in split["raw"]}
    group = {docs[i].path: {docs[j].path for j in c} for c in clusters for i in c}
    assert not val & raw and {d.domain for d in split["val"]} == {"a", "b"}
    for p in val:
        assert not group.get(p, set()) & raw
    assert len(split["raw"]) - len(split["dedup"]) == 2 * len(split["repeated"])
    assert len(split["dedup"]) + len(split["val"]) == 120 - 2 * len(clusters)


@pytest.mark.slow
def test_mix_writes_a_file_train_py_reads(tmp_path):
    """`mix` end to end on a small subset: documents separated by EOT, the manifest's
    tokens are the union tokenizer's count, and data.read_documents accepts the file."""
    out = tmp_path / "cur"
    r = run_python("-m scripts.curate_mix", ["--weights", "lib=0.5,tests=0.3,arith=0.2", "--max-bytes-per-domain",
                                 "40000", "--arith-docs", "20", "--vocab-size", "300", "--tokens", "100000",
                                 "--out-dir", str(out)],
                   timeout=600)
    assert r.returncode == 0, r.output
    manifest = json.loads((out / "mix.json").read_text())
    _, docs = data.read_documents(str(out / "mix.txt"))
    assert len(docs) == manifest["documents"] == sum(m["documents"] for m in manifest["domains"].values())
    assert set(manifest["domains"]) == {"lib", "tests", "arith"}
    total = manifest["tokens"]
    longest = max(m["largest_doc"] for m in manifest["domains"].values())
    for name, w in {"lib": 0.5, "tests": 0.3, "arith": 0.2}.items():
        assert abs(manifest["domains"][name]["tokens"] - w * total) <= longest
    assert manifest["domains"]["arith"]["epochs"] > 1  # 20 small documents at 20%: repeated


@pytest.mark.slow
def test_train_on_reads_the_stream_and_learns_it():
    """The hand loop over a periodic stream: the loss on it falls well below the untrained
    model's (~ln V), and the same seed gives the same weights."""
    cfg = get_config("tiny")
    stream = np.tile(np.arange(40, dtype=np.uint16), 400)
    args = argparse.Namespace(lr=3e-3, batch_size=4, steps=30)
    model = curate_sweep.train_on(stream, cfg, args, seed=0).eval()
    nats, _ = curate_sweep.eval_loss(model, [list(range(40)) * 20], np.ones(cfg.vocab_size), cfg.vocab_size - 1, 700)
    assert nats < math.log(cfg.vocab_size) - 1.5
    again = curate_sweep.train_on(stream, cfg, args, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("mode", ["stats", "dedup", "filter", "mix", "sweep"])
def test_help_shows_every_default_once(mode, capsys):
    with pytest.raises(SystemExit) as e:
        if mode in ("mix", "sweep"):
            {"mix": curate_mix.main, "sweep": curate_sweep.main}[mode](["--help"])
        else:
            curate.parse_args([mode, "--help"])
    out = capsys.readouterr().out
    flags = [line for line in out.splitlines() if line.startswith("  --")]
    stated = out.count("(default:") + out.count("not given")
    assert e.value.code == 0 and stated == len(flags) > 5
