# Tests for evaluate.py: every metric against numbers computed by hand (ties included),
# temperature scaling on synthetic logits with a known temperature, bits per byte and the
# continuation log-likelihood against plain forwards, the shared evaluation API against
# lora.py / rl.py / train.py's own functions, the n-gram detector on a planted corpus, the
# SVG plots (core/plots.py), the bad inputs, and the contamination experiment end to end.
# The references' conventions, each written out here on a case where the rules differ:
# ECE's bins closed on the right (Guo et al.'s code) or the left (torchmetrics), Min-K%
# Prob's int(n·k%) tokens (Shi et al.'s code), n-gram overlap over distinct n-grams.
# No checkpoint and no corpus: tiny random models and a 256-byte tokenizer built here.
import math
import types
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core import data
from scripts import calibration
from scripts import contamination
import evaluate as ev
from core import scores
from scripts import uncertainty
from model import GPT, get_config
from core.plots import svg_bar_chart, svg_line_plot, terminal_bars, terminal_plot
from core.errors import UserError
from core.runtime import run_cli

BYTES = data.make_encoding({bytes([i]): i for i in range(256)})


def tiny(seed=0, vocab=BYTES.n_vocab):
    return GPT(get_config("tiny", vocab_size=vocab), seed=seed).eval()


# ---------------------------------------------------------------------------- metrics
def test_ece_brier_nll_by_hand():
    conf = [0.1, 0.4, 0.6, 0.9, 0.95]
    right = [0, 1, 1, 1, 0]
    # 2 bins: (0, .5] holds .1, .4: conf .25, acc .5 -> 2/5·.25 = .1;
    #         (.5, 1] holds .6, .9, .95: conf .8167, acc .6667 -> 3/5·.15 = .09
    e, bins = ev.ece(conf, right, 2)
    assert e == pytest.approx(0.19)
    assert [b[2] for b in bins] == [2, 3]
    assert ev.ece(conf, right, 1)[0] == pytest.approx(abs(np.mean(conf) - 0.6))
    assert ev.ece([0.5, 0.5000001], [1, 1], 2)[1][0][2] == 1     # bins are (lo, hi]
    assert ev.ece([0.0], [0], 3)[1][0][2] == 1                   # 0 lands in the first bin
    assert ev.brier(conf, right) == pytest.approx((0.01 + 0.36 + 0.16 + 0.01 + 0.9025) / 5)
    logits = torch.tensor([[0.0, math.log(3)], [0.0, 0.0]])
    labels = torch.tensor([1, 0])
    assert ev.nll(logits, labels) == pytest.approx((-math.log(0.75) + math.log(2)) / 2)
    p = math.sqrt(3) / (1 + math.sqrt(3))                         # softmax([0, ln3]/2)[1]
    assert ev.nll(logits, labels, 2.0) == pytest.approx((-math.log(p) + math.log(2)) / 2)
    with pytest.raises(UserError):
        ev.ece(conf, right, 0)


