"""quantize.py: formats against their formulas, GPTQ against a slow textbook reference,
scaling as an identity, QAT/LSQ gradients, 2:4 masks, quantized checkpoints in the serving
engine, and one-line errors."""
import copy
import math
from dataclasses import asdict

import pytest
import torch

from core import data
from compression import prune
from compression import qat
from compression import calibrated as C
import quantize as Q
from core import quant_format
from core.checkpoint import load_model
from model import GPT, get_config
from core.plumbing import UserError, run_cli
from serve import Engine, SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def tiny(seed=0, **kw):
    return GPT(get_config("tiny", vocab_size=64, **kw), seed=seed).eval()


def batches(model, n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (2, 24), generator=gen) for _ in range(n)]


def correlated_inputs(n, dim, seed=0):
    """Activations with correlated channels and a few large ones (what makes GPTQ's
    compensation and AWQ's scaling matter)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen) @ torch.randn(4, dim, generator=gen)
    x = x + 0.3 * torch.randn(n, dim, generator=gen)
    return x * (1 + 4 * (torch.arange(dim) % 7 == 0))


# ----------------------------------------------------------------------------------------
# Formats

def direct_dequant(w, bits, g):
    """The formula, one group at a time, written out."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c0 in range(0, w.shape[1], g):
            grp = w[r, c0:c0 + g]
            if bits == 8:
                scale = float(torch.tensor(float(grp.abs().max()) / 127).half())
                q = torch.clamp(torch.round(grp / scale), -127, 127)
                out[r, c0:c0 + g] = q * scale
            else:
                lo, hi = min(float(grp.min()), 0.0), max(float(grp.max()), 0.0)
                scale = float(torch.tensor((hi - lo) / (2 ** bits - 1)).half())
                zero = min(max(round(-lo / scale), 0), 2 ** bits - 1)
                q = torch.clamp(torch.round(grp / scale) + zero, 0, 2 ** bits - 1)
                out[r, c0:c0 + g] = (q - zero) * scale
    return out


@pytest.mark.parametrize("bits,group", [(8, 0), (8, 16), (4, 16), (4, 0), (3, 8), (3, 32)])
def test_round_trip_equals_formula_and_bits_per_param(bits, group):
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(bits + group))
    stored = quant_format.rtn(w, bits, group or 32)
    got = quant_format.dequantize(stored, w.shape, bits, group)
    assert torch.equal(got, direct_dequant(w, bits, group or 32))
    scale = quant_format.expand(stored["scales"].float(), group or 32)
    assert (got - w).abs().le(scale / 2 + 1e-7).all()          # nearest level, never clipped
    # bits/param counted from the stored tensors = b + (16 + 8)/g (int8: + 16/g, no zero)
    counted = 8 * quant_format.stored_nbytes(stored) / w.numel()
    assert counted == quant_format.format_bits_per_param(bits, group, 32)
    assert counted == bits + (16 + (0 if bits == 8 else 8)) / (group or 32)
    layer = quant_format.QuantLinear(stored, w.shape, bits, group)
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), x @ got.t())


