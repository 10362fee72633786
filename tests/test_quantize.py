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
from core.errors import UserError
from core.runtime import run_cli
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
    """The textbook fits each group on the weights updated so far: the `updated` group fit
    (at g = 8 < block 16 the default block-start fit differs; see the fasterquant tests)."""
    w, _, h = layer_problem(dtype=torch.float64)
    stored = C.gptq(w, h, bits, g, block_size=16, act_order=act_order,   # 2 lazy blocks
                    group_fit="updated")
    fast = quant_format.dequantize(stored, w.shape, bits, g).double()
    slow = gptq_reference(w, h, bits, g, act_order=act_order)
    assert (fast - slow).abs().max() < 1e-5


def fasterquant_reference(w, h, bits, groupsize, blocksize, percdamp=0.01):
    """IST-DASLab/gptq's fasterquant (gptq.py; groups, no act-order), line by line under its
    own names, with this repo's quantizer (quant_format.group_params: the stored format's
    fp16 scales; gptq's Quantizer keeps them fp32, the same min/max rule with 0 in range).
    The line under test: a group's find_params reads W[:, (i1 + i):(i1 + i + groupsize)]
    -- W, which gets the error feedback only at each block's end, not W1, the block's
    working copy. -> (codes, scales, zeros)."""
    W, H = w.clone(), h.clone()
    columns = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    scales = torch.zeros(W.shape[0], columns // groupsize, dtype=W.dtype)
    zeros = torch.zeros_like(scales)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w_col = W1[:, i]
            d = Hinv1[i, i]
            if (i1 + i) % groupsize == 0:                          # find_params, on W
                scale, zero = quant_format.group_params(W[:, (i1 + i):(i1 + i + groupsize)],
                                                        bits, groupsize)
                scales[:, (i1 + i) // groupsize] = scale[:, 0]
                zeros[:, (i1 + i) // groupsize] = zero[:, 0]
            Q[:, i1 + i] = torch.clamp(torch.round(w_col / scale[:, 0]) + zero[:, 0],
                                       0, 2 ** bits - 1)            # quant.py's quantize
            q = scale[:, 0] * (Q[:, i1 + i] - zero[:, 0])
            err1 = (w_col - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return Q, scales, zeros


def stored_as_reference(stored, shape, bits):
    """The stored tensors, unpacked: (codes, scales, zeros) as fasterquant_reference's."""
    codes = quant_format.unpack_codes(stored["codes"], bits, shape[0] * shape[1])
    return codes.view(shape), stored["scales"], stored["zeros"]


@pytest.mark.parametrize("bits,g,block", [(4, 8, 16), (3, 8, 32), (3, 16, 24)])
def test_gptq_default_group_fit_equals_fasterquant(bits, g, block):
    """Groups smaller than the lazy block (two or four per block; at (16, 24) a group runs
    across a block's end): the default equals the written-out fasterquant bit for bit in
    float32 -- the same operations in the same order, so no float ties to set aside. The
    `updated` fit gives other codes here, so the test would fail on that rule."""
    w, _, h = layer_problem()
    codes, scales, zeros = fasterquant_reference(w, h, bits, g, block)
    ours = stored_as_reference(C.gptq(w, h, bits, g, block_size=block), w.shape, bits)
    assert torch.equal(ours[0], codes.to(ours[0].dtype))
    assert torch.equal(ours[1], scales.half()) and torch.equal(ours[2], zeros.to(torch.uint8))
    other = stored_as_reference(C.gptq(w, h, bits, g, block_size=block, group_fit="updated"),
                                w.shape, bits)
    assert not torch.equal(other[0], ours[0])


@pytest.mark.parametrize("bits,g,block", [(4, 8, 16), (3, 8, 32)])
def test_gptq_updated_group_fit_equals_fasterquant_with_one_group_per_block(bits, g, block):
    """`updated` = fasterquant with blocksize = groupsize (every group then starts a block,
    where W holds all the feedback so far). The lazy feedback is summed in another order,
    so in float32 the weights differ in the last bits; in float64 that is ~1e-16 and the
    stored codes, scales and zeros come out equal (a different one would need a weight
    within ~1e-16 of a rounding boundary: the float tie set aside)."""
    w, _, h = layer_problem(dtype=torch.float64)
    codes, scales, zeros = fasterquant_reference(w, h, bits, g, g)
    ours = stored_as_reference(C.gptq(w, h, bits, g, block_size=block, group_fit="updated"),
                               w.shape, bits)
    assert torch.equal(ours[0], codes.to(ours[0].dtype))
    assert torch.equal(ours[1], scales.half()) and torch.equal(ours[2], zeros.to(torch.uint8))


def test_gptq_layer_errors_are_the_objective():
    """gptq_transform's errors: E||(W - Ŵ)x||² from the Hessian's XᵀX, = the mean over the
    calibration tokens computed directly; GPTQ's below RTN's."""
    w, x, _ = layer_problem()
    stats = C.ActStats(w.shape[1])
    stats.add(x)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    errors = []
    layer = C.gptq_transform(4, 8, errors)("layer", lin, stats)
    direct = (x.double() @ (w - layer.dequantized()).double().t()).pow(2).sum(1).mean()
    assert math.isclose(errors[0][0], float(direct), rel_tol=1e-9)
    assert errors[0][0] < errors[0][1]


@pytest.mark.parametrize("bits,g", [(8, 0), (4, 8), (3, 16)])
def test_gptq_beats_round_to_nearest(bits, g):
    """||WX - ŴX||² below RTN's at the same bits and groups -- clearly (≤ 0.9×), so
    skipping the error compensation (which leaves exactly RTN) fails this test."""
    w, x, h = layer_problem()
    err = lambda stored: (x @ (w - quant_format.dequantize(stored, w.shape, bits, g)).t()
                          ).pow(2).sum()
    e_gptq = err(C.gptq(w, h, bits, g))
    e_rtn = err(quant_format.rtn(w, bits, g or w.shape[1]))
    assert e_gptq <= 0.9 * e_rtn


# ----------------------------------------------------------------------------------------
# AWQ and SmoothQuant

CONFIGS = {"gqa": {}, "mha": dict(n_kv_head=4), "moe": dict(n_expert=4, expert_top_k=2)}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("method", ["awq", "awq-linear", "smoothquant"])
def test_scaling_is_an_identity_before_quantization(method, cfg):
    model = tiny(**CONFIGS[cfg])
    calib = batches(model)
    scaled = copy.deepcopy(model)
    if method.startswith("awq"):        # llm-awq's module objective, or the per-linear one
        objective = "linear" if method == "awq-linear" else "module"
        infos = C.awq_scale(scaled, calib, 4, 16, n_grid=5, objective=objective, tokens=48)
    else:
        choose = lambda st, ws: (C.smooth_scales(st.abs_max, ws, 0.5), 0.5)
        infos = C.scale_model(scaled, calib, choose)
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


def llm_awq_round(w, bits, g):
    """llm-awq's pseudo_quantize_tensor (zero_point=True), one group of g inputs at a time:
    plain min/max of the group (0 need not be inside), an fp32 scale."""
    out, qmax = torch.empty_like(w), 2 ** bits - 1
    for c0 in range(0, w.shape[1], g):
        grp = w[:, c0:c0 + g]
        lo, hi = grp.min(1, keepdim=True).values, grp.max(1, keepdim=True).values
        scale = (hi - lo).clamp(min=1e-5) / qmax
        zero = (-torch.round(lo / scale)).clamp(0, qmax)
        out[:, c0:c0 + g] = (torch.clamp(torch.round(grp / scale) + zero, 0, qmax) - zero) * scale
    return out


def brute_force_alpha(run, linears, inputs, bits, g, n_grid=20):
    """llm-awq's _search_module_scale written out: for α = 0, 1/20, ..., 19/20, s = mean|x|^α
    (clamped at 1e-4, over every calibration token) / √(max s · min s); the module run with
    each linear's weight set to Q(W·s)/s; the α of least mean squared difference to the fp32
    output. run(weights) -> the module's output on `inputs` (a list of its input tensors)."""
    xs = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])
    # summed in float64, as ActStats does (llm-awq: in the model's dtype); ~1e-7 relative,
    # which moves no argmin here (the errors of neighbouring α differ by far more)
    mean_abs = (xs.double().abs().sum(0) / xs.shape[0]).float()
    ref = run([lin.weight for lin in linears])
    errors = []
    for i in range(n_grid):
        s = mean_abs.pow(i / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        out = run([llm_awq_round(lin.weight * s, bits, g) / s for lin in linears])
        errors.append((ref - out).pow(2).mean().item())
    return errors.index(min(errors)) / n_grid


@torch.no_grad()
def test_awq_alpha_is_the_brute_force_best_by_the_module_output():
    """Block 0 of a tiny GQA model, int3 g8: each group's α is the best of a brute-force
    search of llm-awq's objective -- q/k/v by the attention's output, gate/up by the MLP's,
    down by its own -- with llm-awq's quantizer. The per-linear objective picks other α for
    q/k/v and gate/up here, the stored format's quantizer another for down: the test would
    fail on either of this repo's earlier rules."""
    model = tiny(seed=2)
    calib = batches(model)
    alphas = C.awq_scale(copy.deepcopy(model), calib, 3, 8)
    linear = C.awq_scale(copy.deepcopy(model), calib, 3, 8, objective="linear")
    stored = C.awq_scale(copy.deepcopy(model), calib, 3, 8, quantizer="stored")
    block = model.layers[0]
    att, mlp = block.attention, block.feed_forward
    cos, sin = model.rope(torch.arange(calib[0].shape[1]))
    x_att = [block.attention_norm(model.tok_embeddings(idx)) for idx in calib]
    x_mlp = [block.ffn_norm(model.tok_embeddings(idx) + att(x, cos, sin))
             for idx, x in zip(calib, x_att)]
    x_down = [torch.nn.functional.silu(mlp.w1(x)) * mlp.w3(x) for x in x_mlp]

    def attention_with(ws):
        a = copy.deepcopy(att)
        a.wq.weight[:], a.wk.weight[:], a.wv.weight[:] = ws
        return torch.cat([a(x, cos, sin) for x in x_att])

    def mlp_with(ws):
        m = copy.deepcopy(mlp)
        m.w1.weight[:], m.w3.weight[:] = ws
        return torch.cat([m(x) for x in x_mlp])

    def down_with(ws):
        return torch.cat([x @ ws[0].t() for x in x_down])

    # block 0's groups in scale_groups' order: q/k/v, (no wv -> wo under GQA), gate/up, down
    want = [brute_force_alpha(attention_with, [att.wq, att.wk, att.wv], x_att, 3, 8),
            brute_force_alpha(mlp_with, [mlp.w1, mlp.w3], x_mlp, 3, 8),
            brute_force_alpha(down_with, [mlp.w2], x_down, 3, 8)]
    assert alphas[:3] == want
    assert linear[0] != want[0] and linear[1] != want[1] and stored[2] != want[2]


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
    assert prune.prune_model(model, calib, 0.5, "2:4", "wanda") == 2    # 2 blocks, 1 pass each
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
    # fp32; int8 rtn gptq awq; int4 and int3: rtn, gptq, gptq --gptq-group-fit updated,
    # gptq act-order, awq, awq by the earlier rule; smoothquant; QAT; pruning
    assert len(rows) == 1 + 3 + 6 + 6 + 1 + 1 + 2 * 3 + 5        # fp32 ... wanda + steps
    notes = [r["note"] for r in rows if r["method"] == "gptq"]
    assert sum("--gptq-group-fit updated" in n for n in notes) == 2
    assert all("layer err" in n for n in notes)
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