def test_ece_bins_on_the_edges_both_conventions():
    # 4 bins, edges 0, .25, .5, .75, 1; four of the six confidences sit exactly on an edge.
    conf = [0.25, 0.5, 0.5, 1.0, 1.0, 0.8]
    right = [1, 0, 1, 1, 0, 1]
    # closed="right", (lo, hi] (Guo et al.'s code): .25 -> bin 0, .5 .5 -> bin 1, and
    # .8 1 1 -> bin 3. Bin 0: acc 1, conf .25 -> 1/6 · .75 = .125; bin 1: acc .5 = conf .5
    # -> 0; bin 3: acc 2/3, conf 2.8/3 -> 3/6 · (2.8 - 2)/3 = 2/15. ECE = 1/8 + 2/15 = 31/120.
    e, bins = ev.ece(conf, right, 4)
    assert e == pytest.approx(31 / 120, abs=1e-15)
    assert [b[2] for b in bins] == [1, 2, 0, 3]
    assert ev.ece(conf, right, 4, "right")[0] == e                  # the default is "right"
    # closed="left", [lo, hi) and 1.0 apart (torchmetrics' bucketize(right=True) - 1):
    # .25 -> bin 1, .5 .5 -> bin 2, .8 -> bin 3, 1 1 -> bin 4 [1, 1]. Bin 1: 1/6 · .75 =
    # .125; bin 2: 0; bin 3: acc 1, conf .8 -> 1/6 · .2 = 1/30; bin 4: acc .5, conf 1 ->
    # 2/6 · .5 = 1/6. ECE = 1/8 + 1/30 + 1/6 = 39/120: the two rules part by 0.067 here.
    e, bins = ev.ece(conf, right, 4, "left")
    assert e == pytest.approx(39 / 120, abs=1e-15)
    assert [b[2] for b in bins] == [0, 1, 2, 1, 2]
    assert bins[-1][:2] == (1.0, 1.0)
    # 0 is in the first bin both ways; off the edges the two agree exactly
    assert ev.ece([0.0], [0], 3, "left")[1][0][2] == ev.ece([0.0], [0], 3)[1][0][2] == 1
    off = [0.1, 0.3, 0.6, 0.9, 0.95]
    assert ev.ece(off, [0, 1, 1, 1, 0], 4, "left")[0] == ev.ece(off, [0, 1, 1, 1, 0], 4)[0]
    # float32 confidences are binned on float32 edges, as the references' torch.linspace
    # builds them: float32(0.7) < 0.7 in float64, yet it is the edge 7/10 (bin [.7, .8)
    # when closed on the left, (.6, .7] on the right)
    edge = np.float32(0.7)
    assert float(edge) < 0.7
    assert ev.ece(np.array([edge]), [1], 10, "left")[1][7][2] == 1
    assert ev.ece(np.array([edge]), [1], 10, "right")[1][6][2] == 1
    with pytest.raises(UserError):
        ev.ece(conf, right, 4, "middle")


def min_k_as_shi_et_al(all_prob, ratio):
    """Shi et al.'s Min-K% Prob, line for line (swj0419/detect-pretrain-code, src/run.py):
    they store the negative mean under "Min_{ratio*100}% Prob"; ours is the mean itself."""
    k_length = int(len(all_prob) * ratio)
    topk_prob = np.sort(all_prob)[:k_length]
    return -np.mean(topk_prob).item()


def test_min_k_prob_counts_tokens_by_the_floor_of_shi_et_al():
    gen = torch.Generator().manual_seed(0)
    # (n, k%): floor int(n·k%) vs ceil max(1, ceil(n·k%)) -- every case differs. 100 x 29%:
    # the float product 28.999999999999996 (0.29 is not exact) floors to 28 in their code.
    cases = {(9, 20): (1, 2), (10, 25): (2, 3), (7, 50): (3, 4), (100, 29): (28, 29),
             (6, 20): (1, 2)}
    for (n, k), (floor, ceil) in cases.items():
        lp = -torch.rand(n, generator=gen) * 5
        assert (ev.min_k_count(n, k), ev.min_k_count(n, k, "ceil")) == (floor, ceil)
        want = -min_k_as_shi_et_al([float(x) for x in lp], k / 100)
        # float64 on both sides: their log-probs are Python floats; only the order of the
        # summation may differ (numpy's pairwise, torch's), hence 1e-12 and not ==
        assert ev.min_k_prob(lp, k) == pytest.approx(want, rel=1e-12, abs=1e-12)
        lowest = sorted(float(x) for x in lp)
        assert ev.min_k_prob(lp, k, "ceil") == pytest.approx(np.mean(lowest[:ceil]), rel=1e-12)
        assert ev.min_k_prob(lp, k, "ceil") != pytest.approx(want, rel=1e-6)
    # the 5-9 scored tokens of an arithmetic item at k = 20: the floor takes the single lowest
    lp = torch.tensor([-0.1, -3.0, -0.2, -0.5, -1.0, -2.0, -0.3])
    assert ev.min_k_prob(lp, 20) == -3.0 and ev.min_k_prob(lp, 20, "ceil") == -2.5
    # zero tokens (n·k% < 1): their np.mean of nothing is NaN; here it is refused, ceil takes 1
    with pytest.raises(UserError, match="0 tokens"):
        ev.min_k_prob(torch.tensor([-1.0, -2.0, -3.0, -4.0]), 20)
    assert ev.min_k_prob(torch.tensor([-1.0, -2.0, -3.0, -4.0]), 20, "ceil") == -4.0
    with pytest.raises(UserError):
        ev.min_k_prob(torch.tensor([]), 20, "ceil")
    with pytest.raises(UserError):
        ev.min_k_count(5, 20, "round")


