# Tests for lora.py: every adapter starts exactly at the base model, merging equals the
# unmerged adapter, only adapter parameters get gradients, LoRA+ learning rates, NF4
# (codebook, nearest level, error bound, packing, bits/param), DoRA == LoRA when m = ‖W0+ΔW‖,
# VeRA's shared pair stored once (and peft's init), DoRA's dropout as peft's, data
# parallelism == one process, the user errors; adapter files (save -> reload in a fresh
# process, refusals), merge_and_unload -> a plain GPT that load_model and the serving
# engine read.
import argparse
import copy
import inspect
import math
import pickle
from dataclasses import asdict

import pytest
import torch

from core import adapter_file, data
import lora
from scripts import lora_estimate
from compression import nf4
from harness import run_python, torchrun
from core.checkpoint import load_model
from model import GPT, get_config
from core.errors import UserError
from serve import Engine, SamplingParams

# The NF4 levels as bitsandbytes defines them (QLoRA, Dettmers et al. 2023, Appendix E),
# typed here, not copied from lora.py.
NF4_REFERENCE = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
ADAPTERS = ["lora", "loraplus", "qlora", "vera", "dora"]


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def tiny(seed=0, **overrides):
    return GPT(get_config("tiny", **overrides), seed=seed)


def tokens(seed=1, B=3, T=12, vocab=512):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def adapted(method, seed=0, **kw):
    model = tiny(seed)
    lora.apply_adapters(model, method, **{"rank": 4, "seed": 7, **kw})
    return model


def dequantized_base(model):
    """The base with every weight an NF4 layer would hold replaced by deq(NF4(W))."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, m in lora.target_linears(ref, lora.ALL_LINEARS):
            m.weight.copy_(nf4.NF4Weight(m.weight).dequantize())
    return ref


def randomize_adapters(model, seed=3):
    """Give the adapters non-trivial values, as training would (B, b start at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("method", ADAPTERS)
def test_zero_update_equals_base(method):
    """B = 0 (LoRA, QLoRA, DoRA) / b = 0 (VeRA): the adapted model IS the base model, even
    in train mode with adapter dropout (dropout touches only the adapter's input)."""
    base = tiny()
    model = adapted(method, dropout=0.5)
    ref = dequantized_base(base) if method == "qlora" else base
    x = tokens()
    model.train()
    torch.testing.assert_close(model(x)[0], ref(x)[0], rtol=0, atol=1e-6)


def test_adapter_dropout_masks_only_the_adapter_input():
    """train: y = W0 x + s·B A (mask ⊙ x)/(1-p), the mask drawn as nn.Dropout draws it;
    eval: no dropout at all."""
    gen = torch.Generator().manual_seed(0)
    layer = lora.LoRALinear(torch.nn.Linear(32, 16, bias=False), rank=4, alpha=8,
                            dropout=0.5, gen=gen)
    with torch.no_grad():
        layer.lora_B.normal_(generator=gen)
    x = torch.randn(5, 32, generator=gen)
    torch.manual_seed(123)
    y = layer(x)
    torch.manual_seed(123)
    mask = torch.nn.functional.dropout(torch.ones_like(x), 0.5)
    ref = x @ layer.weight.T + 2.0 * (x * mask) @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
    layer.eval()
    clean = x @ layer.weight.T + 2.0 * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), clean, rtol=0, atol=1e-5)
    assert (y - clean).abs().max() > 1e-2


