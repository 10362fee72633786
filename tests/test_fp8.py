"""training/fp8.py: the fp8 matmuls against slow textbook versions (quantize, dequantize in
fp32, fp32 matmul), Float8Linear's output and gradients against autograd through a
fake-quantized reference, the block recipe's gain on outliers, delayed scaling's
saturation, the GPT conversion (keys, loss, gradients, one-line errors) and the bytes."""
import copy

import pytest
import torch
import torch.nn as nn

from core.errors import UserError
from model import GPT, get_config
from training import fp8
from training.fp8 import (E4M3, E5M2, Float8Linear, block_scaled_matmul, convert_to_fp8,
                          fp8_linear, matmul_bytes, quantize_tensorwise, quantize_tiles,
                          relative_error, scaled_matmul)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread

# fp32 sums of the same products in another order: a few ulps of the output's scale
RTOL, ATOL = 1e-5, 1e-6


def close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL * b.abs().max().item())


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------- textbook
# Written element by element from the definitions, independent of training/fp8.py's helpers.

def textbook_fake_quant(x, dtype, rows=None, cols=None):
    """quantize then dequantize in fp32: one scale per rows×cols tile (None: the tensor),
    scale = amax / fmax, q = clamp(x / scale, ±fmax) cast to fp8, back = q · scale."""
    fmax = torch.finfo(dtype).max
    rows, cols = rows or x.shape[0], cols or x.shape[1]
    out = torch.empty_like(x, dtype=torch.float32)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            tile = x[i:i + rows, j:j + cols].float()
            scale = tile.abs().max().clamp(min=1e-12) / fmax
            q = (tile / scale).clamp(-fmax, fmax).to(dtype)
            out[i:i + rows, j:j + cols] = q.float() * scale
    return out


class QuantizeGradient(torch.autograd.Function):
    """The identity; its backward quantize-dequantizes the output gradient (the gradient's
    format and tiling given by `fake`)."""

    @staticmethod
    def forward(ctx, y, fake):
        ctx.fake = fake
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return ctx.fake(g), None


def straight_through(x, fake):
    """fake(x) in the forward, the identity in the backward (straight-through)."""
    return x + (fake(x) - x).detach()


def reference(x, w, recipe, B, g):
    """Autograd through the textbook fake-quant linear -> (y, grad_x, grad_w). Tensorwise:
    e4m3 x and w, e5m2 gradient. Block: x in 1×B tiles, w in B×B blocks, the gradient in
    1×B tiles along N, all e4m3. Block grad_w is DeepSeek-V3's (§3.5.2): it contracts over
    the tokens, so g and the fp8 x are quantized (again) in tiles along the tokens; the
    straight-through graph cannot express that second quantization: spelt out below."""
    if recipe == "tensorwise":
        fx, fw = (lambda t: textbook_fake_quant(t, E4M3)), (lambda t: textbook_fake_quant(t, E4M3))
        fg = lambda t: textbook_fake_quant(t, E5M2)
    else:
        fx, fw = (lambda t: textbook_fake_quant(t, E4M3, 1, B)), \
            (lambda t: textbook_fake_quant(t, E4M3, B, B))
        fg = lambda t: textbook_fake_quant(t, E4M3, 1, B)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = QuantizeGradient.apply(straight_through(xr, fx) @ straight_through(wr, fw).T, fg)
    y.backward(g)
    grad_w = wr.grad
    if recipe == "block":
        pad = -x.shape[0] % B                       # tokens padded with zero rows to k·B
        gp = torch.cat([g, g.new_zeros(pad, g.shape[1])])
        xp = torch.cat([fx(x), x.new_zeros(pad, x.shape[1])])
        grad_w = textbook_fake_quant(gp.T, E4M3, 1, B) @ textbook_fake_quant(xp.T, E4M3, 1, B).T
    return y.detach(), xr.grad, grad_w


# ---------------------------------------------------------------------------- the formats