def test_auroc_is_mann_whitney_with_ties():
    assert ev.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # positives {.5, .9}, negatives {.5, .5}: two ties (½ each) + two wins = 3 of 4 pairs
    assert ev.auroc([0.5, 0.5, 0.5, 0.9], [1, 0, 0, 1]) == pytest.approx(0.75)
    assert ev.auroc([1, 1, 1], [1, 0, 1]) == pytest.approx(0.5)   # all tied: chance
    assert math.isnan(ev.auroc([1, 2], [1, 1]))
    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 5, 200), rng.integers(0, 2, 200).astype(bool)  # many ties
    pairs = [(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]]
    assert ev.auroc(s, y) == pytest.approx(np.mean(pairs))


@pytest.mark.slow
def test_temperature_scaling_recovers_a_known_temperature():
    # A calibrated model: 100 logit vectors z, each with 200 labels drawn from softmax(z) by
    # stratified sampling (the inverse CDF at (j + ½)/200), so the label frequencies equal
    # the probabilities up to 1/200 and the sampling noise does not blur the 2nd decimal.
    gen = torch.Generator().manual_seed(0)
    z = 2.0 * torch.randn(100, 10, generator=gen)
    u = ((torch.arange(200) + 0.5) / 200).expand(100, 200).contiguous()
    labels = torch.searchsorted(z.softmax(-1).cumsum(-1), u).clamp(max=9).flatten()
    z = z.repeat_interleave(200, 0)
    assert ev.fit_temperature(z, labels) == pytest.approx(1.0, abs=0.005)
    for true_t in (0.5, 2.5):
        t = ev.fit_temperature(z * true_t, labels)                # miscaled by true_t
        assert round(t, 2) == true_t
        assert ev.nll(z * true_t, labels, t) <= ev.nll(z * true_t, labels, true_t) + 1e-12
        assert ev.nll(z * true_t, labels, t) < ev.nll(z * true_t, labels, 1.0)


def test_small_helpers_by_hand():
    cov = ev.accuracy_coverage([0.9, 0.8, 0.3, 0.1], [1, 0, 1, 0], levels=4)
    expected = [(0.25, 1.0), (0.5, 0.5), (0.75, 2 / 3), (1.0, 0.5)]
    assert len(cov) == len(expected)
    for got, want in zip(cov, expected):       # pytest.approx compares flat sequences only
        assert tuple(got) == pytest.approx(want)
    assert ev.min_k_prob(torch.tensor([-1.0, -5, -2, -0.5, -3]), 40) == pytest.approx(-4.0)
    assert ev.entropy([2, 2]) == pytest.approx(math.log(2))
    lo, hi = ev.bootstrap_ci(lambda i: np.ones(10)[i].mean(), 10, 50)
    assert lo == hi == 1.0
    x = np.random.default_rng(1).normal(size=400)
    lo, hi = ev.bootstrap_ci(lambda i: x[i].mean(), 400, 300)
    assert lo < x.mean() < hi and hi - lo < 4 * 1.96 / math.sqrt(400)
    # semantic entropy clusters by the number: "82", "082" agree; naive entropy does not
    enc = lambda s: [list(t.encode()) for t in s]
    agree, naive, semantic = uncertainty.consistency_scores(
        BYTES, enc(["82\n"]), [enc(["82\n", "082\n", "83\n"])])
    assert agree[0] == pytest.approx(2 / 3)
    assert naive[0] == pytest.approx(math.log(3))
    assert semantic[0] == pytest.approx(ev.entropy([2, 1]))


