# Tests for rl.py: the losses against hand-computed numbers, the direction of one policy
# gradient step on a tiny model, zero-variance groups, sampling, the bad inputs, and data
# parallelism (2 torchrun ranks == 1 process, every algorithm). No checkpoint, no corpus:
# tiny random models and a 256-byte tokenizer built in the test.
import math
import pickle
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from core import data
import rl
from model import GPT, get_config
from core.errors import UserError
from tests.harness import python_cmd, run_python, run_together, torchrun_cmd

BYTES = data.make_encoding({bytes([i]): i for i in range(256)})


def tiny(seed=0):
    return GPT(get_config("tiny", vocab_size=BYTES.n_vocab), seed=seed)


# ---------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2])
    # group 1: mean 0.25, Bessel std sqrt((0.75² + 3·0.25²)/3) = 0.5; group 2: all equal
    want = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    torch.testing.assert_close(rl.group_advantages(r, 4, scale=False), want)   # Dr. GRPO
    torch.testing.assert_close(rl.group_advantages(r, 4), want / torch.tensor(
        [0.5 + 1e-4] * 4 + [1e-4] * 4))
    assert rl.zero_variance_groups(r, 4) == 1
    assert rl.zero_variance_groups(r, 2) == 3


def test_k3_kl():
    # log π = log 0.5, log π_ref = log 0.25: x = log 0.5, e^x - x - 1 = 0.5 + ln 2 - 1
    v = rl.k3_kl(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)))
    assert v.item() == pytest.approx(math.log(2) - 0.5, abs=1e-6)
    a, b = torch.randn(1000), torch.randn(1000)
    assert (rl.k3_kl(a, b) >= 0).all()
    assert rl.k3_kl(a, a).abs().max() == 0
    # unbiased: the exact expectation under π of k3 is KL(π‖π_ref)
    p, q = torch.softmax(torch.randn(7), 0), torch.softmax(torch.randn(7), 0)
    kl = (p * (p.log() - q.log())).sum()
    torch.testing.assert_close((p * rl.k3_kl(p.log(), q.log())).sum(), kl)


# ---------------------------------------------------------------------------- clipping
def test_clipped_surrogate_both_ends():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.25, 1.25])
    adv = torch.tensor([1.0, -1, -1, 1, 1, 1])
    logp = ratio.log().clone().requires_grad_(True)
    loss, clipped = rl.clipped_surrogate(logp, torch.zeros(6), adv, 0.2, 0.2)
    # -min(ρA, clip(ρ)A): (1.5, +) → -1.2 clipped; (1.5, −) → 1.5; (0.5, −) → 0.8 clipped;
    # (0.5, +) → -0.5; (1.25, +) → -1.2 clipped
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, 1.5, 0.8, -0.5, -1.2, -1.2]))
    assert clipped.tolist() == [True, False, True, False, True, True]
    loss.sum().backward()   # clipped tokens get no gradient; the others -ρA
    torch.testing.assert_close(logp.grad, torch.tensor([0, 1.5, 0, -0.5, 0, 0]))
    # clip-higher (DAPO): ε_high = 0.28 lets ρ = 1.25 through
    loss, clipped = rl.clipped_surrogate(logp.detach(), torch.zeros(6), adv, 0.2, 0.28)
    assert loss[4].item() == pytest.approx(-1.25) and not clipped[4]


