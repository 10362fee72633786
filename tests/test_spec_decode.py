# Tests for spec_decode.py: every method reproduces plain greedy decoding token for token;
# at T > 0 the output distribution is the target's (a chi-square test that three broken
# variants fail); KV caches after rejections equal a plain decode of the accepted tokens;
# tree attention equals decoding each root-to-node path; bad inputs give one-line errors;
# the bench's costs table and the break-even α it prints.
# Tiny models built in-test, fp64 (no near-ties between batched and one-token passes).
import copy
import itertools
import types

import numpy as np
import pytest
import torch

import spec_decode as sd
from harness import python_cmd, run_python, run_together
from core.checkpoint import load_model
from model import GPT, KVCache, get_config
from core.errors import UserError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14], [3]]   # ragged, batch 3


def tiny(seed=1, **kw):
    """vocab 64: greedy text of a random model soon cycles, so drafters can learn it."""
    return GPT(get_config("tiny", init_std=0.3, vocab_size=64, **kw), seed=seed).double().eval()


def perturbed(model, noise, seed=5):
    """A drafter that agrees with the target often but not always."""
    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    return m


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny(seed=1)


@pytest.fixture(scope="module")
def drafters(target):
    """Every kind of drafter; the feature drafters briefly trained (self-distillation) so
    that they accept some drafts and every accept/reject path runs."""
    corpus = types.SimpleNamespace(train=np.random.default_rng(0).integers(0, 64, 4000))
    pool = sd.distill_pool(target, corpus, n_seq=48, seq=32, prompt_len=8, chunk=48)
    trained = sd.train_drafters({"medusa": sd.MedusaHeads(target, 4).double(),
                                 "mtp": sd.FeatureDrafter(target, "mtp").double(),
                                 "eagle": sd.FeatureDrafter(target, "eagle").double(),
                                 "dflash": sd.DFlashDrafter(target, 6).double()},
                                target, pool, steps=40, batch=16, lr=3e-3)
    return {"draft": sd.ModelDrafter(perturbed(target, 0.01)), **trained}


def plain_greedy(model, prompts, n):
    return [model.generate(p, n, temperature=0) for p in prompts]


@pytest.mark.parametrize("method,width", [("draft", 1), ("draft", 3), ("medusa", 1),
                                          ("medusa", 3), ("mtp", 1), ("mtp", 2),
                                          ("eagle", 1), ("eagle", 3), ("dflash", 1),
                                          ("dflash", 3)])
def test_greedy_equals_plain(target, drafters, method, width):
    want = plain_greedy(target, PROMPTS, 24)
    st = sd.Stats()
    got, _ = sd.speculative_generate(target, drafters[method], PROMPTS, 24, gamma=4,
                                     width=width, temperature=0.0, stats=st)
    assert got == want
    assert 0 < st.accepted and st.row_rounds < 24 * len(PROMPTS)   # fewer target calls
    assert st.tries >= st.accepted                 # ... and the bookkeeping is consistent


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_one_row_takes_plain_decodings_path_and_equals_plain(target, drafters, method):
    """B = 1: the rows always agree, so every chain pass goes through GPT.forward's own
    positions and causal mask (causal_pass), not the ragged ones: still plain greedy."""
    for prompt in PROMPTS:
        got, cache = sd.speculative_generate(target, drafters[method], [prompt], 24, gamma=4)
        assert got == plain_greedy(target, [prompt], 24) and cache.length > 0


def test_drafter_that_is_the_target_accepts_everything(target):
    st = sd.Stats()
    got, _ = sd.speculative_generate(target, sd.ModelDrafter(target), PROMPTS[:2], 20,
                                     gamma=4, stats=st)
    assert got == plain_greedy(target, PROMPTS[:2], 20)
    assert st.alpha == 1.0 and st.tau == 5.0       # γ accepted + the bonus, every step