def test_formats_scale_to_fill_the_range_and_round_within_half_an_ulp():
    assert fp8.FP8_MAX[E4M3] == 448.0 and fp8.FP8_MAX[E5M2] == 57344.0
    x = randn(64, 48, scale=3.0)
    for dtype, mantissa_bits in ((E4M3, 3), (E5M2, 2)):
        q, scale = quantize_tensorwise(x, dtype)
        assert q.dtype == dtype and scale.item() == pytest.approx(x.abs().max().item() / fp8.FP8_MAX[dtype])
        back = q.float() * scale
        # the amax lands exactly on fmax: it comes back exactly
        assert back.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)
        # a normal number rounds to within half an ulp: 2^-(mantissa bits + 1) relative
        normal = (x / scale).abs() >= torch.finfo(dtype).smallest_normal
        rel = ((back - x).abs() / x.abs())[normal]
        assert rel.max().item() <= 2.0 ** -(mantissa_bits + 1) + 1e-6
        assert rel.mean().item() > 2.0 ** -(mantissa_bits + 4)     # it does round
        # past the range: saturated at ±fmax (an unclamped e5m2 cast would give inf)
        big = fp8.quantize(torch.tensor([1e6, -1e6]), torch.tensor(1.0), dtype).float()
        assert big.tolist() == [fp8.FP8_MAX[dtype], -fp8.FP8_MAX[dtype]]


# ---------------------------------------------------------------------------- the matmuls

def test_tensorwise_matmul_equals_textbook():
    """Both kernels -- torch._scaled_mm (fp8 products, scales applied to the fp32 result)
    and the textbook dequantize + fp32 matmul -- equal dq(x) @ dq(w)ᵀ, for the forward's
    e4m3 × e4m3 and the backward's e5m2 × e4m3, to fp32 rounding (rtol 1e-5)."""
    a, b = randn(40, 32, seed=1, scale=5.0), randn(24, 32, seed=2, scale=0.02)
    for dtype_a in (E4M3, E5M2):
        qa, sa = quantize_tensorwise(a, dtype_a)
        qb, sb = quantize_tensorwise(b, E4M3)
        want = textbook_fake_quant(a, dtype_a) @ textbook_fake_quant(b, E4M3).T
        for kernel in ("scaled_mm", "dequant", "auto"):
            close(scaled_matmul(qa, sa, qb, sb, kernel), want)


def test_block_matmul_equals_textbook():
    """Per-tile scales, fp32 promotion per K-chunk of B == per-tile fake quant + one fp32
    matmul (rtol 1e-5); each tile's amax comes back exactly (scale = tile amax / 448)."""
    B = 16
    x, w = randn(24, 64, seed=3), randn(48, 64, seed=4, scale=0.02)
    x[:, 5] *= 100                                             # tiles with their own ranges
    qx, sx = quantize_tiles(x, 1, B)
    qw, sw = quantize_tiles(w, B, B)
    assert sx.shape == (24, 4) and sw.shape == (3, 4)
    tile_amax = x.abs().reshape(24, 4, B).amax(-1)
    torch.testing.assert_close(sx * 448.0, tile_amax, rtol=1e-6, atol=0)
    want = textbook_fake_quant(x, E4M3, 1, B) @ textbook_fake_quant(w, E4M3, B, B).T
    close(block_scaled_matmul(qx, sx, qw, sw, B), want)


@pytest.mark.parametrize("recipe", ["tensorwise", "block"])
def test_float8_linear_output_and_grads_equal_fake_quant_autograd(recipe):
    """Float8Linear's y, grad_x, grad_w == autograd through the textbook fake-quant linear
    (rtol 1e-5). 3-D input (2, 12, 64): 24 tokens, not a multiple of B = 16 (the block
    recipe's token tiles are padded). The gradient lands on the nn.Linear's own Parameter."""
    B = 16
    linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(randn(48, 64, seed=5, scale=0.05))
    layer = Float8Linear.from_linear(linear, recipe, block=B)
    assert layer.weight is linear.weight
    x = randn(2, 12, 64, seed=6).requires_grad_()
    g = randn(2, 12, 48, seed=7)
    y = layer(x)
    y.backward(g)
    want_y, want_gx, want_gw = reference(x.detach().reshape(24, 64), linear.weight.detach(),
                                         recipe, B, g.reshape(24, 48))
    close(y.detach().reshape(24, 48), want_y)
    close(x.grad.reshape(24, 64), want_gx)
    close(linear.weight.grad, want_gw)
    # and fp8 is not fp32: the gradients differ from the exact ones by the quantization
    exact = x.detach().reshape(24, 64).T @ g.reshape(24, 48)
    assert relative_error(linear.weight.grad, exact.T) > 1e-3


