import pytest
import torch

from core.checkpoint import load_model
from model import GPT, KVCache, get_config, math_attention, sample_next, sdpa_attention
from core.errors import UserError


def tiny(**kw):
    return get_config("tiny", **kw)


@pytest.mark.parametrize("kw", [dict(attn="sdpa"), dict(attn="math"), dict(n_kv_head=4),
                                dict(n_kv_head=1), dict(n_expert=4, expert_top_k=2),
                                dict(n_extra_heads=2),
                                dict(n_expert=4, n_shared_expert=1, moe_score="sigmoid",
                                     moe_balance="loss_free")])
def test_kv_cache_decode_equals_full_forward(kw):
    """Prefill a chunk, append a chunk, then decode one token at a time: every logit equals
    the one from a single full forward pass over the whole sequence."""
    cfg = tiny(**kw)
    model = GPT(cfg, seed=3).eval()
    idx = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(cfg, 3, 40)
        parts = [model(idx[:, :11], cache=cache)[0], model(idx[:, 11:17], cache=cache)[0]]
        parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(17, 40)]
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=2e-5)


def test_cache_rollback_by_length():
    cfg = tiny()
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(cfg, 1)
        model(idx[:, :15], cache=cache)
        cache.length = 10                          # pretend tokens 10..14 were rejected
        again, _ = model(idx[:, 10:20], cache=cache)
    torch.testing.assert_close(again, full[:, 10:], rtol=0, atol=2e-5)


def test_sdpa_equals_math_attention_forward_and_grads():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    for mask in (None, (torch.rand(9, 9, generator=g) > 0.3) | torch.eye(9, dtype=torch.bool)):
        a = math_attention(q, k, v, mask)
        b = sdpa_attention(q, k, v, mask)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        ga = torch.autograd.grad(a.sum(), (q, k, v))
        gb = torch.autograd.grad(b.sum(), (q, k, v))
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_attention_function_is_replaceable():
    cfg = tiny()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    ref, _ = model(idx)
    calls = []

    def spy(q, k, v, mask):
        calls.append(q.shape)
        return math_attention(q, k, v, mask)

    for layer in model.layers:
        layer.attention.attn_fn = spy
    out, _ = model(idx)
    assert len(calls) == cfg.n_layer
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def assert_sparse_equals_dense(moe, x):
    """moe.forward (each expert on its tokens) == moe.forward_dense (every expert on every
    token, gated): outputs, the balance loss, and the gradients of x and every parameter.
    -> the sparse output."""
    a = moe(x)
    aux_a = moe.aux_loss
    ga = torch.autograd.grad(a.pow(2).sum() + aux_a, [x, *moe.parameters()])
    b = moe.forward_dense(x)
    gb = torch.autograd.grad(b.pow(2).sum() + moe.aux_loss, [x, *moe.parameters()])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux_a, moe.aux_loss)
    for u, w in zip(ga, gb):
        torch.testing.assert_close(u, w, rtol=1e-4, atol=1e-6)
    return a


def test_moe_sparse_equals_dense_reference_with_grads():
    cfg = tiny(n_expert=4, expert_top_k=2)
    moe = GPT(cfg, seed=1).layers[0].feed_forward
    x = torch.randn(2, 10, cfg.n_embd, requires_grad=True)
    assert_sparse_equals_dense(moe, x)


def test_moe_aux_loss_is_one_when_balanced_and_larger_when_not():
    cfg = tiny(n_expert=4, expert_top_k=1)
    moe = GPT(cfg).layers[0].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[torch.arange(4), torch.arange(4)] = 10.0
    x = torch.zeros(4, 1, cfg.n_embd)
    x[torch.arange(4), 0, torch.arange(4)] = 1.0          # token i -> expert i: balanced
    moe.route(x.view(4, -1))
    _, _, aux = moe.route(x.view(4, -1))
    assert abs(aux.item() - 1.0) < 0.02
    _, _, aux = moe.route(x[[0, 0, 0, 0]].view(4, -1))      # everything to expert 0
    assert aux.item() > 3.5