def test_drafting_cost_vs_gamma(target, drafters):
    """EAGLE runs one drafter pass per draft token, DFlash one pass per step."""
    for gamma in (2, 5):
        calls = {}
        for m in ("eagle", "dflash"):
            st = sd.Stats()
            sd.speculative_generate(target, drafters[m], PROMPTS[:1], 12, gamma=gamma, stats=st)
            calls[m] = st.drafter_calls / st.rounds
        assert calls == {"eagle": gamma, "dflash": 1}


@pytest.mark.parametrize("temperature,width", [(0.0, 1), (1.0, 1), (0.0, 3), (1.0, 3)])
def test_kv_caches_equal_plain_decode_after_rejections(target, temperature, width):
    """Target and draft caches (RaggedCache rows) equal a plain KVCache over the committed
    tokens: rejected drafts (and tree branches) leave nothing behind."""
    draft = perturbed(target, 0.02)
    drafter, st = sd.ModelDrafter(draft), sd.Stats()
    out, cache = sd.speculative_generate(target, drafter, PROMPTS, 20, gamma=3, width=width,
                                         temperature=temperature, seed=3, stats=st)
    assert st.tries > st.accepted > 0              # there were rejections
    for b, p in enumerate(PROMPTS):
        seq = p + out[b]
        for model, c in ((target, cache), (draft, drafter.cache)):
            n = int(c.lens[b])                     # the last step may commit past the
            assert n >= len(seq) - (1 if model is target else 3)   # goal: compare the
            n = min(n, len(seq))                   # tokens we know
            ref = KVCache(model.config, 1, 64, dtype=torch.float64)
            model(torch.tensor([seq[:n]]), cache=ref)
            torch.testing.assert_close(c.k[:, b, :, :n], ref.k[:, 0, :, :n])
            torch.testing.assert_close(c.v[:, b, :, :n], ref.v[:, 0, :, :n])


def test_feature_drafter_caches_hold_true_features_only(target, drafters):
    """EAGLE drafts from its own predicted features; after verification its cache must
    hold only entries built from the target's true features (and DFlash: its context)."""
    for m in ("eagle", "dflash"):
        d = drafters[m]
        out, cache = sd.speculative_generate(target, d, PROMPTS, 20, gamma=3, temperature=1.0,
                                             seed=1)
        for b, p in enumerate(PROMPTS):
            seq = torch.tensor([p + out[b]])
            h = target(seq, return_hidden=True)[2]
            n = min(int(d.cache.lens[b]), seq.shape[1] - 1)
            assert n >= seq.shape[1] - 5           # lags by at most γ + 2
            ref = KVCache(d.cfg, 1, 64, dtype=torch.float64)
            pos = torch.arange(n)
            with torch.no_grad():
                if m == "eagle":                   # entry k = (f_k-1, t_k), f_-1 = 0
                    f = torch.cat([torch.zeros(1, 1, h.shape[-1], dtype=h.dtype), h], 1)
                    d.body(d.inputs(f[:, :n], seq[:, :n]), pos, None, ref)
                else:                              # context entry j = fc(f_j)
                    d.body(d.fc(h[:, :n]), pos, None, ref)
            torch.testing.assert_close(d.cache.k[:, b, :, :n], ref.k[:, 0, :, :n])


def test_tree_attention_equals_decoding_each_path(target):
    """One tree pass (mask: ancestors only; positions: depth) gives at every node the
    logits of a plain forward over prompt + its root-to-node path."""
    prompt = [5, 6, 7, 8]
    drafter = sd.ModelDrafter(perturbed(target, 0.05))
    drafter.reset(target, [prompt], None, 64)
    tree = sd.grow_tree(drafter, torch.tensor([prompt[-1]]), 3, 3, 0.0, None)
    cache = sd.RaggedCache(target.config, 1, 64, dtype=torch.float64)
    sd.feed(target, cache, [prompt[:-1]])
    base = cache.lens.clone()
    logits, _ = target(tree.tokens, positions=base[:, None] + torch.tensor(tree.depth),
                       mask=sd.attend_mask(base, tree.vis), cache=cache)
    assert tree.tokens.shape[1] == 1 + 3 * 3
    for i in range(tree.tokens.shape[1]):
        path, n = [], i
        while n >= 0:
            path.insert(0, int(tree.tokens[0, n]))
            n = int(tree.parents[0, n])
        ref = target(torch.tensor([prompt[:-1] + path]))[0][0, -1]
        torch.testing.assert_close(logits[0, i], ref)