def test_packing_order():
    codes = torch.arange(16)
    assert quant_format.pack_codes(codes, 4).tolist() == [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]
    c3 = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])        # 001 010 011 100 101 110 111 000
    assert quant_format.pack_codes(c3, 3).tolist() == [0b00101001, 0b11001011, 0b10111000]
    for bits in (2, 3, 4):
        x = torch.randint(0, 2 ** bits, (5, 40), generator=torch.Generator().manual_seed(bits))
        packed = quant_format.pack_codes(x, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(200 * bits / 8)
        assert torch.equal(quant_format.unpack_codes(packed, bits, 200).view(5, 40), x)


# ----------------------------------------------------------------------------------------
# GPTQ

def gptq_reference(w, h, bits, g, damp=0.01, act_order=False):
    """The slow textbook version (Frantar et al. 2022, eq. 2-3 before the Cholesky trick):
    the explicit inverse Hessian, one column at a time, no lazy batching; after each column
    the inverse of the remaining columns' Hessian by Gaussian elimination (OBS)."""
    w, h = w.clone(), h.clone()
    cols = w.shape[1]
    static = quant_format.group_params(w, bits, g) if act_order or g == cols else None
    order = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(cols)
    h += damp * h.diagonal().mean() * torch.eye(cols, dtype=w.dtype)
    hinv = torch.linalg.inv(h)
    codes = torch.zeros_like(w)
    if static is not None:
        scale, zero = static
    else:
        scale = torch.zeros(w.shape[0], cols // g, dtype=w.dtype)
        zero = torch.zeros(w.shape[0], cols // g, dtype=w.dtype)
    for step, q in enumerate(order.tolist()):
        if static is None and q % g == 0:
            s, z = quant_format.group_params(w[:, q:q + g], bits, g)
            scale[:, q // g], zero[:, q // g] = s[:, 0], z[:, 0]
        codes[:, q] = quant_format.to_codes(w[:, q], scale[:, q // g], zero[:, q // g], bits)
        wq = (codes[:, q] - zero[:, q // g]) * scale[:, q // g]
        err = (w[:, q] - wq) / hinv[q, q]
        rest = order[step + 1:]
        w[:, rest] -= err[:, None] * hinv[q, rest][None, :]
        w[:, q] = wq
        hinv = hinv - hinv[:, q:q + 1] @ hinv[q:q + 1, :] / hinv[q, q]
    return (codes - quant_format.expand(zero, g)) * quant_format.expand(scale, g)


def layer_problem(out=12, dim=32, n=256, seed=0, dtype=torch.float32):
    x = correlated_inputs(n, dim, seed).to(dtype)
    w = torch.randn(out, dim, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return w, x, 2 * x.t() @ x / n


@pytest.mark.parametrize("bits,g,act_order", [(4, 8, False), (3, 16, False), (8, 32, False),
                                              (4, 8, True)])
def test_gptq_equals_slow_reference(bits, g, act_order):
    w, _, h = layer_problem(dtype=torch.float64)
    stored = C.gptq(w, h, bits, g, block_size=16, act_order=act_order)   # 2 lazy blocks
    fast = quant_format.dequantize(stored, w.shape, bits, g).double()
    slow = gptq_reference(w, h, bits, g, act_order=act_order)
    assert (fast - slow).abs().max() < 1e-5


@pytest.mark.parametrize("bits,g", [(8, 0), (4, 8), (3, 16)])
def test_gptq_beats_round_to_nearest(bits, g):
    """||WX - ŴX||² below RTN's at the same bits and groups -- clearly (≤ 0.9×), so
    skipping the error compensation (which leaves exactly RTN) fails this test."""
    w, x, h = layer_problem()
    err = lambda stored: (x @ (w - quant_format.dequantize(stored, w.shape, bits, g)).t()).pow(2).sum()
    e_gptq = err(C.gptq(w, h, bits, g))
    e_rtn = err(quant_format.rtn(w, bits, g or w.shape[1]))
    assert e_gptq <= 0.9 * e_rtn


# ----------------------------------------------------------------------------------------
# AWQ and SmoothQuant

CONFIGS = {"gqa": {}, "mha": dict(n_kv_head=4), "moe": dict(n_expert=4, expert_top_k=2)}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_scaling_is_an_identity_before_quantization(method, cfg):
    model = tiny(**CONFIGS[cfg])
    calib = batches(model)
    scaled = copy.deepcopy(model)
    if method == "awq":
        choose = lambda st, ws: C.awq_search(st.sample(), ws, (st.abs_sum / st.n).float(),
                                             4, 16, n_grid=5)
    else:
        choose = lambda st, ws: (C.smooth_scales(st.abs_max, ws, 0.5), 0.5)
    infos = C.scale_model(scaled, calib, choose, keep=48)
    x = batches(model, 1, seed=5)[0]
    assert (scaled(x)[0] - model(x)[0]).abs().max() < 1e-5
    changed = [not torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     scaled.state_dict().values())]
    assert sum(changed) >= len(infos)              # the scales really were folded in


def test_awq_search_finds_a_better_scale_than_rtn():
    w, x, _ = layer_problem()
    s, alpha = C.awq_search(x, [w], x.abs().mean(0), 3, 8)
    err = lambda wq, xin: (xin @ wq.t() - x @ w.t()).pow(2).sum()
    assert alpha > 0
    assert err(C.fake_quant(w * s, 3, 8), x / s) < 0.95 * err(C.fake_quant(w, 3, 8), x)


def test_w8a8_smoothing_reduces_error_and_int_mm_matches():
    w, x, _ = layer_problem(out=16, dim=64)
    x[:, 3] *= 30                                   # one outlier channel, as in LLMs
    ref = x @ w.t()
    plain = quant_format.QuantLinear(quant_format.rtn(w, 8, 0), w.shape, 8, 0, act_bits=8)
    s = C.smooth_scales(x.abs().amax(0), [w], 0.5)
    smooth = quant_format.QuantLinear(quant_format.rtn(w * s, 8, 0), w.shape, 8, 0, act_bits=8)
    assert (smooth(x / s) - ref).pow(2).sum() < 0.5 * (plain(x) - ref).pow(2).sum()
    # the integer path: per-token scales, integer accumulate, then both scales
    s_x = x.abs().amax(-1, keepdim=True) / 127
    x_q = torch.round(x / s_x)
    want = (x_q @ plain.codes.float().t()) * s_x * plain.scales.float().t()
    assert torch.equal(plain(x), want)
    if hasattr(torch, "_int_mm"):
        fast = quant_format.QuantLinear(quant_format.rtn(w, 8, 0), w.shape, 8, 0, act_bits=8, int_mm_rows=1)
        assert torch.equal(fast(x), plain(x))


# ----------------------------------------------------------------------------------------
# QAT

def test_ste_forward_is_dequantized_and_gradient_is_clipped_straight_through():
    w = torch.linspace(-1, 1, 32).repeat(2, 1).requires_grad_()
    scale, zero = torch.full((2, 32), 0.05), torch.full((2, 32), 8.0)   # range [-0.4, 0.35]
    out = qat.FakeQuantSTE.apply(w, scale, zero, 4)
    assert torch.equal(out, (torch.clamp(torch.round(w / 0.05) + 8, 0, 15) - 8) * 0.05)
    up = torch.randn(2, 32)
    out.backward(up)
    inside = (torch.round(w / 0.05) + 8 >= 0) & (torch.round(w / 0.05) + 8 <= 15)
    assert 0 < inside.sum() < inside.numel()
    assert torch.equal(w.grad, torch.where(inside, up, torch.zeros_like(up)))
    layer = qat.QATLinear(torch.randn(8, 32), 4, 16)
    assert torch.equal(layer.fake_weight(), layer.export().dequantized())


def test_lsq_gradients_match_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    step = torch.full((4, 2), 0.3, dtype=torch.float64) + 0.1 * torch.rand(4, 2, generator=gen)
    up = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    q_n, q_p, g = 8, 7, 16
    w1, s1 = w.clone().requires_grad_(), step.clone().requires_grad_()
    qat.LSQQuant.apply(w1, s1, q_n, q_p).backward(up)
    # Esser et al.'s code: grad_scale and round_pass, then autograd does the rest
    w2, s2 = w.clone().requires_grad_(), step.clone().requires_grad_()
    scale = 1 / math.sqrt(g * q_p)
    s = (s2 - s2 * scale).detach() + s2 * scale
    v = (w2 / quant_format.expand(s, g)).clamp(-q_n, q_p)
    v = (v.round() - v).detach() + v
    (v * quant_format.expand(s, g)).backward(up)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-12)
    assert torch.allclose(s1.grad, s2.grad, atol=1e-10)
    assert (w1.grad == 0).any() and (w1.grad != 0).any()      # both regions were hit
    layer = qat.QATLinear(torch.randn(8, 32), 3, 16, lsq=True)
    assert torch.equal(layer.fake_weight(), layer.export().dequantized())


# ----------------------------------------------------------------------------------------
# Pruning

def test_2_4_masks_and_they_stay_through_finetuning(text_file):
    corpus = data.load_corpus(text_file, 512)
    model = GPT(get_config("tiny"), seed=0)
    calib = [data.get_batch(corpus.train, 2, 32, 0, i)[0] for i in range(2)]
    assert prune.prune_model(model, calib, 0.5, "2:4", "wanda") == 8    # 2 blocks × 4 stages
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, prune.MaskedLinear)}
    for name, w in before.items():
        zeros = (w.view(w.shape[0], -1, 4) == 0).sum(-1)
        assert (zeros == 2).all(), name
        packed = prune.pack_24(w, (w != 0).float())
        assert torch.equal(prune.unpack_24(packed, w.shape), w)
        assert quant_format.stored_nbytes(packed) == w.numel() // 2 * 4 + w.numel() // 8
    qat.finetune(model, corpus, 3, 1e-2, 2, 32, 0)
    for name, m in model.named_modules():
        if isinstance(m, prune.MaskedLinear):
            assert torch.equal(m.weight == 0, before[name] == 0), name
            assert not torch.equal(m.weight, before[name])           # the rest did train


def test_wanda_and_magnitude_scores():
    w, x, _ = layer_problem(out=4, dim=16)
    st = C.ActStats(16)
    st.add(x)
    want = w.abs() * x.pow(2).sum(0).sqrt()[None, :]
    assert torch.allclose(prune.prune_score(w, "wanda", st), want, rtol=1e-5)
    mask = prune.prune_mask(want, 0.25, "unstructured")
    assert ((mask == 0).sum(1) == 4).all()                        # int(16 · 0.25) per row
    kept_min = torch.where(mask.bool(), want, torch.inf).amin(1)
    dropped_max = torch.where(mask.bool(), -torch.inf, want).amax(1)
    assert (dropped_max <= kept_min).all()


# ----------------------------------------------------------------------------------------
# Checkpoints: model.load_model, the serving engine, the CLI

@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory, text_file):
    corpus = data.load_corpus(text_file, 512)
    model = GPT(get_config("tiny"), seed=3)
    qat.finetune(model, corpus, 20, 3e-3, 4, 32, 0)
    path = tmp_path_factory.mktemp("q") / "fp32.pt"
    torch.save(dict(config=asdict(model.config), model=model.state_dict(),
                    tokenizer=data.encoding_to_state(corpus.enc), args={"data": text_file}),
               path)
    return str(path), model, corpus


@pytest.mark.parametrize("bits,g,method", [(8, 0, "rtn"), (4, 32, "gptq"), (3, 16, "rtn")])
def test_quantized_checkpoint_serves_what_the_quantized_model_generates(
        fp32_ckpt, tmp_path, bits, g, method):
    _, base, corpus = fp32_ckpt
    if method == "rtn":
        qmodel = quant_format.quantize_model(copy.deepcopy(base), bits, g)
    else:
        calib = [data.get_batch(corpus.train, 2, 32, 0, i)[0] for i in range(2)]
        qmodel = copy.deepcopy(base)
        C.sequential(qmodel, calib, C.gptq_transform(bits, g))
    path = str(tmp_path / "q.pt")
    Q.save_checkpoint(path, qmodel, corpus.enc, dict(method=method, bits=bits), None)
    raw = torch.load(path, weights_only=True)
    assert raw["quantized"]["layers.0.attention.wq"]["codes"].dtype == (
        torch.int8 if bits == 8 else torch.uint8)
    loaded, _ = load_model(path)
    for name, m in qmodel.named_modules():
        if isinstance(m, quant_format.QuantLinear):
            assert torch.equal(loaded.get_submodule(name).weight, m.dequantized())
    prompts = [corpus.val[i:i + 8].astype("int64").tolist() for i in (0, 50, 100)]
    want = [qmodel.generate(p, 12, temperature=0) for p in prompts]
    seqs = Engine(loaded, block_size=8, num_blocks=64).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [s.output_ids for s in seqs] == want


SMALL_RUN = ["--eval-batches", "1", "--prompts", "1", "--new-tokens", "4", "--repeats", "1",
             "--seq-len", "32", "--batch-size", "2", "--calib-batches", "1"]


def test_cli_rtn_writes_a_loadable_checkpoint(fp32_ckpt, tmp_path, text_file):
    path, _, _ = fp32_ckpt
    out = str(tmp_path / "int4.pt")
    rows = Q.main(["rtn", "--bits", "4", "--ckpt", path, "--data", text_file, "--save", out,
                   *SMALL_RUN])
    assert rows[1]["bits_per_weight"] == 4 + 24 / 32
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["quantization"]["bits"] == 4
    assert isinstance(load_model(out)[0], GPT)


def test_cli_prune_saves_a_dense_checkpoint_with_the_zeros(fp32_ckpt, tmp_path, text_file):
    path, _, _ = fp32_ckpt
    out = str(tmp_path / "pruned.pt")
    Q.main(["prune", "--pattern", "2:4", "--criterion", "magnitude", "--finetune-steps", "2",
            "--ckpt", path, "--data", text_file, "--save", out, *SMALL_RUN])
    model, ckpt = load_model(out)
    assert "quantization" not in ckpt
    w = model.layers[1].feed_forward.w2.weight
    assert ((w.view(w.shape[0], -1, 4) == 0).sum(-1) == 2).all()


@pytest.mark.slow
def test_cli_compare_runs_every_row(fp32_ckpt, tmp_path, text_file):
    rows = Q.main(["compare", "--ckpt", fp32_ckpt[0], "--data", text_file, "--qat-steps", "2",
                   "--out-dir", str(tmp_path), *SMALL_RUN])
    assert len(rows) == 1 + 3 + 4 + 4 + 1 + 1 + 2 * 3 + 5        # fp32 ... wanda + steps
    assert (tmp_path / "compare.md").read_text().count("\n") == len(rows) + 2


@pytest.mark.parametrize("argv,message", [
    (["rtn", "--bits", "5"], "--bits 5 is not supported"),
    (["rtn", "--bits", "4", "--group-size", "24"], "does not divide the input dimension"),
    (["prune", "--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
    (["gptq", "--calib-batches", "0"], "needs calibration data"),
    (["rtn", "--ckpt", "/nonexistent/ckpt.pt"], "not found"),
])
def test_bad_input_is_one_clear_error(fp32_ckpt, text_file, capsys, argv, message):
    if "--ckpt" not in argv:
        argv = argv + ["--ckpt", fp32_ckpt[0], "--data", text_file]
    with pytest.raises(SystemExit) as e:
        run_cli(Q.main, argv[:1] + SMALL_RUN + argv[1:])   # the later flag wins
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


@pytest.mark.slow
def test_quantized_target_in_spec_decode(tmp_path, text_file):
    """spec_decode.py takes the quantized checkpoint as its target: its plain decoding is
    the quantized model's greedy output, and speculative decoding still reproduces it."""
    import spec_decode
    corpus = data.load_corpus(text_file, 512)
    base = GPT(get_config("tiny", block_size=128), seed=4)      # drafter training needs 96+
    qmodel = quant_format.quantize_model(copy.deepcopy(base), 4, 32)
    path = str(tmp_path / "q.pt")
    Q.save_checkpoint(path, qmodel, corpus.enc, dict(method="rtn", bits=4), text_file)
    rows = spec_decode.main(["generate", "--ckpt", path, "--method", "medusa", "--prompt",
                             "def f", "--train-steps", "2", "--out-dir", str(tmp_path),
                             "--max-new-tokens", "8", "--repeats", "1"])
    want = qmodel.generate(corpus.enc.encode_ordinary("def f"), 8, temperature=0)
    assert rows[0]["outs"] == [want] and rows[1]["same"] == "yes"


def test_gptq_quantizes_shared_experts_and_refuses_latent_attention():
    """DeepSeek-style blocks: the shared experts read the same input as the routed ones,
    so GPTQ's stages must include them (no fp32 linear left behind); latent attention has
    other stages, refused in one line."""
    cfg = get_config("tiny", n_expert=4, expert_top_k=2, n_shared_expert=1, ffn_hidden=32)
    model = GPT(cfg, seed=0)
    calib = [torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i))
             for i in range(2)]
    C.sequential(model, calib, C.gptq_transform(4, 16))
    assert quant_format.target_linears(model) == []          # every block linear is a QuantLinear now
    mla = GPT(get_config("tiny", kv_lora_rank=16, qk_rope_head_dim=4), seed=0)
    with pytest.raises(UserError, match="latent attention"):
        C.sequential(mla, calib, C.gptq_transform(4, 16))