@pytest.mark.parametrize("method", ADAPTERS)
def test_merge_equals_unmerged_and_unmerge_restores(method):
    model = adapted(method)
    randomize_adapters(model)
    model.eval()
    x = tokens()
    before = model(x)[0]
    weights = {n: m.base_weight().clone() for n, m in model.named_modules()
               if isinstance(m, lora.LoRALinear)}
    lora.merge_all(model)
    for m in lora.adapters(model):
        assert m.merged and m.weight is not None
    merged = model(x)[0]
    torch.testing.assert_close(merged, before, rtol=0, atol=2e-5)
    assert (merged - before).abs().max() < 2e-5
    lora.merge_all(model, False)
    torch.testing.assert_close(model(x)[0], before, rtol=0, atol=2e-5)
    for n, m in model.named_modules():
        if isinstance(m, lora.LoRALinear):
            torch.testing.assert_close(m.base_weight(), weights[n], rtol=0, atol=1e-6)
    # a merged layer is one plain matrix: W0 + ΔW by the formula of each method
    m = model.layers[0].attention.wq
    w0 = m.base_weight().clone()
    lora.merge_all(model)
    if method == "vera":
        A, B = m.frozen_pair()
        expect = w0 + (m.vera_b[:, None] * B) @ (m.vera_d[:, None] * A)
    else:
        expect = w0 + m.scale * m.lora_B @ m.lora_A
        if method == "dora":
            expect = m.magnitude[:, None] * expect / expect.norm(dim=1, keepdim=True)
    torch.testing.assert_close(m.weight, expect, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ADAPTERS + ["full"])
def test_only_adapter_parameters_get_gradients(method):
    model = adapted(method) if method != "full" else tiny()
    if method == "full":
        lora.apply_adapters(model, "full")
    randomize_adapters(model)
    x = tokens()
    y = tokens(2)
    model(x, y)[1].backward()
    names = {"lora": ("lora_A", "lora_B"), "loraplus": ("lora_A", "lora_B"),
             "qlora": ("lora_A", "lora_B"), "dora": ("lora_A", "lora_B", "magnitude"),
             "vera": ("vera_d", "vera_b")}.get(method)
    n_adapted = 0
    for n, p in model.named_parameters():
        is_adapter = names is None or n.rsplit(".", 1)[-1] in names
        assert p.requires_grad == is_adapter, n
        assert (p.grad is not None) == is_adapter, n
        if is_adapter:
            assert p.grad.abs().sum() > 0, n
            n_adapted += 1
    per_layer = {"full": None, "dora": 3, "vera": 2}.get(method, 2)
    if per_layer:
        assert n_adapted == per_layer * 7 * model.config.n_layer
    if method == "qlora":   # the frozen base is NF4 only: no fp32 copy of the 7 matrices
        assert all(m.weight is None for m in lora.adapters(model))
    assert lora.trainable_formula(model, method) == sum(
        p.numel() for p in model.parameters() if p.requires_grad)


def test_loraplus_learning_rates_and_scales():
    model = adapted("loraplus")
    opt = lora.make_optimizer(model, "loraplus", lr=1e-3, loraplus_ratio=16)
    ids = [{id(p) for p in g["params"]} for g in opt.param_groups]
    a = {id(p) for n, p in model.named_parameters() if n.endswith("lora_A")}
    b = {id(p) for n, p in model.named_parameters() if n.endswith("lora_B")}
    assert ids == [a, b]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 16e-3]
    plain = lora.make_optimizer(adapted("lora"), "lora", lr=1e-3)
    assert len(plain.param_groups) == 1 and plain.param_groups[0]["lr"] == 1e-3
    # α/r vs rsLoRA's α/√r
    assert adapted("lora", rank=4, alpha=16).layers[0].attention.wq.scale == 4.0
    assert adapted("lora", rank=4, alpha=16, rslora=True).layers[0].attention.wq.scale == 8.0