# ----------------------------------------------------------------------------------------
# T > 0: the output distribution is exactly the target's

V, K, N_SAMPLES = 5, 3, 2000


def exact_joint(target, prompt):
    """p(x1) p(x2|x1) p(x3|x1,x2) over all V^K outcomes, from the target directly."""
    with torch.no_grad():
        seqs = [list(s) for s in itertools.product(range(V), repeat=K - 1)]
        logp = target(torch.tensor([prompt + s for s in seqs]))[0].log_softmax(-1)
    joint = np.zeros([V] * K)
    start = len(prompt) - 1
    for s, lp in zip(seqs, logp):
        pre = sum(lp[start + i, s[i]] for i in range(K - 1))
        joint[tuple(s)] = (pre + lp[start + K - 1]).exp().numpy()
    return joint


def chi_square(joint, samples):
    """Pearson's statistic, cells with expected count < 5 pooled into one; -> (statistic,
    critical value at p = 1e-4 by the Wilson-Hilferty approximation)."""
    counts = np.zeros_like(joint)
    for s in samples:
        counts[tuple(s[:K])] += 1
    e, o = joint.flatten() * len(samples), counts.flatten()
    small = e < 5
    e = np.append(e[~small], e[small].sum())
    o = np.append(o[~small], o[small].sum())
    stat, df = ((o - e) ** 2 / e).sum(), len(e) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3


def bad_residual_unnormalised(p, q, x):
    r = p.copy()
    if q is None:
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    return r                                       # forgot "/ r.sum()"


def bad_residual_p(p, q, x):
    return p                                       # resample from p: forgot to subtract q


def bad_bonus(verify):
    def wrapped(P, tokens, parents, q, rand):
        path, x, tries = verify(P, tokens, parents, q, rand)
        if len(path) == len(tokens) - 1:           # chain fully accepted: the bonus token
            x = sd.draw(P[len(tokens) - 2], rand())    # drawn one position too early
        return path, x, tries
    return wrapped


@pytest.mark.slow
def test_sampling_matches_target_distribution(monkeypatch):
    cfg = dict(vocab_size=V, init_std=0.5)
    target = GPT(get_config("tiny", **cfg), seed=1).double().eval()
    draft = GPT(get_config("tiny", n_layer=1, **cfg), seed=7).double().eval()
    prompt = [1, 2, 3]
    joint = exact_joint(target, prompt)

    def sample(width=1, seed=0):
        st = sd.Stats()
        out, _ = sd.speculative_generate(target, sd.ModelDrafter(draft), [prompt] * N_SAMPLES,
                                         K, gamma=2, width=width, temperature=1.0, seed=seed,
                                         stats=st)
        assert 0.2 < st.alpha < 0.9                # both branches of the rule are exercised
        return chi_square(joint, out)

    for width in (1, 2):                           # sampled chain; deterministic tree
        stat, crit = sample(width)
        assert stat < crit, (width, stat, crit)
    with monkeypatch.context() as m:
        m.setattr(sd, "residual", bad_residual_unnormalised)
        stat, crit = sample()
        assert stat > crit, ("unnormalised residual", stat, crit)
    with monkeypatch.context() as m:
        m.setattr(sd, "residual", bad_residual_p)
        stat, crit = sample()
        assert stat > crit, ("residual = p", stat, crit)
    with monkeypatch.context() as m:
        m.setattr(sd, "verify", bad_bonus(sd.verify))
        stat, crit = sample()
        assert stat > crit, ("bonus from the wrong position", stat, crit)


# ----------------------------------------------------------------------------------------
# Bad input: one clear error