def test_moe_aux_loss_counts_token_expert_pairs_under_top_2():
    """f_i is the fraction of the N·k token-expert assignments (DeepSeekMoE's f_i divides by
    K·T; Hugging Face's Mixtral loss sums the k slots instead, and is k when balanced): a
    balanced top-2 routing gives aux = 1, not k, whatever k."""
    cfg = tiny(n_expert=4, expert_top_k=2)
    moe = GPT(cfg).layers[0].feed_forward
    with torch.no_grad():                  # token i -> experts i (first) and i + 1 (second)
        moe.router.weight.zero_()
        moe.router.weight[torch.arange(4), torch.arange(4)] = 10.0
        moe.router.weight[(torch.arange(4) + 1) % 4, torch.arange(4)] = 5.0
    x = torch.zeros(4, cfg.n_embd)
    x[torch.arange(4), torch.arange(4)] = 1.0
    _, ids, aux = moe.route(x)
    assert sorted(ids.flatten().tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]     # every expert twice
    assert abs(aux.item() - 1.0) < 1e-5                  # cyclic symmetry: P_i = 1/4 exactly


V3_MOE = dict(n_expert=8, expert_top_k=3, ffn_hidden=16, n_shared_expert=2,
              moe_score="sigmoid", moe_balance="loss_free", moe_routed_scale=2.5)


def test_shared_expert_moe_sparse_equals_dense_reference_with_grads():
    """DeepSeek-V3's MoE (sigmoid affinities, a routing bias, scaled weights, 2 shared
    experts): the sparse forward equals the dense reference, values and gradients."""
    cfg = tiny(**V3_MOE)
    moe = GPT(cfg, seed=1).layers[0].feed_forward
    with torch.no_grad():     # a bias that changes the choice of some tokens
        moe.router.expert_bias.copy_(torch.linspace(-0.01, 0.01, 8))
    x = torch.randn(4, 16, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    a = assert_sparse_equals_dense(moe, x)
    # the shared experts are in the output: without them it is the routed part only
    shared = moe.shared_experts(x.reshape(-1, cfg.n_embd)).view_as(a)
    assert shared.abs().max() > 1e-3
    moe.shared_experts = None
    torch.testing.assert_close(moe(x), a - shared, rtol=1e-5, atol=1e-6)
    assert moe.load.sum() == 4 * 16 * 3        # every token reaches top_k experts


def test_sigmoid_gate_chooses_on_bias_and_weighs_without_it():
    """V3 eq. 13-16 by hand: top-k on s + b, weights = the chosen s (no b) normalised over
    the top-k, × the routed scale."""
    cfg = tiny(n_expert=4, expert_top_k=2, moe_score="sigmoid", moe_balance="loss_free",
               moe_routed_scale=2.5)
    router = GPT(cfg).layers[0].feed_forward.router
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0])    # logits = these
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    x = torch.zeros(1, cfg.n_embd)
    x[0, 0] = 1.0
    shares, weights, ids = router.gate(x, 2)
    s = torch.tensor([2.0, 1.0, 0.0, -1.0]).sigmoid()
    assert ids.tolist() == [[2, 0]]            # the bias pulls expert 2 in, 1 out
    torch.testing.assert_close(weights, 2.5 * s[[2, 0]][None] / (s[2] + s[0]))
    torch.testing.assert_close(shares, (s / s.sum())[None])