# ---------------------------------------------------------------------------- likelihoods
def test_bits_per_byte_of_a_known_text():
    text = "def héllo(wörld):\n    return wörld * 2  # 🙂\n" * 3
    enc = data.make_encoding(data.train_bpe([text], 300))        # tokens != bytes
    model = tiny(vocab=enc.n_vocab)
    ids = [enc.encode_single_token(data.EOT)] + enc.encode_ordinary(text)
    assert len(ids) - 1 < len(text.encode()) and len(ids) <= model.config.block_size
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    loss = F.cross_entropy(model(x)[0][0], y[0]).item()
    want = loss * (len(ids) - 1) / (len(text.encode("utf-8")) * math.log(2))
    assert ev.text_bits_per_byte(model, enc, text) == pytest.approx(want, rel=1e-5)
    assert ev.token_byte_lengths(enc)[ids[1:]].sum() == len(text.encode("utf-8"))
    sums, targets = ev.window_nll(model, ids, 16, batch_size=3)   # windows cover every token
    assert sum(len(t) for t in targets) == len(ids) - 1
    assert len(sums) == math.ceil((len(ids) - 1) / 16)
    first = F.cross_entropy(model(torch.tensor([ids[:16]]))[0][0], torch.tensor(ids[1:17]),
                            reduction="sum").item()
    assert sums[0] == pytest.approx(first, rel=1e-5)


def test_continuation_logprobs_equal_a_plain_forward():
    model = tiny(3)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 256, (n,), generator=gen).tolist()
    c1, c2, c3 = rand(5), rand(5), rand(9)
    pairs = [(c1, rand(1)), (c1, rand(4)), (c2, rand(3)), (c3, rand(2)), (c1, rand(6)),
             (c3, rand(1))]
    for reuse in (True, False):
        lps, logits = scores.continuation_logprobs(model, pairs, reuse_cache=reuse,
                                                   keep_logits=True, chunk=4)
        for (ctx, cont), lp, lg in zip(pairs, lps, logits):
            full = model(torch.tensor([ctx + cont]))[0][0]          # plain forward, alone
            want = F.log_softmax(full, -1)[len(ctx) - 1:-1].gather(
                1, torch.tensor(cont)[:, None])[:, 0]
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lg, full[len(ctx) - 1:-1], atol=1e-5, rtol=1e-5)
            assert lp.sum().item() == pytest.approx(want.sum().item(), abs=1e-4)
    with pytest.raises(UserError):
        scores.continuation_logprobs(model, [(c1, [])])


def rigged(seed=0):
    """A random tiny model whose "\\n" logit is boosted, so greedy answers end early and
    some of them can be made right: exact match strictly between 0 and 1."""
    model = tiny(seed)
    with torch.no_grad():
        model.output.weight[10] += 0.2 * torch.randn(model.config.n_embd,
                                                     generator=torch.Generator().manual_seed(seed))
    problems = data.make_problems(40, 0, 2, "+", "test")
    outs = scores.greedy_answers(model, BYTES, problems, 8)
    fixed = [data.Problem(p.prompt, data.extract_answer(BYTES.decode(o)))
             if 10 in o and i % 2 else p
             for i, (p, o) in enumerate(zip(problems, outs))]
    return model, fixed


