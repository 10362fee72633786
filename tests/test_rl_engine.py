# Tests for RL through the serving engine (rl.py --rollout engine, training/rl_sync.py):
# engine rollouts equal the generate path where they must (greedy tokens, loss and
# gradients), the engine's log-probs equal the trainer's recomputed ones in fp32 (the
# mismatch is 0), the truncated importance weight by hand, a ratio of 1 giving the
# on-policy loss, the weight sync leaving sampler and trainer bitwise equal (and sending
# only a LoRA adapter's bytes), the staleness of --max-offpolicy-steps, and bad flags.
# Tiny random models and a 256-byte tokenizer: no checkpoint, no corpus.
import pytest
import torch

import rl
from core import data
from core.errors import UserError
from model import GPT, get_config
from tests.harness import python_cmd, run_together, torchrun_cmd
from training import rl_sync

BYTES = data.make_encoding({bytes([i]): i for i in range(256)})
NL = 10                                     # b"\n": the task's stop token
PROMPTS = [list(b"3+5="), list(b"12+7="), list(b"4-1=")]   # two lengths: the engine packs them
# a tiny run of the whole loop: 1-digit problems, an SFT long enough that some answers are
# right (groups with a reward spread: the policy moves), small evaluations
RUN = ["--ckpt", "none", "--preset", "tiny", "--algo", "grpo", "--digits", "1", "--ops", "+-",
       "--prompts", "2", "--group", "4", "--max-new", "4", "--sft-steps", "150", "--lr", "1e-3",
       "--eval-problems", "4", "--eval-samples", "1", "--cache-dir", "", "--log-interval", "99"]


def tiny(seed=0):
    return GPT(get_config("tiny", vocab_size=BYTES.n_vocab), seed=seed)


def engine_args(*extra):
    return rl.parse_args(["--rollout", "engine", "--prompts", "3", "--group", "2",
                          "--max-new", "6", *extra])