# ---------------------------------------------------------------------------- normalisations
def test_each_normalisation_by_hand():
    per_tok = torch.tensor([[1.0, 2, 3, 9], [4, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert rl.aggregate(per_tok, mask, "grpo").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert rl.aggregate(per_tok, mask, "bnpo").item() == pytest.approx(10 / 4)
    assert rl.aggregate(per_tok, mask, "dr_grpo", max_len=8).item() == pytest.approx(10 / 16)
    assert rl.aggregate(per_tok, mask, "dapo").item() == pytest.approx(10 / 4)  # 1 process
    with pytest.raises(UserError):
        rl.aggregate(per_tok, mask, "mean")


def test_normalisations_on_a_two_rank_split_by_hand():
    """TRL's meanings on 2 data-parallel ranks whose token counts differ (4 and 8): each
    rank's loss as aggregate computes it there (its local mask, the global count 12), then
    averaged over ranks as the gradient all-reduce averages. bnpo: the mean of per-rank
    token means; dapo: one token mean over the global batch; they differ here."""
    per_tok = [torch.tensor([[1.0, 2, 3, 0], [4, 0, 0, 0]]),          # rank 0: 3 + 1 tokens
               torch.tensor([[1.0, 1, 1, 1], [2, 2, 2, 2]])]          # rank 1: 4 + 4 tokens
    mask = [torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool),
            torch.ones(2, 4, dtype=torch.bool)]
    global_tokens = 12
    avg = lambda norm: sum(rl.aggregate(t, m, norm, max_len=4, global_tokens=global_tokens,
                                        world=2) for t, m in zip(per_tok, mask)).item() / 2
    s0, s1 = 10.0, 12.0                                  # each rank's masked sum
    assert avg("grpo") == pytest.approx((6 / 3 + 4 / 1 + 4 / 4 + 8 / 4) / 4)
    assert avg("bnpo") == pytest.approx((s0 / 4 + s1 / 8) / 2)                 # 2.0
    assert avg("dapo") == pytest.approx((s0 + s1) / 12)                        # 1.8333
    assert avg("dr_grpo") == pytest.approx((s0 + s1) / (4 * 4))
    assert avg("bnpo") != pytest.approx(avg("dapo"))


@pytest.mark.parametrize("norm", rl.NORMS)
def test_all_masked_batch_gives_zero_not_nan(norm):
    """TRL clamps every divisor to >= 1 token: a batch with no answer token is 0, not NaN."""
    per_tok = torch.ones(2, 3, requires_grad=True)
    loss = rl.aggregate(per_tok, torch.zeros(2, 3, dtype=torch.bool), norm, max_len=3,
                        global_tokens=0, world=2)
    loss.backward()
    assert loss.item() == 0 and torch.isfinite(per_tok.grad).all()


def test_dr_grpo_differs_from_grpo():
    """Two wrong answers of a group, 1 and 4 tokens long, equal advantage. GRPO's 1/|o|:
    each token of the long one gets 1/4 of the short one's gradient (length bias); Dr.
    GRPO: every token the same, and no std division."""
    r = torch.tensor([1.0, 0, 0, 1])
    mask = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    grads = {}
    for algo, norm in (("grpo", "grpo"), ("drgrpo", "dr_grpo")):
        adv = rl.group_advantages(r, 4, scale=algo == "grpo")
        logp = torch.zeros(4, 4, requires_grad=True)
        loss, _ = rl.grpo_loss(logp, torch.zeros(4, 4), None, adv, mask, norm=norm, max_len=4)
        loss.backward()
        grads[algo] = logp.grad
    std = torch.tensor([1.0, 0, 0, 1]).std().item() + 1e-4       # 0.57735 + 1e-4
    # GRPO: -A/(N·|o|);  A = ±0.5/std
    assert grads["grpo"][1, 0].item() == pytest.approx(0.5 / std / 4 / 1, rel=1e-5)
    assert grads["grpo"][2, 0].item() == pytest.approx(0.5 / std / 4 / 4, rel=1e-5)
    # Dr. GRPO: -A/(N·max_len), A = ±0.5
    assert grads["drgrpo"][1, 0].item() == pytest.approx(0.5 / 16)
    assert grads["drgrpo"][2, 0].item() == grads["drgrpo"][2, 3].item() == pytest.approx(0.5 / 16)
    assert grads["drgrpo"][0, 0].item() == pytest.approx(-0.5 / 16)


def test_kl_term_and_reinforce_by_hand():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = rl.grpo_loss(logp, logp, ref, torch.zeros(1), mask, beta=0.1, norm="bnpo")
    k3 = lambda x: math.exp(x) - x - 1
    assert loss.item() == pytest.approx(0.1 * (k3(-0.5) + k3(1.0)) / 2, rel=1e-6)
    # REINFORCE: -(R - b)·Σ_t log π, mean over answers
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    got = rl.reinforce_loss(lp, torch.tensor([1.0, 0.0]), 0.25, m).item()
    assert got == pytest.approx(-(0.75 * -3.0 + -0.25 * -0.5) / 2)


def test_kl_ratio_correction_multiplies_k3_by_the_ratio():
    """TRL's use_bias_correction_kl: per-token k3 × ρ, ρ = π_θ/π_old (with its gradient).
    A = 0 leaves only the KL term; one token per answer and 'bnpo' make it readable."""
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old, ref = torch.tensor([[-1.5], [-1.0]]), torch.tensor([[-1.2], [-2.5]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    args = (torch.zeros(2), mask)
    plain, _ = rl.grpo_loss(logp, old, ref, *args, beta=0.1, norm="bnpo")
    fixed, _ = rl.grpo_loss(logp, old, ref, *args, beta=0.1, norm="bnpo", kl_ratio=True)
    k3 = lambda lp, r: math.exp(r - lp) - (r - lp) - 1
    ratio = [math.exp(-1.0 + 1.5), math.exp(-2.0 + 1.0)]
    assert plain.item() == pytest.approx(0.1 * (k3(-1, -1.2) + k3(-2, -2.5)) / 2, rel=1e-6)
    assert fixed.item() == pytest.approx(0.1 * (k3(-1, -1.2) * ratio[0] +
                                                k3(-2, -2.5) * ratio[1]) / 2, rel=1e-6)
    # ... and the gradient flows through ρ too (TRL does not detach it):
    # d(k3·ρ)/dlogp = ρ·(1 - e^(ref - logp)) + k3·ρ, the last term absent if ρ were detached
    fixed.backward()
    want = [0.1 / 2 * r * (1 - math.exp(rf - lp) + k3(lp, rf))
            for r, lp, rf in zip(ratio, (-1.0, -2.0), (-1.2, -2.5))]
    assert logp.grad[:, 0].tolist() == pytest.approx(want, rel=1e-5)
    logp.grad = None
    same, _ = rl.grpo_loss(logp, old.clone().copy_(logp.detach()), ref, *args, beta=0.1,
                           norm="bnpo", kl_ratio=True)
    assert same.item() == pytest.approx(0.1 * (k3(-1, -1.2) + k3(-2, -2.5)) / 2, rel=1e-6)


# ---------------------------------------------------------------------------- PPO pieces
def test_gae_by_hand():
    rew = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 2.0, 0.0, 0.0]])
    val = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = rl.gae(rew, val, mask, gamma=1.0, lam=1.0)   # λ = 1: return-to-go − V
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.7, 0], [2.1, 1.5, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0], [2.5, 2.0, 0, 0]]))
    adv, _ = rl.gae(rew, val, mask, gamma=0.9, lam=0.0)     # λ = 0: one-step TD error
    torch.testing.assert_close(adv, torch.tensor(
        [[0.9 * 0.2 - 0.1, 0.9 * 0.3 - 0.2, 1 - 0.3, 0], [0.5 + 0.9 * 0.5 - 0.4, 1.5, 0, 0]]))
    adv, _ = rl.gae(rew, val, mask, gamma=1.0, lam=0.5)     # δ = (0.1, 0.1, 0.7), A2 = 0.7
    torch.testing.assert_close(adv[0, :3], torch.tensor([0.1 + 0.5 * (0.1 + 0.35), 0.1 + 0.35, 0.7]))