def test_bad_inputs(target, drafters):
    d = drafters["draft"]
    with pytest.raises(UserError, match="gamma must be at least 1"):
        sd.speculative_generate(target, d, PROMPTS, 4, gamma=0)
    with pytest.raises(UserError, match="exceeds the context"):
        sd.speculative_generate(target, d, [list(range(60))], 8, gamma=4)
    with pytest.raises(UserError, match="at least one token"):
        sd.speculative_generate(target, d, [[]], 4)
    with pytest.raises(UserError, match="Medusa heads"):
        sd.speculative_generate(target, drafters["medusa"], PROMPTS, 4, gamma=5)
    other = GPT(get_config("tiny", vocab_size=300), seed=0)
    with pytest.raises(UserError, match="vocabulary"):
        sd.check_vocab(target, None, other, {})


def test_cli_errors_are_one_line(tmp_path):
    gamma, missing = run_together([python_cmd("spec_decode.py", "--gamma", "0"),
                                   python_cmd("spec_decode.py", "--ckpt", tmp_path / "none.pt")],
                                  timeout=60)
    assert gamma.returncode == 2 and gamma.output.strip() == \
        "error: --gamma must be at least 1, got 0"
    assert missing.returncode == 2 and "not found" in missing.output
    assert "Traceback" not in missing.output


def test_bench_speedups_are_ratios_to_the_plain_row_printed(target, drafters, capsys):
    """One plain baseline per table: each printed speedup = its printed tok/s over the
    plain row's (to the rounding of the printed numbers)."""
    args = types.SimpleNamespace(repeats=2, max_new_tokens=10, seed=0)
    entries = [(m, drafters[m], 3, 1) for m in ("draft", "medusa", "eagle")]
    groups = [[[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]], [[3, 1, 4, 1, 5]]]     # equal lengths
    rows = sd.compared(target, entries, groups, args, 0.0)
    assert [r["method"] for r in rows] == ["plain", "draft", "medusa", "eagle"]
    sd.print_ledger(rows, "title")
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    printed = [line.split("|")[-1].split() for line in lines]       # tok/s, speedup, =greedy
    plain_tps = float(printed[0][0])
    assert printed[0][1] == "1.00x"
    for tps, speedup, same in printed[1:]:
        assert abs(float(speedup[:-1]) - float(tps) / plain_tps) <= 0.006 + 0.5 / plain_tps
        assert same == "yes"                                          # T = 0: plain greedy


def test_break_even_alpha_is_where_the_speedup_formula_gives_one():
    """Hand-computed: γ = 3, drafting 0.125 and verify 1.5 plain target steps cost 1.875
    steps a round, and 1 + α + α² + α³ = 1.875 at α = 1/2 (Leviathan et al.'s speedup
    (1 − α^(γ+1)) / ((1 − α)·cost) = 1 there); γ = 1: 1 + α = 0.3 + 1.2."""
    assert sd.break_even_alpha(3, 0.125, 1.5) == pytest.approx(0.5, abs=1e-9)
    assert sd.break_even_alpha(1, 0.3, 1.2) == pytest.approx(0.5, abs=1e-9)
    a = sd.break_even_alpha(4, 0.2, 1.3)                # cost 2.1: some α in between
    assert (1 - a ** 5) / ((1 - a) * 2.1) == pytest.approx(1.0, abs=1e-9)
    assert sd.break_even_alpha(4, 0.0, 0.9) == 0.0     # cheaper than a step: any α gains
    assert sd.break_even_alpha(2, 1.0, 1.5) is None     # 3.5 > γ + 1 = 3: no α can