def grpo_loss_and_grads(model, prompts, answers, old, rewards):
    """GRPO's loss on a packed batch and the gradient of every parameter."""
    model.zero_grad()
    seq, mask, old_logp = rl.pack(prompts, answers, "cpu", old)
    adv = rl.group_advantages(rewards, 2)
    loss, _ = rl.grpo_loss(rl.token_logprobs(model, seq), old_logp, old_logp, adv, mask,
                           beta=0.04, max_len=6)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_engine_greedy_rollouts_equal_generate_with_the_same_loss_and_gradients():
    """K = 0 and greedy: the engine's answers are sample()'s token for token, and GRPO's loss
    and gradients on them are the same (the log-probs agree to rounding)."""
    model = tiny()
    engine = rl.build_engine(model, engine_args(), prompt_room=5)
    seeds = [11, 22, 33]
    ref, ref_lp = rl.sample(model, PROMPTS, 2, 0, 6, seeds, NL)
    got, got_lp = rl.engine_sample(engine, PROMPTS, 2, 0, 6, seeds, NL)
    assert got == ref
    for a, b in zip(got_lp, ref_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    rows = [p for p in PROMPTS for _ in range(2)]
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1])
    loss_ref, grads_ref = grpo_loss_and_grads(model, rows, ref, ref_lp, rewards)
    loss_got, grads_got = grpo_loss_and_grads(model, rows, got, got_lp, rewards)
    torch.testing.assert_close(loss_got, loss_ref, atol=1e-6, rtol=0)
    for g, r in zip(grads_got, grads_ref):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    # a group's G requests share its prompt: the first computed it, the second hit the cache
    assert engine.stats["cached_tokens"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainers_in_fp32(temperature):
    """Sampled rollouts: the engine's processed log-probs are log softmax(logits/T) of the
    drawn tokens, equal to the trainer's recomputation, so the mismatch KL is 0 to rounding;
    the same rollouts through an int8 KV cache or int8 weights are measurably apart."""
    model = tiny()
    rows = [p for p in PROMPTS for _ in range(2)]
    mismatch = {}
    for kv, weights in (("fp32", "fp32"), ("int8", "fp32"), ("fp32", "int8")):
        engine = rl.build_engine(model, engine_args("--engine-kv", kv, "--engine-weights",
                                                    weights), prompt_room=5)
        answers, lp = rl.engine_sample(engine, PROMPTS, 2, temperature, 6, [1, 2, 3], NL)
        seq, mask, mu = rl.pack(rows, answers, "cpu", lp)
        with torch.no_grad():
            trainer = rl.token_logprobs(model, seq, temperature)
        if kv == weights == "fp32":
            torch.testing.assert_close(mu[mask], trainer[mask], atol=2e-5, rtol=0)
        kl, n = rl_sync.mismatch_kl(mu, trainer, mask.float())
        mismatch[kv, weights] = kl / n
    assert mismatch["fp32", "fp32"] < 1e-9
    assert mismatch["int8", "fp32"] > 1e3 * max(mismatch["fp32", "fp32"], 1e-12)
    assert mismatch["fp32", "int8"] > 1e3 * max(mismatch["fp32", "fp32"], 1e-12)


def test_tis_weight_by_hand_and_a_ratio_of_one_gives_the_on_policy_loss():
    """w = min(π_old/μ, C) per token, no gradient through it; with μ = π_old (ratio 1) the
    corrected loss and its gradient are GRPO's own."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    mu = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))
    w = rl_sync.truncated_is_weight(old, mu, 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.0]]))   # 2, 0.5, 3 -> capped 2
    assert rl_sync.truncated_is_weight(old, mu, 0) is None          # off
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.5])
    losses = []
    for is_weight in (None, rl_sync.truncated_is_weight(old, old, 2.0)):
        logp = old.clone().requires_grad_(True)
        loss, _ = rl.grpo_loss(logp, old, old, adv, mask, beta=0.1, is_weight=is_weight)
        loss.backward()
        losses.append((loss.detach(), logp.grad))
    torch.testing.assert_close(losses[1], losses[0])
    # and a weight scales each token's policy-gradient term: -A/3 per token at ρ = 1
    logp = old.clone().requires_grad_(True)
    rl.grpo_loss(logp, old, old, adv, mask, is_weight=w)[0].backward()
    torch.testing.assert_close(logp.grad, -1.5 / 3 * w)


def test_tis_weight_uses_the_samplers_logprobs():
    """correct_off_policy: π_old is the trainer's recomputation, μ the sampler's log-probs the
    batch carries; the weight is their capped ratio (ratio 1 everywhere would be the trainer's
    log-probs used twice: no correction at all)."""
    model = tiny()
    rows = [p for p in PROMPTS for _ in range(2)]
    stale = tiny(seed=1)                        # a sampler that is not the trainer
    answers, mu = rl.sample(stale, PROMPTS, 2, 1.0, 6, [1, 2, 3], NL)
    seq, mask, mu_grid = rl.pack(rows, answers, "cpu", mu)
    b = dict(seq=seq, mask=mask, old_logp=mu_grid.clone(), group=None)
    m = rl.new_metrics()
    rl.correct_off_policy(b, model, engine_args("--tis-cap", "2"), m, 1.0)
    with torch.no_grad():
        trainer = rl.token_logprobs(model, seq)
    torch.testing.assert_close(b["old_logp"], trainer)
    want = torch.exp(trainer - mu_grid).clamp(max=2.0)
    torch.testing.assert_close(b["is_weight"][mask], want[mask])
    assert (b["is_weight"][mask] - 1).abs().max() > 0.1
    kl, n = rl_sync.mismatch_kl(mu_grid, trainer, mask.float())
    assert m["mismatch"] == [pytest.approx(kl / n)] and kl > 0


def test_weight_sync_leaves_engine_equal_to_trainer_and_drops_the_cache():
    """After an optimizer step the sync copies every trained weight in place (4 B/param in
    fp32), bitwise; the engine's cached prefix blocks of the old weights are dropped."""
    model = tiny()
    engine = rl.build_engine(model, engine_args(), prompt_room=5)
    rl.engine_sample(engine, PROMPTS, 2, 1.0, 6, [1, 2, 3], NL)
    assert engine.alloc.block_of                       # prefix blocks cached
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)         # the trainer's step
    sampler_params = [p for p in engine.model.parameters()]
    m = rl.new_metrics()
    rl.sync_sampler(model, engine, engine_args(), m)
    assert [p for p in engine.model.parameters()] == sampler_params   # the same tensors
    for (name, a), b in zip(model.named_parameters(), engine.model.parameters()):
        assert torch.equal(a, b), name
    assert m["sync_bytes"] == 4 * model.num_params()
    assert not engine.alloc.block_of and engine.alloc.num_free == engine.alloc.num_blocks
    engine.alloc.check()
    seq = engine.add_request(PROMPTS[0])              # in flight: its K/V would be stale too
    with pytest.raises(UserError, match="in flight"):
        engine.reset_prefix_cache()
    engine.abort(seq.id)