def test_value_loss_clipped_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.6, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # token 1: V moved 0.5 past V_old → clipped to 0.7: max((0.4)², (0.1)²) = 0.16
    # token 2: max(1, 1) = 1  → mean of ½·(0.16, 1.0)
    got = rl.value_loss(v, old, ret, mask, clip=0.2).item()
    assert got == pytest.approx(0.5 * (0.16 + 1.0) / 2)


# ---------------------------------------------------------------------------- distillation
def test_distill_advantage_is_reverse_kl_gradient():
    """On-policy distillation's per-token advantage -(log π_s - log π_t) on the student's
    samples: its exact expectation over π_s gives the gradient of KL(π_s‖π_t) (reverse)."""
    z = torch.randn(6, requires_grad=True)
    t = torch.log_softmax(torch.randn(6), 0)
    s = torch.log_softmax(z, 0)
    adv = -(s.detach() - t)
    per_tok, _ = rl.clipped_surrogate(s, s.detach(), adv)       # ratio 1: plain PG
    (s.exp().detach() * per_tok).sum().backward()                # E_{x~π_s}[loss(x)]
    z2 = z.detach().clone().requires_grad_(True)
    s2 = torch.log_softmax(z2, 0)
    (s2.exp() * (s2 - t)).sum().backward()                       # ∇ KL(π_s‖π_t)
    torch.testing.assert_close(z.grad, z2.grad)


def test_soft_kd_is_forward_kl_at_temperature():
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    tau = 2.0
    ref = F.kl_div(F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1), log_target=True,
                   reduction="none").sum(-1)          # KL(teacher ‖ student)
    want = tau ** 2 * ref[mask].mean()
    torch.testing.assert_close(rl.soft_kd_loss(s, t, mask, tau), want)
    assert rl.soft_kd_loss(t, t, mask, tau).abs().item() < 1e-6