def test_nf4_codebook_nearest_level_and_error_bound():
    code = torch.tensor(NF4_REFERENCE)
    assert torch.equal(nf4.NF4_CODE, code)                  # exact, bit for bit
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * torch.rand(96, 1, generator=gen)
    w[0, :64] = code.repeat(4) * 0.37                       # a block made of exact levels
    w[0, 63] = 0.37                                          # ... whose absmax is 0.37
    q = nf4.NF4Weight(w, double_quant=False)
    deq = q.dequantize()
    torch.testing.assert_close(deq[0, :64], w[0, :64], rtol=0, atol=1e-7)
    blocks, dblocks = w.reshape(-1, 64), deq.reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    normed = blocks / absmax
    # nearest level, by brute force over the 16 levels
    codes = nf4.unpack_nibbles(q.packed).view(-1, 64).long()
    dist = (normed[..., None] - code).abs()
    assert torch.all(dist.gather(-1, codes[..., None]).squeeze(-1) <= dist.min(-1).values + 1e-7)
    # error bound: half the gap between the two levels that bracket each value
    hi = torch.bucketize(normed.clamp(-1, 1), code).clamp(1, 15)
    half_gap = (code[hi] - code[hi - 1]) / 2
    err = (blocks - dblocks).abs()
    assert torch.all(err <= half_gap * absmax + 1e-6)
    assert err.max() > 0.3 * (half_gap * absmax).max()     # the bound is not vacuous
    # double quantization: the absmax constants move by at most half an int8 step
    dq = nf4.NF4Weight(w, double_quant=True)
    scale = dq.absmax_scale.repeat_interleave(256)[:absmax.numel()]
    amax_err = (dq.absmax_values() - absmax.squeeze(1)).abs()
    assert torch.all(amax_err <= scale / 2 + 1e-7)
    err_dq = (blocks - dq.dequantize().reshape(-1, 64)).abs()
    assert torch.all(err_dq <= half_gap * absmax + (scale / 2)[:, None] + 1e-6)


def test_nf4_packing_and_bits_per_param():
    codes = torch.randint(0, 16, (1000,), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    assert torch.equal(nf4.unpack_nibbles(nf4.pack_nibbles(codes)), codes)
    assert nf4.pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x12, 0xF0]
    n = 64 * 256 * 4                      # 4 whole double-quantization blocks
    w = torch.randn(n // 256, 256)
    with_dq, without = nf4.NF4Weight(w), nf4.NF4Weight(w, double_quant=False)
    # codes n/2 bytes + int8 absmax n/64 + fp32 scale per 256 blocks + one fp32 mean
    assert with_dq.nbytes == n // 2 + n // 64 + 4 * 4 + 4
    assert with_dq.bits_per_param == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / n)
    assert without.bits_per_param == 4.5
    assert with_dq.packed.numel() == n // 2 and with_dq.packed.dtype == torch.uint8


def test_nf4_matmul_backward_dequantizes_instead_of_saving():
    w = torch.randn(64, 32)
    q = nf4.NF4Weight(w)
    x = torch.randn(5, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    from core.meters import ActivationMeter
    with ActivationMeter() as meter:
        y = lora.NF4Matmul.apply(x, q)
    assert meter.bytes == 0                 # neither x nor an fp32 W is kept for backward
    y_ref = x2 @ q.dequantize().T
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)