def test_loss_free_bias_follows_its_rule_and_has_no_gradient():
    cfg = tiny(n_expert=4, expert_top_k=2, moe_balance="loss_free", moe_bias_rate=0.01)
    model = GPT(cfg)
    loads = torch.tensor([[5.0, 1.0, 3.0, 3.0],       # mean 3: -γ, +γ, 0, 0
                          [0.0, 8.0, 2.0, 2.0]])      # mean 3: +γ, -γ, +γ, +γ
    biases = [layer.feed_forward.router.expert_bias for layer in model.layers]
    model.update_expert_bias(loads)
    assert torch.equal(biases[0], torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.equal(biases[1], torch.tensor([0.01, -0.01, 0.01, 0.01]))
    model.update_expert_bias(loads)
    assert torch.equal(biases[0], torch.tensor([-0.02, 0.02, 0.0, 0.0]))
    # a buffer: saved with the checkpoint, never stepped by an optimizer
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.feed_forward.router.expert_bias" in model.state_dict()
    assert not any("expert_bias" in n for n in names)
    # no gradient path: b only decides the top-k indices, which carry none
    bias = biases[0].requires_grad_(True)
    _, loss = model(torch.randint(0, cfg.vocab_size, (2, 8)), torch.randint(0, 8, (2, 8)))
    assert torch.autograd.grad(loss, bias, allow_unused=True)[0] is None
    assert model.expert_loads().shape == (cfg.n_layer, 4)
    assert model.expert_loads().sum() == cfg.n_layer * 2 * 8 * 2


def test_v3_preset_active_and_total_parameters():
    cfg = get_config("v3")
    model = GPT(cfg, seed=None)
    routed = cfg.n_layer * cfg.n_expert * 3 * cfg.n_embd * cfg.ffn_dim
    idle = routed * (cfg.n_expert - cfg.expert_top_k) // cfg.n_expert
    assert model.num_params() - model.num_params(active=True) == idle
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_experts" in n)
    assert shared == cfg.n_layer * cfg.n_shared_expert * 3 * cfg.n_embd * cfg.ffn_dim
    assert model.flops_per_token(256) == 6 * model.num_params(True, active=True) + \
        12 * cfg.n_layer * cfg.n_embd * 256
    with pytest.raises(UserError, match="moe_score"):
        get_config("v3", moe_score="relu")
    with pytest.raises(UserError, match="n_shared_expert needs"):
        get_config("tiny", n_shared_expert=1)


@pytest.mark.parametrize("bad", [dict(kv_lora_rank=-16),      # was silently GQA
                                 dict(kv_lora_rank=16, qk_rope_head_dim=-4),
                                 dict(q_lora_rank=-8),
                                 dict(n_expert=4, n_shared_expert=-1),
                                 dict(ffn_hidden=-64)])
def test_negative_sizes_are_refused_by_name(bad):
    name, value = list(bad.items())[-1]          # the negative setting comes last
    with pytest.raises(UserError, match=f"{name} must be >= 0, got {value}"):
        get_config("tiny", **bad)


def test_same_seed_same_weights():
    a, b, c = GPT(tiny(), seed=5), GPT(tiny(), seed=5), GPT(tiny(), seed=6)
    torch.manual_seed(123)                   # the global RNG does not matter
    d = GPT(tiny(), seed=5)
    for pa, pb, pc, pd in zip(a.parameters(), b.parameters(), c.parameters(), d.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pd)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_generate_greedy_equals_full_forward_argmax():
    cfg = tiny()
    model = GPT(cfg, seed=2).eval()
    prompt = [5, 17, 42]
    out = model.generate(prompt, 12, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert out == seq[3:]
    assert model.generate(prompt, 12, temperature=1.0, top_k=1, seed=0) == out
    assert model.generate(prompt, 12, temperature=1.0, top_p=1e-6, seed=0) == out
    s1 = model.generate(prompt, 12, temperature=1.0, seed=7)
    assert s1 == model.generate(prompt, 12, temperature=1.0, seed=7)
    batch = model.generate(torch.tensor([prompt, prompt]), 12, temperature=0)
    assert batch.shape == (2, 12) and batch[1].tolist() == out


def test_sample_next_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen_k = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert seen_k == {0, 1}
    seen_p = {int(sample_next(logits, 1.0, top_p=0.7, generator=g)) for _ in range(200)}
    assert seen_p == {0, 1}                     # 0.5 < 0.7, 0.5 + 0.3 crosses it
    seen = {int(sample_next(logits, 1.0, generator=g)) for _ in range(500)}
    assert seen == {0, 1, 2, 3}


def test_extra_heads_and_moe_add_to_the_loss():
    cfg = tiny(n_extra_heads=2, n_expert=2, expert_top_k=1)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    parts = model.last_losses
    assert set(parts) == {"ce", "moe_aux", "head1", "head2"}
    expected = parts["ce"] + cfg.moe_aux_coef * parts["moe_aux"] + \
        cfg.extra_heads_coef * (parts["head1"] + parts["head2"]) / 2
    torch.testing.assert_close(loss.detach(), expected)


def test_flops_and_params():
    model = GPT(get_config("small"))
    cfg = model.config
    assert model.num_params() == model.num_params(non_embedding=True) + cfg.vocab_size * cfg.n_embd
    assert model.flops_per_token(256) == 6 * model.num_params(True) + 12 * cfg.n_layer * cfg.n_embd * 256


def test_clear_errors():
    with pytest.raises(UserError, match="unknown preset"):
        get_config("huge")
    with pytest.raises(UserError, match="not divisible by n_kv_head"):
        get_config("tiny", n_head=4, n_kv_head=3)
    with pytest.raises(UserError, match="not divisible by n_head"):
        get_config("tiny", n_embd=30, n_head=4)
    model = GPT(tiny())
    with pytest.raises(UserError, match="longer than the model's context"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(UserError, match="exceeds the context"):
        model.generate([1, 2], 100)
    with pytest.raises(UserError, match="not found"):
        load_model("/nonexistent/ckpt.pt")