def test_bench_prints_drafting_and_verify_overheads(target, drafters, capsys):
    """The costs table beside the plain decode: drafting per draft token over the draft
    model's own plain ms per token, one verify pass over one plain target step, each ×
    the ratio of the two printed figures, and the break-even α of those costs."""
    args = types.SimpleNamespace(repeats=1, max_new_tokens=10, seed=0)
    draft = drafters["draft"]
    rows = sd.compared(target, [("draft", draft, 3, 1), ("medusa", drafters["medusa"], 3, 1)],
                       [[[1, 2, 3, 4, 5]]], args, 0.0, draft=draft.model)
    assert rows[0]["draft_step_s"] > 0                  # the draft model's plain decode, timed
    sd.print_costs(rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "drafting" in lines[0] and "verify" in lines[0] and "break-even" in lines[0]
    cells = {line.split()[0]: line.split("|") for line in lines[2:]}
    plain_ms, draft_ms = map(float, cells["draft"][1].split())
    per_tok, over = cells["draft"][2].split()
    verify, v_over = cells["draft"][3].split()
    for ratio, num, den in ((over, per_tok, draft_ms), (v_over, verify, plain_ms)):
        r = float(ratio[:-1])          # printed to 0.01, from figures printed to 0.01 ms
        assert abs(r - float(num) / den) <= 0.0051 + 0.0051 * (1 + r) / den
    step = rows[0]["secs"] / rows[0]["calls"]          # of the unrounded measurements
    want = sd.break_even_alpha(3, rows[1]["dms"] / 1e3 / 3 / step, rows[1]["vms"] / 1e3 / step)
    even = cells["draft"][4].split()[0]
    assert even == "none" if want is None else abs(float(even) - want) <= 0.0051
    assert cells["medusa"][2].split()[1] == "-"         # no draft model: no × for drafting


# DeepSeek-V3's ingredients at tiny size: MLA, routed + shared experts with sigmoid affinities
# and a routing bias, one MTP head
V3_TINY = dict(n_expert=4, expert_top_k=2, n_shared_expert=1, moe_score="sigmoid",
               moe_balance="loss_free", n_extra_heads=1, kv_lora_rank=32,
               qk_rope_head_dim=4, q_lora_rank=16)


@pytest.mark.slow
def test_mtp_drafting_on_a_v3_target_equals_plain_greedy():
    # the drafter's initialisation draws from the global RNG: seeded here, so what it
    # accepts does not depend on which tests ran before (on this random target, 2 of 36)
    torch.manual_seed(0)
    target = tiny(seed=2, **V3_TINY)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():          # a trained-looking bias: it changes some tokens' experts
        for layer in target.layers:
            bias = layer.feed_forward.router.expert_bias
            bias.copy_(torch.rand(bias.shape, generator=gen, dtype=bias.dtype) * 0.1)
    corpus = types.SimpleNamespace(train=np.random.default_rng(0).integers(0, 64, 1000))
    pool = sd.distill_pool(target, corpus, n_seq=8, seq=24, prompt_len=8, chunk=8)
    mtp = sd.train_drafters({"mtp": sd.FeatureDrafter(target, "mtp").double()}, target, pool,
                            steps=10, batch=8, lr=3e-3)["mtp"]
    st = sd.Stats()
    got, _ = sd.speculative_generate(target, mtp, PROMPTS, 12, gamma=3, temperature=0.0,
                                     stats=st)
    assert got == plain_greedy(target, PROMPTS, 12)
    assert st.accepted > 0


@pytest.mark.slow
def test_v3_checkpoint_trains_and_serves(text_file, tmp_path):
    """train.py --preset v3 writes a checkpoint (the loss-free bias in it) that serve.py's
    benchmark runs through the paged engine."""
    ckpt = str(tmp_path / "v3.pt")
    r = run_python("train.py", ["--preset", "v3", "--n-layer", "2", "--n-embd", "48",
                                "--n-head", "4", "--vocab-size", "512", "--data", text_file,
                                "--steps", "3", "--batch-size", "4", "--seq-len", "32",
                                "--eval-iters", "1", "--ckpt", ckpt, "--sample-tokens", "0"],
                   timeout=300)
    assert r.returncode == 0 and "experts (loss_free, sigmoid" in r.output, r.output[-2000:]
    model, _ = load_model(ckpt)
    assert model.config.mla and model.config.n_shared_expert == 1
    assert all(layer.feed_forward.router.expert_bias.abs().sum() > 0 for layer in model.layers)
    r = run_python("-m scripts.serve_bench", ["--checkpoint", ckpt, "--num-requests", "4",
                                "--prompt-len", "8:16", "--output-len", "4:8",
                                "--no-baselines"], timeout=300)
    assert r.returncode == 0 and "continuous batching + paged KV" in r.output, r.output[-2000:]