def lora_exact_match_as_it_was(model, enc, problems, pairs):
    """lora.py's exact match and answer loss before it used evaluate.py (the reference)."""
    import lora
    model.eval()
    loss = lora.answer_loss(model, *lora.collate(pairs)).item()
    newline = enc.encode_ordinary(data.TERMINATOR)[0]
    max_new = max(len(a) for _, a in pairs) + 1
    by_len, correct = {}, 0
    for prob, (p, _) in zip(problems, pairs):
        by_len.setdefault(len(p), []).append((prob, p))
    for group in by_len.values():
        out = model.generate(torch.tensor([p for _, p in group]), max_new, temperature=0,
                             eos_id=newline)
        correct += sum(data.score(enc.decode(row.tolist()), prob.answer)
                       for (prob, _), row in zip(group, out))
    model.train()
    return correct / len(problems), loss


@torch.no_grad()
def train_validation_loss_as_it_was(model, tokens, args):
    """train.py's validation loss before it used evaluate.py: the model's own loss."""
    model.eval()
    losses = [model(*data.get_batch(tokens, args.batch_size, args.seq_len, args.seed + 1, i))[1]
              .item() for i in range(args.eval_iters)]
    model.train()
    return sum(losses) / len(losses)


def test_api_reproduces_lora_rl_and_train():
    """The shared definitions equal what lora.py, rl.py and train.py computed with their own
    loops (copied above / rl's sampler), and the scripts now return the shared numbers."""
    import lora, rl, train
    model, problems = rigged()
    em = scores.exact_match(model, BYTES, problems)
    assert 0 < em < 1
    pairs = [(BYTES.encode_ordinary(p.prompt), BYTES.encode_ordinary(p.answer + data.TERMINATOR))
             for p in problems]
    old_em, old_loss = lora_exact_match_as_it_was(model, BYTES, problems, pairs)
    assert em == old_em
    assert scores.answer_loss(model, BYTES, problems) == pytest.approx(old_loss, abs=1e-5)
    assert lora.evaluate(model, BYTES, problems) == (em, scores.answer_loss(model, BYTES, problems))
    nl = BYTES.encode_ordinary(data.TERMINATOR)[0]
    prompts = [BYTES.encode_ordinary(p.prompt) for p in problems]
    old_greedy, _ = rl.sample(model, prompts, 1, 0, 8, list(range(len(problems))), nl)
    assert scores.greedy_answers(model, BYTES, problems, 8) == old_greedy
    got = rl.evaluate(model, BYTES, problems, k=2, max_new=8)
    assert scores.exact_match(model, BYTES, problems, 8) == got["greedy"]
    assert got["greedy_out"] == old_greedy
    tokens = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)
    args = types.SimpleNamespace(eval_iters=3, batch_size=2, seq_len=16, seed=4, precision="fp32")
    want = train_validation_loss_as_it_was(model, tokens, args)
    got = scores.validation_loss(model, tokens, 2, 16, 3, 5, "cpu")
    assert got == pytest.approx(want, abs=1e-6)
    got = train.evaluate(model, types.SimpleNamespace(val=tokens), args, "cpu")
    assert got == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------------------- contamination
def test_ngram_detector_finds_exactly_the_planted_items():
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 50, rng.integers(6, 20)).tolist() for _ in range(30)]
    planted = np.zeros(30, dtype=bool)
    planted[[1, 4, 5, 11, 20, 29]] = True
    docs = [rng.integers(50, 100, 40).tolist() for _ in range(200)]       # other tokens
    dirty = docs + [docs[i][:7] + items[j] + docs[i][7:]
                    for i, j in enumerate(np.flatnonzero(planted))]
    for n in (13, 8, 5):
        score = contamination.ngram_overlap(dirty, items, n)
        flagged = score > 0
        assert (flagged == planted).all()            # precision 1 and recall 1
        assert (score[planted] == 1).all()
        # clean corpus: nothing
        assert not (contamination.ngram_overlap(docs, items, n) > 0).any()
    assert ev.auroc(contamination.ngram_overlap(dirty, items, 13), planted) == 1.0