# ---------------------------------------------------------------------------- on a model
def batch(model, prompts, answers):
    seq, mask = rl.pack(prompts, answers, "cpu")
    return seq, mask, (rl.token_logprobs(model, seq) * mask).sum(1)


def test_policy_gradient_raises_positive_answers():
    """One GRPO step on a tiny model: log-probs of positive-advantage answers go up,
    negative ones down; the same with Dr. GRPO and REINFORCE."""
    prompts = [list(b"3+5=")] * 4
    answers = [list(b"8\n"), list(b"7\n"), list(b"9\n"), list(b"8\n")]
    rewards = torch.tensor([1.0, 0, 0, 1])
    for algo in ("grpo", "drgrpo", "reinforce"):
        model = tiny()
        seq, mask, before = batch(model, prompts, answers)
        old = rl.token_logprobs(model, seq).detach()
        logp = rl.token_logprobs(model, seq)
        if algo == "reinforce":
            loss = rl.reinforce_loss(logp, rewards, 0.5, mask)
        else:
            adv = rl.group_advantages(rewards, 4, scale=algo == "grpo")
            loss, _ = rl.grpo_loss(logp, old, old, adv, mask, beta=0.04,
                                   norm="grpo" if algo == "grpo" else "dr_grpo", max_len=2)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        after = batch(model, prompts, answers)[2]
        d = (after - before).tolist()
        assert d[0] > 0 and d[3] > 0 and d[1] < 0 and d[2] < 0, (algo, d)


def test_zero_variance_groups_give_zero_gradient():
    """All G rewards equal → A = 0; the k3 term has zero gradient where π = π_ref (first
    pass), so the whole loss gives exactly zero gradient, with β > 0 too."""
    model = tiny()
    seq, mask, _ = batch(model, [list(b"1+1=")] * 3, [list(b"2\n"), list(b"5\n"), list(b"11\n")])
    old = rl.token_logprobs(model, seq).detach()
    for rewards in (torch.zeros(3), torch.ones(3)):
        for algo in ("grpo", "drgrpo"):
            model.zero_grad()
            adv = rl.group_advantages(rewards, 3, scale=algo == "grpo")
            loss, _ = rl.grpo_loss(rl.token_logprobs(model, seq), old, old, adv, mask, beta=0.1,
                                   norm="grpo", max_len=4)
            loss.backward()
            assert all(p.grad.abs().max() == 0 for p in model.parameters())


def test_sampling_is_per_prompt_and_logprobs_match():
    """Answers depend on the prompt's seed only (not on the batch it is in: what makes data
    parallel rollouts equal one process's); greedy = model.generate; kept log-probs = a
    fresh forward over the packed answers."""
    model, nl = tiny(), 10
    prompts = [list(b"3+5="), list(b"12+7="), list(b"4-1=")]
    both, lp = rl.sample(model, prompts, 3, 1.0, 6, [11, 22, 33], nl)
    alone, _ = rl.sample(model, prompts[1:2], 3, 1.0, 6, [22], nl)
    assert both[3:6] == alone
    assert both[0:3] != both[6:9]
    for a in both:                      # truncated at the first stop token, kept inclusive
        assert nl not in a[:-1] and (a[-1] == nl or len(a) == 6)
    seq, mask, old = rl.pack([p for p in prompts for _ in range(3)], both, "cpu", lp)
    torch.testing.assert_close(rl.token_logprobs(model, seq)[mask], old[mask], atol=1e-5, rtol=0)
    greedy, _ = rl.sample(model, prompts[:1], 1, 0, 6, [0], nl)
    ref = model.generate(prompts[0], 6, temperature=0, eos_id=nl)
    assert greedy[0] == ref[:len(greedy[0])]


# ---------------------------------------------------------------------------- bad input
def test_rewards_must_be_numbers():
    assert rl.compute_rewards(lambda c, a: 1, ["x"], ["y"]).tolist() == [1.0]
    for bad in ("1.0", None, float("nan"), True, [1]):
        with pytest.raises(UserError, match="finite number"):
            rl.compute_rewards(lambda c, a, bad=bad: bad, ["x"], ["y"])
    fn = rl.make_reward_fn("exact", 0.5)
    assert fn("8\n", "8") == 1.5 and fn("7\n", "8") == 0.5 and fn("7", "8") == 0.0
    with pytest.raises(UserError, match="cannot load"):
        rl.make_reward_fn("no_such_module_xyz:f")