def test_dora_with_magnitude_at_the_norm_is_lora():
    """m = ‖W0 + ΔW‖ makes DoRA's scale m/‖·‖ exactly 1: outputs AND the gradients of A and
    B must equal LoRA's (they would not if the norm were not detached)."""
    lo, do = adapted("lora"), adapted("dora")
    randomize_adapters(lo)
    with torch.no_grad():
        for a, b in zip(lora.adapters(lo), lora.adapters(do)):
            b.lora_A.copy_(a.lora_A)
            b.lora_B.copy_(a.lora_B)
            b.magnitude.copy_(b.weight_norm())
    x, y = tokens(), tokens(2)
    out_lo, loss_lo = lo(x, y)
    out_do, loss_do = do(x, y)
    torch.testing.assert_close(out_do, out_lo, rtol=0, atol=1e-5)
    loss_lo.backward()
    loss_do.backward()
    for a, b in zip(lora.adapters(lo), lora.adapters(do)):
        torch.testing.assert_close(b.lora_A.grad, a.lora_A.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(b.lora_B.grad, a.lora_B.grad, rtol=1e-4, atol=1e-7)


def test_vera_shared_pair_is_stored_once():
    model = adapted("vera", vera_rank=8)
    layers = lora.adapters(model)
    assert len(layers) == 14
    assert all(m.shared is model.vera_shared for m in layers)
    keys = [k for k in model.state_dict() if k.endswith((".A", ".B"))]
    assert keys == ["vera_shared.A", "vera_shared.B"]
    A, B = model.vera_shared.A, model.vera_shared.B
    assert A.shape == (8, 96) and B.shape == (96, 8)         # sized for the largest layer
    for m in layers:
        a, b = m.frozen_pair()
        assert a.data_ptr() == A.data_ptr() and b.data_ptr() == B.data_ptr()  # views
    # the ledger's frozen bytes count the pair once: base weights + A + B
    row = lora.ledger_row(model, "vera", {"state": {"grads": 0, "optimizer": 0}, "act": 0,
                                          "step_ms": 1}, (0, 0), (0, 0))
    base_bytes = sum(p.numel() * 4 for p in tiny().parameters())
    assert row["frozen"] == base_bytes + 4 * (A.numel() + B.numel())
    assert row["trainable"] == sum(8 + m.out_features for m in layers)
    assert all(torch.all(m.vera_d == 0.1) and torch.all(m.vera_b == 0) for m in layers)


def test_user_errors():
    with pytest.raises(UserError, match="rank 17 is impossible"):
        adapted("lora", rank=17)                              # wk is 16×32 in tiny
    valid = "output, w1, w2, w3, wk, wo, wq, wv"
    with pytest.raises(UserError, match=f"unknown target.*'q_proj'.*are {valid}"):
        adapted("lora", targets="q_proj,v_proj")
    with pytest.raises(UserError, match="unknown target.*'v_proj'"):   # one typo of two
        adapted("lora", targets=["wq", "v_proj"])
    with pytest.raises(UserError, match="multiple of the NF4 block"):
        lora.apply_adapters(tiny(n_embd=40), "qlora", rank=2)  # wk: 20×40 = 800 weights
    with pytest.raises(UserError, match="unknown method"):
        adapted("ia3")
    spec = lora.apply_adapters(tiny(), "lora", targets="layers.1.attention.wq", rank=2)
    assert spec["targets"] == ["layers.1.attention.wq"]
    model = adapted("lora")
    with pytest.raises(UserError, match="already carries adapters"):
        lora.apply_adapters(model, "lora")
    for argv, why in ((["eval"], "give --load PATH"), (["compare", "--save", "a.pt"],
                       "work on one adapter"), (["--method", "full", "--save", "a.pt"],
                       "no adapter to --save")):
        with pytest.raises(UserError, match=why):
            lora.parse_args(argv)
    r = run_python("lora.py", ["--ckpt", "/nonexistent.pt"], timeout=60)
    assert r.returncode == 2 and r.output.strip().splitlines() == [
        "error: checkpoint '/nonexistent.pt' not found (train one first: python train.py)"]


def test_estimate_shapes_match_published_sizes():
    for key, published in (("65B", 65.2e9), ("70B", 69.0e9)):
        L, d, kv, ffn, V, _ = lora_estimate.EST_SHAPES[key]
        n = L * (2 * d * d + 2 * kv * d + 3 * ffn * d) + 2 * V * d
        assert abs(n / published - 1) < 0.01


def args_for(**kw):
    a = lora.parse_args(["--ckpt", "none", "--preset", "tiny"])
    return argparse.Namespace(**{**vars(a), **kw})


@pytest.mark.slow
def test_data_parallel_two_ranks_equal_one_process(tmp_path):
    """torchrun × 2 ranks, 4 rows each, adapter grads all-reduced == one process, 8 rows."""
    steps, method = 4, "dora"
    out = tmp_path / "dp.pt"
    r = torchrun("lora.py", ["--ckpt", "none", "--preset", "tiny", "--method", method,
                             "--steps", steps, "--batch-size", 4, "--n-train", 300,
                             "--eval-problems", 0, "--warmup", 2, "--save", out], nproc=2,
                 timeout=150)
    assert r.returncode == 0, r.output
    assert "all_reduce" in r.output
    args = args_for(method=method, steps=steps, batch_size=8, n_train=300, eval_problems=0,
                    warmup=2)
    base, enc = lora.build_base(args)
    pairs, _, _ = lora.task_data(enc, args)
    model = copy.deepcopy(base)
    lora.apply_adapters(model, method, **lora.adapter_kwargs(args))
    lora.finetune(model, method, pairs, args, log=False)
    dp = lora.read_adapter(str(out))["tensors"]
    mine = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert dp.keys() == mine.keys()
    for n in mine:
        torch.testing.assert_close(dp[n], mine[n], rtol=1e-4, atol=2e-5)
    b = [m.lora_B for m in lora.adapters(model)]
    assert max(x.abs().max().item() for x in b) > 1e-3       # training did move B off 0


# ---------------------------------------------------------------------------- conventions
def test_targets_as_a_list_or_a_string():
    """peft's target_modules takes a list; ours takes that or 'wq,wv': the same layers."""
    names = {}
    for targets in ("wq,wv", ["wq", "wv"], ("wv", "wq"), {"wv", "wq"}, " wq , wv "):
        names[repr(targets)] = lora.apply_adapters(tiny(), "lora", targets=targets)["targets"]
    assert len({tuple(v) for v in names.values()}) == 1
    assert names["'wq,wv'"] == [f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wq", "wv")]
    with pytest.raises(UserError, match="comma-separated string or a list"):
        lora.apply_adapters(tiny(), "lora", targets=7)


def test_vera_shared_pair_has_peft_kaiming_init():
    """peft's VeRA _kaiming_init: U(±√3·√2/√fan_in) = U(±√(6/fan_in)), fan_in = columns:
    A (r×in) with in, B (out×r) with r. LoRA's bound 1/√fan_in would be √6 times smaller."""
    model = adapted("vera", vera_rank=8)
    for t, fan_in in ((model.vera_shared.A, 96), (model.vera_shared.B, 8)):
        bound = math.sqrt(6 / fan_in)
        assert t.abs().max() <= bound
        assert t.abs().max() > 0.95 * bound                     # not a smaller bound
        assert t.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)   # uniform


def test_dora_training_dropout_is_peft_formulation():
    """In training with dropout p, peft's DoRA: y = W0 x + (m/‖V‖ - 1)·W0 drop(x) +
    (m/‖V‖)·s·BA drop(x), the same mask in both terms; eval: W' x (DoRA's Eq. 5)."""
    gen = torch.Generator().manual_seed(0)
    layer = lora.DoRALinear(torch.nn.Linear(32, 16, bias=False), rank=4, alpha=8, dropout=0.5,
                            gen=gen)
    with torch.no_grad():
        layer.lora_B.normal_(generator=gen)
        layer.magnitude.mul_(1.5)
    x = torch.randn(5, 32, generator=gen)
    torch.manual_seed(123)
    y = layer(x)
    torch.manual_seed(123)
    dropped = x * torch.nn.functional.dropout(torch.ones_like(x), 0.5)
    w0, ba = layer.weight, 2.0 * layer.lora_B @ layer.lora_A
    scale = layer.magnitude / (w0 + ba).norm(dim=1)
    ref = x @ w0.T + (scale - 1) * (dropped @ w0.T) + scale * (dropped @ ba.T)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
    paper_form = scale * (x @ w0.T + dropped @ ba.T)     # what the scaled-sum form gave
    assert (y - paper_form).abs().max() > 1e-2
    layer.eval()
    torch.testing.assert_close(layer(x), x @ (scale[:, None] * (w0 + ba)).T, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- adapter files
def trained(method, seed=0):
    """An adapted tiny model with non-trivial adapters (as after training), and its spec."""
    model = tiny(seed)
    spec = lora.apply_adapters(model, method, rank=4, seed=7, dropout=0.1, vera_rank=8)
    randomize_adapters(model)
    return model.eval(), spec


def write_base(path, seed=0, **overrides):
    """The base as a train.py-format checkpoint (config, model, tokenizer)."""
    base = tiny(seed, **overrides)
    torch.save(dict(config=asdict(base.config), model=base.state_dict(),
                    tokenizer=data.encoding_to_state(BYTES)), path)
    return base


BYTES = data.make_encoding({bytes([i]): i for i in range(256)})
RELOAD = """
import sys, torch, lora
from core.checkpoint import load_model
torch.manual_seed(12345)                 # a different seed from the saving process
base, x, out, *adapters = sys.argv[1:]
logits = {}
for path in adapters:
    model, _ = load_model(base)
    spec = lora.load_adapter(model, lora.read_adapter(path), path)
    logits[spec["method"]] = model.eval()(torch.load(x))[0]
torch.save(logits, out)
"""


def test_save_then_reload_in_a_fresh_process_gives_identical_outputs(tmp_path):
    """All five methods: save, then a new process with another seed rebuilds each adapted
    model from the base checkpoint + the adapter file alone: the same logits, bit for bit."""
    write_base(tmp_path / "base.pt")
    x = tokens()
    torch.save(x, tmp_path / "x.pt")
    want, files = {}, []
    for method in ADAPTERS:
        model, spec = trained(method)
        want[method] = model(x)[0]
        files.append(tmp_path / f"{method}.pt")
        lora.save_adapter(model, spec, str(files[-1]))
        ad = torch.load(files[-1], weights_only=True)              # plain data only
        assert ad["method"] == method and ad["hparams"]["rank"] == (8 if method == "vera" else 4)
        assert ad["base"]["sha256"] == lora.base_fingerprint(tiny())
    (tmp_path / "reload.py").write_text(RELOAD)
    r = run_python(tmp_path / "reload.py", [tmp_path / "base.pt", tmp_path / "x.pt",
                                            tmp_path / "got.pt", *files], timeout=120)
    assert r.returncode == 0, r.output
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert set(got) == set(ADAPTERS)
    for method in ADAPTERS:
        torch.testing.assert_close(got[method], want[method], rtol=0, atol=0)
        assert (want[method] - tiny()(x)[0]).abs().max() > 1e-3     # the adapter matters


def test_vera_without_or_with_another_pair_is_refused(tmp_path):
    model, spec = trained("vera")
    lora.save_adapter(model, spec, str(tmp_path / "v.pt"))
    ad = lora.read_adapter(str(tmp_path / "v.pt"))
    lora.load_adapter(tiny(), ad)                                   # the right pair loads
    for change, why in ((lambda t: t.pop("vera_shared.A"), "lacks its shared frozen pair"),
                        (lambda t: t["vera_shared.B"].mul_(1.01), "not the pair that seed 7"),
                        (lambda t: t.update({"vera_shared.A": t["vera_shared.A"][:4]}),
                         "not the pair that seed 7")):
        bad = copy.deepcopy(ad)
        change(bad["tensors"])
        with pytest.raises(UserError, match=why):
            lora.load_adapter(tiny(), bad)
    bad = copy.deepcopy(ad)
    bad["tensors"].pop("layers.0.attention.wq.vera_b")
    with pytest.raises(UserError, match="missing .'layers.0.attention.wq.vera_b'"):
        lora.load_adapter(tiny(), bad)


def test_adapter_on_another_base_is_refused(tmp_path):
    model, spec = trained("lora")
    lora.save_adapter(model, spec, str(tmp_path / "a.pt"))
    ad = lora.read_adapter(str(tmp_path / "a.pt"))
    with pytest.raises(UserError, match="trained on another base model"):
        lora.load_adapter(tiny(seed=1), ad)                         # same shapes, other W0
    nudged = tiny()
    with torch.no_grad():
        nudged.layers[1].feed_forward.w2.weight[0, 0] += 1e-6      # one weight, by 1e-6
    with pytest.raises(UserError, match="trained on another base model"):
        lora.load_adapter(nudged, ad)


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_bad_files_are_one_line_errors(tmp_path):
    """Garbage, a pickle that would run code, a checkpoint that is not an adapter: each one
    UserError (weights_only=True never runs the pickle), and exit 2 with one line."""
    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"format": lora.ADAPTER_FORMAT, "x": Evil()}, f)
    write_base(tmp_path / "base.pt")
    for name, why in (("junk.pt", "is not a PyTorch checkpoint"),
                      ("evil.pt", "safe loading"),
                      ("base.pt", "is not a lora.py adapter file"), ("none.pt", "not found")):
        with pytest.raises(UserError, match=why):
            lora.read_adapter(str(tmp_path / name))
    r = run_python("lora.py", ["eval", "--ckpt", tmp_path / "base.pt", "--load",
                               tmp_path / "evil.pt"], timeout=60)
    assert r.returncode == 2 and "unpickled!" not in r.output
    assert r.output.strip().startswith("error: ") and "safe loading" in r.output
    assert len(r.output.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- merge, unload, serve
@pytest.mark.parametrize("method", ADAPTERS)
def test_merge_and_unload_is_a_plain_gpt_that_load_model_and_the_engine_read(method, tmp_path):
    model, spec = trained(method)
    x = tokens()
    plain = lora.merge_and_unload(model)
    assert type(plain) is GPT and not lora.adapters(plain)
    assert set(plain.state_dict()) == set(tiny().state_dict())     # no adapter tensors
    torch.testing.assert_close(plain.eval()(x)[0], model(x)[0], rtol=0, atol=1e-5)
    lora.merge_all(model)                          # the adapted model can still merge ...
    lora.merge_all(model, False)                   # ... and unmerge: it was not touched
    lora.export_checkpoint(plain, BYTES, str(tmp_path / "merged.pt"), spec)
    served, ckpt = load_model(str(tmp_path / "merged.pt"))
    assert ckpt["merged_from"]["method"] == method
    prompts = [[3, 14, 15, 92, 65], [79, 32, 38, 46, 26, 43, 38]]      # batched together
    want = [model.generate(p, 8, temperature=0) for p in prompts]
    seqs = Engine(served.eval(), block_size=4, num_blocks=32).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0))
    assert [s.output_ids for s in seqs] == want