def test_ngram_overlap_counts_distinct_ngrams_and_names_the_whole_item_rule():
    # The usual overlap, written out: the share of the item's distinct n-grams that occur
    # in some training sequence. [1,2,1,2,3] has the 2-grams 12 21 12 23: distinct {12, 21,
    # 23}, of which only 12 is in the training data -> 1/3 (per occurrence it would be 2/4).
    item, train = [1, 2, 1, 2, 3], [[9, 1, 2, 9], [7, 7]]
    grams = {tuple(item[i:i + 2]) for i in range(len(item) - 1)}
    seen = {tuple(s[i:i + 2]) for s in train for i in range(len(s) - 1)}
    want = len(grams & seen) / len(grams)
    assert want == pytest.approx(1 / 3)
    assert contamination.ngram_overlap(train, [item], 2)[0] == want
    # The whole-item rule: an item shorter than n is one n-gram, itself -- found only when
    # it occurs whole and contiguous in one training sequence, never when split across two
    items = [[5, 6, 7], [5, 6, 8], [6, 7, 2]]
    train = [[1, 5, 6, 7, 2], [5, 6], [8]]
    assert contamination.ngram_overlap(train, items, 13).tolist() == [1.0, 0.0, 1.0]
    # n from the items: the 5th-percentile length (floored), at most 13, at least 1
    assert contamination.ngram_size([6] * 3 + [7] * 2 + [8] * 78 + [9] * 135 + [10] * 222) == 8
    assert contamination.ngram_size([40] * 10) == 13 and contamination.ngram_size([1, 1]) == 1


# evaluate.py's modes, and the experiments built on it (scripts/: their own entry points)
EXPERIMENTS = {"calibration": calibration.main, "uncertainty": uncertainty.main,
               "contamination": contamination.main}


def run(argv, capsys):
    main = EXPERIMENTS.get(argv[0])
    with pytest.raises(SystemExit) as info:
        run_cli(main or ev.main, argv[1:] if main else argv)
    err = capsys.readouterr().err.strip()
    return info.value.code, err


def test_ppl_reads_the_demo_model_and_the_task_modes_do_not(capsys, tmp_path, monkeypatch):
    # The task figures depend on how the tokenizer spells numbers, so the task modes keep
    # the tiny LM's tokenizer when a demo model sits in out/ckpt.pt; ppl measures the demo.
    # Two random tiny models stand in, told apart by their tokenizers' sizes.
    monkeypatch.chdir(tmp_path)
    args = types.SimpleNamespace(checkpoint=None, out=str(tmp_path / "ev"), data=None, seed=0,
                                 base_steps=400)
    for path, n_bytes in ((ev.DEFAULT_CKPT, 256), (tmp_path / "ev" / "base-tiny.pt", 128)):
        enc = data.make_encoding({bytes([i]): i for i in range(n_bytes)})
        model = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=0)
        meta = dict(data=None, steps=400, seed=0)         # the tiny LM's cache key
        ev._save(str(path), model, enc, meta)
    _, enc, desc = ev.load_base(args, "cpu")
    assert enc.n_vocab == 257 and desc == ev.DEFAULT_CKPT
    _, enc, desc = ev.task_base(args, "cpu")
    assert enc.n_vocab == 129 and "tiny LM trained here" in desc
    assert f"not reading {ev.DEFAULT_CKPT}" in capsys.readouterr().out
    # asked for by name, the demo is the task modes' base, and they say what that changes
    args.checkpoint = ev.DEFAULT_CKPT
    _, enc, desc = ev.task_base(args, "cpu")
    assert enc.n_vocab == 257 and "257-token tokenizer" in capsys.readouterr().out


def test_bad_input_is_one_clear_error(capsys, tmp_path):
    small = ["--checkpoint", "none", "--out", str(tmp_path), "--plots", str(tmp_path)]
    cases = [(["ppl", "--checkpoint", str(tmp_path / "missing.pt")], "not found"),
             (["calibration", "--bins", "0", *small], "--bins"),
             (["uncertainty", "--samples", "1", *small], "--samples"),
             (["contamination", "--planted", "5000", "--eval-problems", "40", *small], "--planted"),
             (["task", "--choices", "1", *small], "--choices"),
             # the floor selects int(5 x 0.05) = 0 of the shortest item's tokens: refused
             (["contamination", "--min-k", "5", *small], "--min-k"),
             (["contamination", "--ngram", "-1", *small], "--ngram"),
             (["ppl", *small], "--text")]
    for argv, words in cases:
        code, err = run(argv, capsys)
        assert code == 2 and err.startswith("error: ") and words in err and "\n" not in err, \
            (argv, err)