def test_bad_input_errors(tmp_path, monkeypatch):
    """G < 2, a reward function returning a non-number, a teacher with another tokenizer,
    an unknown algorithm: each a UserError with a message a user can act on."""
    common = ["--ckpt", "none", "--preset", "tiny", "--teacher-preset", "tiny", "--steps", "1",
              "--sft-steps", "1", "--teacher-sft-steps", "1", "--eval-problems", "5"]
    (tmp_path / "badreward.py").write_text("def f(completion, answer):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad_tok = tmp_path / "teacher.pt"
    enc = data.make_encoding({**{bytes([i]): i for i in range(256)}, b"ab": 256})
    model = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=0)
    torch.save({"config": asdict(model.config), "model": model.state_dict(),
                "tokenizer": data.encoding_to_state(enc)}, bad_tok)
    cases = [(["--algo", "drgrpo", "--group", "1"], "--group G >= 2"),
             (["--algo", "grpo", "--reward", "badreward:f"], "must return a finite number"),
             (["--algo", "distill", "--teacher", str(bad_tok)], "different tokenizer"),
             (["--algo", "nope"], "unknown algorithm"),
             (["--algo", "grpo", "--norm", "mean"], "unknown loss normalisation")]
    for extra, msg in cases:
        with pytest.raises(UserError, match=msg):
            rl.main(common + extra)
    # a --ckpt that is garbage, or a pickle that would run code: read as plain data only
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"tokenizer": Evil()}, f)
    torch.save({"model": model.state_dict()}, tmp_path / "notok.pt")     # no tokenizer
    for name, why in (("junk.pt", "is not a PyTorch checkpoint"),
                      ("evil.pt", "safe loading"), ("notok.pt", "carries no tokenizer")):
        with pytest.raises(UserError, match=why):
            rl.main(["--ckpt", str(tmp_path / name), "--algo", "grpo"])


def test_one_algorithm_counts_its_steps(capsys):
    """A single-algorithm run shows its progress in steps, the unit that moves (not
    `rl compare: 0% (0/1) | 0 s | eta ?`)."""
    rl.main(["--ckpt", "none", "--preset", "tiny", "--algo", "reinforce", "--steps", "2",
             "--prompts", "2", "--group", "2", "--max-new", "2", "--sft-steps", "2",
             "--eval-problems", "4", "--eval-samples", "1", "--cache-dir", ""])
    out = capsys.readouterr().out
    assert "reinforce: 100% (2/2 steps) | " in out and "compare:" not in out, out


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


@pytest.mark.slow
def test_cli_error_is_one_line():
    r = run_python("rl.py", ["--ckpt", "none", "--algo", "grpo", "--group", "1"], timeout=60)
    assert r.returncode == 2, r.output
    assert r.output.strip().splitlines() == [r.output.strip()] and "G >= 2" in r.output


# ---------------------------------------------------------------------------- data parallel
@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    """Every algorithm, 2 steps: 2 ranks × 2 prompts == 1 process × 4 prompts (same global
    batch, per-prompt sampling seeds, global token counts, averaged gradients)."""
    # 1-digit problems, a short SFT: answers of varying length, some right (non-zero
    # advantages), so per-rank token counts differ and the global normalisers matter
    # ("dapo": the global token count; TRL's "bnpo", the local one, would differ)
    args = ["compare", "--ckpt", "none", "--preset", "tiny", "--teacher-preset", "tiny",
            "--digits", "1", "--ops", "+-", "--max-new", "4", "--steps", "2", "--group", "4",
            "--sft-steps", "150", "--teacher-sft-steps", "300", "--eval-samples", "2",
            "--eval-problems", "20", "--norm", "dapo", "--lr", "1e-3", "--distill-lr", "1e-3"]
    one, two = run_together([   # the reference and its twin side by side (no shared files)
        python_cmd("rl.py", *args, "--prompts", "4", "--save", tmp_path / "one.pt"),
        torchrun_cmd(2, "rl.py", *args, "--prompts", "2", "--save", tmp_path / "two.pt")],
        timeout=240)
    assert one.returncode == 0, one.output
    assert "ledger" in one.output and "rev KL" in one.output and "PPO's critic" in one.output
    assert two.returncode == 0, two.output
    assert "all_reduce" in two.output
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert set(a) == set(rl.ALGOS)
    for x, y in zip(rl.ALGOS, rl.ALGOS[1:]):     # every algorithm moved the weights its own way
        assert any((a[x][k] - a[y][k]).abs().max() > 1e-4 for k in a[x]), (x, y)
    for algo in a:
        for k in a[algo]:
            torch.testing.assert_close(a[algo][k], b[algo][k], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{algo} {k}: {m}")