def test_block_recipe_beats_tensorwise_on_outliers():
    """Normal input: both within ~4% (per-token relative error). Three "massive activation"
    tokens 1e5× the rest (Sun et al. 2024): a single scale pushes every other token into
    e4m3's subnormals (tensorwise ~40%), 1×B tiles give each token its own scale (block
    unchanged): assert block < half of tensorwise, and block still small."""
    w = randn(64, 128, seed=8, scale=0.02)
    x = randn(256, 128, seed=9)
    ref = x @ w.T
    normal = {r: relative_error(fp8_linear(x, w, r, 32), ref) for r in fp8.RECIPES}
    assert max(normal.values()) < 0.06
    x[[5, 100, 200]] *= 1e5
    ref = x @ w.T
    outlier = {r: relative_error(fp8_linear(x, w, r, 32), ref) for r in fp8.RECIPES}
    assert outlier["block"] < 0.5 * outlier["tensorwise"]
    assert outlier["block"] < 0.06 and outlier["tensorwise"] > 0.15


# ---------------------------------------------------------------------------- delayed scaling

def test_delayed_scaling_saturates_when_the_tensor_outgrows_its_history():
    """Step 1 (empty history): the current amax, nothing clipped. Step 2, the input 10×
    larger: delayed scales with step 1's amax, so the largest values clip at ±fmax
    (dequantized max = the old amax) and the output error jumps; dynamic clips nothing.
    The history holds the newest amax first; it is not in the state_dict."""
    linear = nn.Linear(32, 16, bias=False)
    delayed = Float8Linear.from_linear(linear, scaling="delayed", history=4)
    dynamic = Float8Linear.from_linear(linear, scaling="dynamic")
    assert set(delayed.state_dict()) == {"weight"}
    x1 = randn(8, 32, seed=10)
    a1 = x1.abs().max()
    delayed(x1).sum().backward()
    assert delayed.amax_history[0, 0] == a1 and delayed.amax_history[0, 1:].eq(0).all()
    assert delayed.amax_history[2, 0] > 0                    # the gradient's history too
    x2 = x1 * 10
    used = delayed.amax_for("x", x2)
    assert used == a1                                        # the scale came from history
    assert delayed.amax_history[0, :2].tolist() == [x2.abs().max().item(), a1.item()]
    # clipped: the values past the scale's range, |x| / scale > 448, stored as ±448
    q, scale = quantize_tensorwise(x2, E4M3, used)
    clipped = x2.abs() / scale > 448.0
    assert clipped.float().mean() > 0.2 and q.float()[clipped].abs().eq(448.0).all()
    assert (q.float() * scale).abs().max() == pytest.approx(a1.item())
    q, scale = quantize_tensorwise(x2, E4M3, dynamic.amax_for("x", x2))
    assert not (x2.abs() / scale > 448.0).any()
    assert (q.float() * scale).abs().max() == pytest.approx(x2.abs().max().item())
    ref = x2 @ linear.weight.detach().T
    delayed.amax_history[0].copy_(torch.tensor([a1, 0, 0, 0]))     # back to after step 1
    assert relative_error(delayed(x2).detach(), ref) > 0.2
    assert relative_error(dynamic(x2).detach(), ref) < 0.06
    # evaluation reads the history but does not move it
    before = delayed.amax_history.clone()
    delayed.eval()(x2)
    assert torch.equal(delayed.amax_history, before)


# ---------------------------------------------------------------------------- the GPT

def tiny_batch(model):
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    return idx, torch.roll(idx, -1, 1)