def test_engine_runs_sync_each_step_and_lora_sends_only_the_adapter():
    """The whole loop: on-policy engine rollouts see a mismatch of 0 at every step (the sync
    kept the sampler equal to the trainer); K = 2 trains on batches 0, 1, 2, 2 steps old and
    then sees a mismatch; LoRA rank 1 syncs the adapter's bytes alone."""
    (on,), _ = rl.main(RUN + ["--rollout", "engine", "--steps", "3"])
    assert on["staleness"] == [0, 0, 0] and max(on["mismatch"]) < 1e-9
    assert on["sync_bytes"] == 3 * 4 * on["params"]
    (stale,), _ = rl.main(RUN + ["--rollout", "engine", "--steps", "4",
                                 "--max-offpolicy-steps", "2"])
    assert stale["staleness"] == [0, 1, 2, 2]
    assert stale["mismatch"][0] < 1e-9 and min(stale["mismatch"][1:]) > 1e-6
    (lora,), _ = rl.main(RUN + ["--rollout", "engine", "--steps", "2", "--lora-rank", "1"])
    cfg = get_config("tiny", vocab_size=BYTES.n_vocab)
    h, kv = cfg.n_embd, cfg.n_kv_head * cfg.n_embd // cfg.n_head
    ffn = GPT(cfg).layers[0].feed_forward.w1.out_features
    # rank 1: A (1 × in) and B (out × 1) per linear: wq, wk, wv, wo, w1, w2, w3
    per_layer = (h + h) + (h + kv) * 2 + (h + h) + (h + ffn) * 2 + (ffn + h)
    assert lora["sync_bytes"] == 2 * 4 * cfg.n_layer * per_layer
    assert max(lora["mismatch"]) < 1e-9


def test_a_sampler_rank_and_a_trainer_rank_equal_one_process(tmp_path):
    """torchrun --rollout-rank: rank 1 runs the engine and broadcasts each batch, rank 0
    trains and broadcasts its weights back; with the sampler one step ahead (K = 1) and
    truncated IS, the trained weights are one process's, bit for bit (same prompts, seeds,
    weights at each version: the topology changes who computes, not what)."""
    args = [*RUN, "--rollout", "engine", "--steps", "3", "--max-offpolicy-steps", "1",
            "--tis-cap", "2"]
    one, two = run_together([
        python_cmd("rl.py", *args, "--save", tmp_path / "one.pt"),
        torchrun_cmd(2, "rl.py", *args, "--rollout-rank", "--save", tmp_path / "two.pt")],
        timeout=240)
    assert one.returncode == 0, one.output
    assert two.returncode == 0, two.output
    assert "sampler rank 1:" in two.output and "broadcast" in two.output
    a, b = torch.load(tmp_path / "one.pt")["grpo"], torch.load(tmp_path / "two.pt")["grpo"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("argv, message", [
    (["--max-offpolicy-steps", "2"], "needs --rollout engine"),
    (["--engine-kv", "int8"], "needs --rollout engine"),
    (["--rollout", "engine", "--tis-cap", "0.5"], "--tis-cap must be"),
    (["--rollout", "engine", "--max-offpolicy-steps", "-1"], "must be >= 0"),
    (["--rollout", "engine", "--algo", "ppo"], "train grpo or drgrpo"),
    (["--rollout-rank"], "needs --rollout engine"),
    (["--rollout", "engine", "--lora-rank", "1", "--engine-weights", "int8"], "one or the other"),
    (["--rollout", "engine", "--rollout-rank", "--steps", "1"], "at least 2 ranks"),
])
def test_bad_rollout_flags_are_one_line(argv, message):
    with pytest.raises(UserError, match=message):
        rl.main(["--ckpt", "none", *argv])