def test_calibration_states_its_binning_and_prints_the_other(capsys, tmp_path):
    argv = ["--checkpoint", "none", "--task-preset", "tiny", "--sft-steps", "2", "--n-train",
            "50", "--eval-problems", "40", "--out", str(tmp_path), "--plots", str(tmp_path)]
    got = {}
    for rule in ("right", "left"):
        got[rule] = calibration.main(argv + ["--ece-bins", rule])
        out = capsys.readouterr().out
        shown = "(lo, hi], 0 in the first" if rule == "right" else "[lo, hi), 1.0 in a bin"
        assert f"bins {shown}" in out and f"--ece-bins {rule}" in out
    for key, row in got["right"].items():
        if key != "T":       # the same records binned both ways: each run's "other" column
            assert row["ece_other"] == got["left"][key]["ece"]
            assert row["ece"] == got["left"][key]["ece_other"]


@pytest.mark.slow
def test_contamination_experiment_prints_planted_vs_clean(capsys, tmp_path):
    argv = ["--checkpoint", "none", "--task-preset", "tiny", "--sft-steps", "20",
            "--eval-problems", "60", "--planted", "10", "--repeats", "3", "--ft-clean", "40",
            "--bootstrap", "20", "--out", str(tmp_path), "--plots", str(tmp_path)]
    result = contamination.main(argv)
    out = capsys.readouterr().out
    assert "planted acc" in out and "contaminated" in out and "control (clean)" in out
    assert 0 <= result["contaminated"]["planted"] <= 1
    assert result["ngram contaminated data"]["precision"] == 1.0
    assert result["ngram contaminated data"]["recall"] == 1.0
    assert result["ngram clean data"]["flagged"] == 0
    # n chosen from the items (6-10 bytes here): 8, and the few shorter ones named as judged
    # by the whole-item rule; Min-K% by the floor (int(n·20%) = 1 of 5-9 tokens) and ceil
    assert result["ngram n"] == 8 and 0 <= result["ngram whole-item"] < 60
    assert "whole-item rule" in out and "Min-20% floor" in out and "ceil" in out
    assert 0 <= result["contaminated"]["auroc_mink_other"] <= 1
    ET.parse(tmp_path / "contamination_mink.svg")


# ---------------------------------------------------------------------------- plots
def test_svg_plots_are_well_formed_with_one_element_per_point_or_bar(tmp_path):
    series = {"a": [(0, 1.0), (0.5, 2.0), (1, 1.5)],
              "b & <c>": [(0, 0), (1, 1), (2, 3), (3, float("nan"))]}
    path = svg_line_plot("lines", series, title="t<1>", xlabel="x", ylabel="y",
                         directory=str(tmp_path))
    root = ET.parse(path).getroot()
    points = [e for e in root.iter() if e.get("class") == "point"]
    assert path.endswith("lines.svg") and len(points) == 6      # the NaN point is skipped
    bars = {"before": [0.1, 0.5, 0.0, 0.9], "after": [0.2, 0.4, 0.3, float("nan")]}
    path = svg_bar_chart("bars", ["0.0", "0.25", "0.5", "0.75"], bars, ymax=1.0, diagonal=True,
                         directory=str(tmp_path))
    root = ET.parse(path).getroot()
    assert len([e for e in root.iter() if e.get("class") == "bar"]) == 8
    text = terminal_plot(series)
    assert "a = a" in text and len(text.splitlines()) > 14
    assert len(terminal_bars(["0.0", "0.25", "0.5", "0.75"], bars).splitlines()) == 8