@pytest.mark.parametrize("recipe,block", [("tensorwise", 128), ("block", 16)])
def test_convert_tiny_gpt(recipe, block):
    """Exactly the 14 linears of the 2 blocks become Float8Linear (sharing their
    Parameters); the embedding, head and norms stay; state_dict keys are identical; the
    loss is within 2% of fp32's; every gradient is finite."""
    model = GPT(get_config("tiny"), seed=0)
    plain = copy.deepcopy(model)
    params = dict(model.named_parameters())
    expected = [n for n, m in plain.named_modules()
                if isinstance(m, nn.Linear) and n.startswith("layers.")]
    names = convert_to_fp8(model, recipe, block=block)
    assert names == expected and len(names) == 14
    for name, module in model.named_modules():
        assert isinstance(module, Float8Linear) == (name in names)
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    assert type(model.layers[0].attention_norm) is type(plain.layers[0].attention_norm)
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())          # a plain checkpoint loads, strict
    assert all(p is params[n] for n, p in model.named_parameters())
    idx, targets = tiny_batch(model)
    _, loss = model(idx, targets)
    _, want = plain(idx, targets)
    assert abs(loss.item() - want.item()) / want.item() < 0.02
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_convert_moe_converts_the_experts_not_the_router():
    """A mixture of experts (core/moe.py): every expert's w1/w2/w3 and the shared expert
    become fp8; the router (a Parameter read by F.linear) keeps its precision; an expert
    no token reaches (an empty batch) costs nothing and breaks nothing."""
    model = GPT(get_config("tiny", n_expert=4, n_shared_expert=1, ffn_hidden=32), seed=0)
    names = convert_to_fp8(model, "block", block=16)
    assert len(names) == 2 * (4 + 5 * 3) and "layers.0.feed_forward.experts.3.w2" in names
    assert "layers.0.feed_forward.shared_experts.w1" in names
    assert not any("router" in n for n in names)
    idx, targets = tiny_batch(model)
    _, loss = model(idx, targets)
    loss.backward()
    assert torch.isfinite(model.layers[0].feed_forward.experts[0].w1.weight.grad).all()
    empty = model.layers[0].feed_forward.experts[0](torch.zeros(0, 32))
    assert empty.shape == (0, 32)


def test_conversion_errors_are_one_line():
    model = GPT(get_config("tiny"), seed=0)
    with pytest.raises(UserError) as err:
        convert_to_fp8(model, "block", block=128)
    msg = str(err.value)
    assert "\n" not in msg and "layers.0.attention.wq" in msg and "128" in msg
    assert "--fp8-block 16" in msg                        # tiny's widths: 32, 16, 96
    assert not any(isinstance(m, Float8Linear) for m in model.modules())   # left as it was
    for kwargs in (dict(recipe="int8"), dict(scaling="lazy"),
                   dict(recipe="block", scaling="delayed", block=16)):
        with pytest.raises(UserError) as err:
            convert_to_fp8(model, **kwargs)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- bytes, dtypes

def test_bytes_equal_the_formula_and_what_autograd_saves():
    """fp8-block: a 128×128 weight is 1 B + one 4 B scale (1 + 4/128²), a 1×128 activation
    tile 1 B/element + 4 B (1 + 4/128); tensorwise one scale per tensor; bf16 2. And the
    tensors a block Float8Linear saves for backward weigh exactly that."""
    b = matmul_bytes("fp8-block", (128, 128), (256, 128), block=128)
    assert (b.weight, b.activation) == (1 + 4 / 128 ** 2, 1 + 4 / 128)
    t = matmul_bytes("fp8-tensorwise", (128, 128), (256, 128))
    assert (t.weight, t.activation) == (1 + 4 / (128 * 128), 1 + 4 / (256 * 128))
    assert (matmul_bytes("bf16").weight, matmul_bytes("bf16").activation) == (2.0, 2.0)
    with pytest.raises(UserError):
        matmul_bytes("fp4")
    layer = Float8Linear.from_linear(nn.Linear(64, 32, bias=False), "block", block=16)
    saved = []
    x = randn(48, 64).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    got = sum(s.numel() * s.element_size() for s in saved)
    b = matmul_bytes("fp8-block", (32, 64), (48, 64), block=16)
    assert got == b.weight * 32 * 64 + b.activation * 48 * 64


def test_autocast_returns_bf16_with_the_fp32_result():
    """Under autocast-bf16 the fp8 matmul keeps its own fp32 accumulation (autocast would
    otherwise redo it in bf16): the output is the fp32-mode output rounded to bf16."""
    layer = Float8Linear.from_linear(nn.Linear(32, 16, bias=False))
    x = randn(4, 8, 32, seed=11)
    want = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_main_prints_the_tables(capsys):
    fp8.main(["--tokens", "64", "--in-features", "64", "--out-features", "64", "--block", "32",
              "--repeats", "1", "--scaled-mm-tokens", "4"])
    out = capsys.readouterr().out
    for row in ("tokens x1e5", "fp8 block", "torch._scaled_mm", "fp8-block", "H100"):
        assert row in out
    with pytest.raises(UserError):
        fp8.main(["--block", "100"])