@pytest.mark.slow
def test_the_adapter_file_knows_every_setting_apply_adapters_takes():
    """core/adapter_file.py refuses a file recording a setting it does not know: its list
    must be exactly lora.apply_adapters' settings (the model and method aside)."""
    params = set(inspect.signature(lora.apply_adapters).parameters) - {"model", "method"}
    assert set(adapter_file.SETTINGS) == params
    assert set(adapter_file.FILE_METHODS) == set(lora.METHODS) - {"full"}


def test_cli_save_continue_eval_export(tmp_path):
    """The user's path: train + --save; --load continues training (from the file's
    method and tensors); eval --load evaluates and --export writes the merged model."""
    common = ["--ckpt", tmp_path / "base.pt", "--n-train", 200, "--eval-problems", 20,
              "--batch-size", 4, "--warmup", 1, "--log-interval", 1]
    write_base(tmp_path / "base.pt", vocab_size=BYTES.n_vocab)     # decodable answers
    r = run_python("lora.py", [*common, "--method", "vera", "--steps", 2, "--save",
                               tmp_path / "a.pt"], timeout=120)
    assert r.returncode == 0, r.output
    # one method: its progress counts steps (not "lora compare: 0% (0/1) | 0 s | eta ?")
    assert "vera: 100% (2/2 steps) | " in r.output and "compare:" not in r.output, r.output
    r = run_python("lora.py", [*common, "--load", tmp_path / "a.pt", "--steps", 2, "--seed", 3,
                               "--save", tmp_path / "b.pt"], timeout=120)
    assert r.returncode == 0, r.output
    assert "step    2 | vera" in r.output
    a, b = (lora.read_adapter(str(tmp_path / n)) for n in ("a.pt", "b.pt"))
    assert b["training"]["loaded_from"] == str(tmp_path / "a.pt")
    assert any((a["tensors"][k] - b["tensors"][k]).abs().max() > 0 for k in a["tensors"])
    r = run_python("lora.py", ["eval", *common, "--load", tmp_path / "b.pt", "--export",
                               tmp_path / "m.pt"], timeout=120)
    assert r.returncode == 0, r.output
    assert "vera adapter on 14 layers" in r.output and "written to" in r.output
    merged, _ = load_model(str(tmp_path / "m.pt"))
    model = tiny(vocab_size=BYTES.n_vocab)
    lora.load_adapter(model, b)
    x = tokens(vocab=BYTES.n_vocab)
    torch.testing.assert_close(merged.eval()(x)[0], model.eval()(x)[0], rtol=0, atol=1e-5)
