"""
training/fp8.py -- FP8 training of the linear layers, written by hand: the two 8-bit float
formats, how a scale fits a tensor into them, and the two recipes large runs use.

    python -m training.fp8            # error vs fp32, CPU time and bytes of both recipes

What it teaches
- The formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"):
    float8_e4m3fn  4 exponent bits, 3 mantissa bits, max 448 (no inf: "fn" = finite + NaN);
    float8_e5m2    5 exponent bits, 2 mantissa bits, max 57,344 (fp16's range, fewer bits).
  A number is stored as q = round(x / scale), the scale chosen so the tensor fills the
  format: scale = amax / fmax, quantize = clamp(x / scale, -fmax, fmax).to(fp8). The clamp
  makes saturation explicit: without it an e5m2 overflow is inf, and e4m3fn (no inf) is
  NaN or 448 depending on the cast (torch's CPU cast saturates; the OCP spec allows both).
  They are FLOATS: the relative rounding error is ~2^-4 (e4m3) or ~2^-3 (e5m2) for every
  value between fmax and the smallest normal (2^-6 · scale for e4m3: a dynamic range of
  448 / 2^-6 ≈ 2.9e4). A ×100 outlier, which ruins an int8 scale (range 127), costs a
  float8 scale almost nothing; only outliers ~1e4× the bulk push the bulk into the
  subnormals, where precision runs out (the table of `main` shows both).
- Tensorwise recipe (torchtitan's float8, nanochat's fp8; Micikevicius et al. 2022): one
  fp32 scale per tensor; e4m3 for weights and activations in the forward, e5m2 (more
  range, less precision) for the output gradient in the backward. The Parameter stays
  fp32 (the master weights); it is quantized again on every forward.
- DeepSeek-V3's fine-grained recipe (DeepSeek-V3 technical report, §3.3): activations get
  one scale per 1×B tile (a token, B channels), weights one per B×B block, e4m3 for all
  tensors (the gradients too: small tiles give each its own range, so e5m2 is not needed),
  and the product is accumulated in fp32 one K-chunk of B at a time, the chunks summed in
  fp32 ("promotion to CUDA cores" every N_C = 128 elements: an H800's fp8 tensor cores keep
  only ~14 bits while accumulating, ~2% error at K = 4096 without it). B = 128 in V3; here
  an argument (the demo model is 192 wide with 64-wide K/V projections: B = 64).
- Delayed vs dynamic scaling (`scaling=`): dynamic reads the amax of the tensor being
  quantized (an extra pass over it, exact); delayed (Transformer Engine; Micikevicius et
  al. 2022) uses the max of the amaxes of the previous H steps, so the scale is known
  before the tensor is (no extra pass, no wait on a GPU), at the price of saturation when
  a tensor grows faster than its history remembers.

What stays in high precision, and why (as torchtitan and DeepSeek-V3 §3.3 keep them):
only the nn.Linear modules inside `model.layers` are converted (attention wq/wk/wv/wo or
MLA's projections, the MLP's w1/w2/w3, every MoE expert). The embedding `tok_embeddings`
(a lookup: no matmul to speed up), the output head `output` and `extra_heads` (the logits
feed a softmax over the vocabulary: precision-sensitive), the RMSNorms, the MoE router
(core/moe.py; a Parameter, not an nn.Linear: routing flips on small errors) and the
attention math itself stay as they are: they are cheap next to the blocks' matmuls. MLA's
absorbed inference path reads wkv_b.weight directly (core/mla.py): the fp32 master, not
fp8 -- the seam is the `.weight` name Float8Linear keeps.

What it costs (measured by `main`; formulas in `matmul_bytes`)
- saves: on a GPU with fp8 tensor cores, matmul time (H100: fp8 dense ~1,979 TFLOPS, 2×
  bf16's 989; end to end less, since the quantize passes are memory-bound: torchtitan
  reports +28% tok/s on Llama 3.1 8B, 8×H100; nanochat ~1.17×), and the activations saved
  for backward: 1 B/element + the scales instead of 2 (bf16) or 4 (fp32).
- adds: a pass over every tensor to find its amax (dynamic) and to cast it; the fp8 copy
  of each weight (1 B/parameter) kept from forward to backward; scales (4 B per tensor, or
  per B×B block and per 1×B tile: 4/B B per activation element); the fp32 master weights,
  their gradients and the optimizer state are unchanged (4 + 4 + 8 B/parameter with Adam).
  On this CPU there are no fp8 units: the fp8 path is slower than fp32, not faster, and
  torch._scaled_mm's CPU kernel is a reference loop (900-2,700× slower in our runs).
- sacrifices: precision: ~3.7% relative error per matmul output on a normal input at the
  demo's shapes (bf16 operands: 0.23%), ~6% for the tensorwise gradients (e5m2); V3
  reports a training loss within 0.25% of bf16's; tensorwise loses more to outliers.
"""
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.cli import command_line, knob, require_at_least_one
from core.errors import UserError
from core.runtime import TimingConditions, run_cli


# ----------------------------------------------------------------------------------------
# Formats and scales

E4M3 = torch.float8_e4m3fn      # weights and activations (and, in the block recipe, grads)
E5M2 = torch.float8_e5m2        # the output gradient in the tensorwise recipe
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}   # 448.0, 57344.0
AMAX_EPS = 1e-12                # an all-zero tensor gets a tiny scale, not a 0/0 NaN
RECIPES = ("tensorwise", "block")
SCALINGS = ("dynamic", "delayed")
ROLES = ("x", "w", "g")         # the three tensors a linear quantizes: input, weight, grad


def fp8_scale(amax, dtype):
    """scale = amax / fmax: the largest |value| lands exactly on the format's largest
    number, so the whole range (and all the precision near the top) is used."""
    return amax.float().clamp(min=AMAX_EPS) / FP8_MAX[dtype]


def quantize(x, scale, dtype):
    """x / scale, clamped to ±fmax (so an overflow saturates on every device instead of
    becoming inf or NaN), rounded to the nearest fp8 number (ties to even) by the cast.
    `scale` broadcasts (a scalar, or one per tile)."""
    fmax = FP8_MAX[dtype]
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize(q, scale):
    """The fp32 number an fp8 value stands for: q · scale."""
    return q.float() * scale


def no_autocast(t):
    """Our matmuls decide their own precision (fp8 operands, fp32 accumulation): under
    train.py's --precision autocast-bf16 the fp32 products below would otherwise be
    silently redone in bf16."""
    return torch.autocast(t.device.type, enabled=False)


def output_dtype(x):
    """What an nn.Linear would return for x: autocast's dtype under autocast, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


# ----------------------------------------------------------------------------------------
# Tensorwise: one scale per tensor, and the fp8 matmul

def current_amax(role, tensor):
    """Dynamic scaling: the amax of the tensor itself (the `amax_for` of a plain call;
    Float8Linear.amax_for adds the delayed option). `role` ("x", "w", "g") is unused here."""
    return tensor.detach().abs().amax().float()


def quantize_tensorwise(x, dtype, amax=None):
    """-> (q, scale): x in fp8 with ONE fp32 scale. amax: the one to scale with (delayed
    scaling passes its history's); None: the tensor's own."""
    amax = current_amax("x", x) if amax is None else amax
    scale = fp8_scale(amax, dtype)
    return quantize(x, scale, dtype), scale


def scaled_mm_fits(qa, qb):
    """Whether torch._scaled_mm takes these operands. On CUDA (H100's cuBLASLt fp8 GEMM):
    both inner dimensions multiples of 16 and not both e5m2; the layouts (A row-major, B
    column-major: both K-major) are made by `scaled_matmul`. On CPU it takes anything, but
    its kernel is a scalar reference loop (thousands of times slower than the fp32 matmul
    of the same dequantized numbers; `main` measures it), so CPU runs use the textbook
    path, which gives the same numbers (tests/test_fp8.py checks both)."""
    if qa.dtype == E5M2 and qb.dtype == E5M2:
        return False
    if qa.device.type == "cuda":
        return qa.shape[1] % 16 == 0 and qb.shape[0] % 16 == 0
    return qa.device.type == "cpu"


def scaled_matmul(qa, sa, qb, sb, kernel="auto"):
    """dequant(qa) @ dequant(qb).T for tensorwise scales, in fp32. qa (M, K), qb (N, K):
    both operands K-major ("NT"), the only layout fp8 tensor cores accept -- so the
    backward's transposed operands are materialized copies (DeepSeek-V3 §3.5.2 asks the
    hardware for transposed fp8 GEMMs for this reason).
    kernel: "scaled_mm" (torch._scaled_mm: fp8 products, fp32 accumulation, the scales
    applied to the result), "dequant" (the textbook path: fp8 -> fp32, fp32 matmul; the
    same numbers up to summation order), "auto": _scaled_mm on a GPU where it fits, the
    textbook path otherwise (on CPU, see scaled_mm_fits)."""
    if kernel == "auto":
        kernel = "scaled_mm" if qa.is_cuda and scaled_mm_fits(qa, qb) else "dequant"
    if kernel == "scaled_mm":
        # scale_a/scale_b are DEquantization scales (amax / fmax), multiplied into the
        # fp32 result: sa·sb·(qa @ qb.T). qb.T of a row-major qb is column-major.
        return torch._scaled_mm(qa.contiguous(), qb.contiguous().T, scale_a=sa, scale_b=sb,
                                out_dtype=torch.float32)
    return (qa.float() @ qb.float().T) * (sa * sb)


def delayed_amax(history, current, record=True):
    """Delayed scaling (Transformer Engine's "max" algorithm): the amax to scale with is
    the max over the previous H steps' amaxes (`history`, newest first, zeros = not seen
    yet), known before this tensor is; the first time (empty history) the current amax.
    Then the current amax is pushed in (record=False: evaluation reads, never writes).
    A tensor that grows past the history's max is clipped at ±fmax until the history
    catches up: that saturation is the price of not reading the tensor first."""
    past = history.max()
    amax = torch.where(past > 0, past, current)     # torch.where: no host sync on a GPU
    if record:
        history.copy_(history.roll(1))
        history[0] = current
    return amax


# ----------------------------------------------------------------------------------------
# Fine-grained (DeepSeek-V3): a scale per 1×B tile or B×B block, fp32 per K-chunk

def quantize_tiles(x, rows, cols, dtype=E4M3):
    """-> (q (R, C) fp8, scale (R/rows, C/cols) fp32): one scale per rows×cols tile.
    Activations: rows=1, cols=B (per token, per B channels); weights: B×B blocks."""
    R, C = x.shape
    if R % rows or C % cols:
        raise ValueError(f"a {R}x{C} tensor does not split into {rows}x{cols} tiles")
    tiles = x.float().reshape(R // rows, rows, C // cols, cols)
    scale = fp8_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), dtype)
    q = quantize(tiles, scale, dtype).reshape(R, C)
    return q, scale.reshape(R // rows, C // cols)


def dequantize_tiles(q, scale):
    """The fp32 tensor q stands for: each element times its tile's scale."""
    rows, cols = q.shape[0] // scale.shape[0], q.shape[1] // scale.shape[1]
    return dequantize(q, scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1))


def block_scaled_matmul(qa, sa, qb, sb, block):
    """dequant(qa) @ dequant(qb).T with per-tile scales, K-chunk by K-chunk. qa (M, K) with
    sa (M/ra, K/B), qb (N, K) with sb (N/rb, K/B): every tile spans ONE K-chunk of B, so
    within a chunk each output element has ONE scale pair and the chunk's product can be
    computed on raw fp8 values and scaled afterwards -- what DeepGEMM does on tensor cores.
    Each chunk's partial sum is then scaled and added into an fp32 accumulator: V3's
    "promotion to CUDA cores every N_C = 128 elements of K", the fix for the tensor cores'
    ~14-bit accumulator. On CPU the chunk's product itself is an fp32 matmul of the fp8
    values (exact products, fp32 sums): CPU fp32 accumulation cannot show the tensor-core
    accumulation error, only the quantization error. On a GPU this loop runs as plain
    fp32 matmuls too: the fused kernel that does it on fp8 tensor cores is DeepGEMM's."""
    M, K = qa.shape
    N = qb.shape[0]
    sa_rows = sa.repeat_interleave(M // sa.shape[0], 0)     # (M, K/B): each row's scales
    sb_rows = sb.repeat_interleave(N // sb.shape[0], 0)     # (N, K/B)
    a, b = qa.float(), qb.float()        # fp8 -> fp32 is exact: once, not once per chunk
    out = torch.zeros(M, N, dtype=torch.float32, device=qa.device)
    for c in range(K // block):
        ks = slice(c * block, (c + 1) * block)
        partial = a[:, ks] @ b[:, ks].T                                # the tensor-core part
        out.addcmul_(partial, sa_rows[:, c:c + 1] * sb_rows[:, c][None])   # promoted, scaled
    return out


def pad_rows(t, multiple):
    """Zero rows up to a multiple (a zero row changes no tile's amax and adds nothing to a
    product): the token count M need not be a multiple of B."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % multiple))


# ----------------------------------------------------------------------------------------
# The two autograd Functions: y = x @ wᵀ with fp8 operands, x (M, K), w (N, K)

class TensorwiseFP8Matmul(torch.autograd.Function):
    """Forward: e4m3 x and w, one scale each. Saved for backward: the fp8 tensors and
    their scales (1 B/element, not 4). Backward: the output gradient in e5m2 (gradients
    span more range than they need precision), then
        grad_x = dq(g) @ dq(w),   grad_w = dq(g)ᵀ @ dq(x),
    both through the same fp8 matmul. amax_for(role, tensor) -> the amax to scale with
    (current_amax, or a Float8Linear's delayed history)."""

    @staticmethod
    def forward(ctx, x, weight, amax_for):
        with no_autocast(x):
            qx, sx = quantize_tensorwise(x, E4M3, amax_for("x", x))
            qw, sw = quantize_tensorwise(weight, E4M3, amax_for("w", weight))
            y = scaled_matmul(qx, sx, qw, sw)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.amax_for, ctx.dtypes = amax_for, (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        qx, sx, qw, sw = ctx.saved_tensors
        with no_autocast(grad_out):
            g = grad_out.float()
            qg, sg = quantize_tensorwise(g, E5M2, ctx.amax_for("g", g))
            # NT form A @ Bᵀ: grad_x = g @ w has B = wᵀ (K, N); grad_w = gᵀ @ x has B = xᵀ
            grad_x = scaled_matmul(qg, sg, qw.T, sw)
            grad_w = scaled_matmul(qg.T, sg, qx.T, sx)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


class BlockFP8Matmul(torch.autograd.Function):
    """DeepSeek-V3's recipe. Forward: x in 1×B tiles, w in B×B blocks, e4m3. Saved: the
    fp8 x and w with their scales. Backward, e4m3 for the gradient too:
      grad_x = g @ w (contracts over N): g in 1×B tiles along N; w's B×B blocks transposed
        are still B×B blocks -- why V3 chose square blocks: no re-quantization;
      grad_w = gᵀ @ x (contracts over the M tokens): both operands need tiles along M
        (V3's 128×1 tiles), so g is quantized a second time that way, and x is read back
        from fp8, dequantized, transposed and re-quantized (V3 §3.5.2 describes exactly
        this round trip). M is zero-padded to a multiple of B."""

    @staticmethod
    def forward(ctx, x, weight, block):
        with no_autocast(x):
            qx, sx = quantize_tiles(x, 1, block)
            qw, sw = quantize_tiles(weight, block, block)
            y = block_scaled_matmul(qx, sx, qw, sw, block)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.block, ctx.dtypes = block, (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        qx, sx, qw, sw = ctx.saved_tensors
        B = ctx.block
        with no_autocast(grad_out):
            g = grad_out.float()
            qg, sg = quantize_tiles(g, 1, B)                          # per token, per B of N
            grad_x = block_scaled_matmul(qg, sg, qw.T, sw.T, B)
            g_t, sg_t = quantize_tiles(pad_rows(g, B).T, 1, B)        # per channel, B tokens
            x_t = pad_rows(dequantize_tiles(qx, sx), B).T             # fp8 -> fp32, (K, M)
            qx_t, sx_t = quantize_tiles(x_t, 1, B)                    # re-quantized along M
            grad_w = block_scaled_matmul(g_t, sg_t, qx_t, sx_t, B)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


def fp8_linear(x, weight, recipe="tensorwise", block=128, amax_for=current_amax):
    """y = x @ weightᵀ through the recipe's fp8 Function. x: (..., K), e.g. (B, T, C):
    flattened to (M, K) tokens × channels, the matmul's shape, and back."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:       # an expert no token was routed to (expert parallelism)
        y = x2.float() @ weight.float().T        # empty: nothing to scale (amax of nothing)
    elif recipe == "block":
        y = BlockFP8Matmul.apply(x2, weight, block)
    else:
        y = TensorwiseFP8Matmul.apply(x2, weight, amax_for)
    return y.to(output_dtype(x)).reshape(*lead, weight.shape[0])


# ----------------------------------------------------------------------------------------
# The module and the model conversion

def check_options(recipe, scaling, block):
    """One UserError line for a recipe/scaling/block the module cannot run."""
    if recipe not in RECIPES:
        raise UserError(f"unknown fp8 recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    if scaling not in SCALINGS:
        raise UserError(f"unknown fp8 scaling {scaling!r}: choose one of {', '.join(SCALINGS)}")
    if recipe == "block" and scaling == "delayed":
        # V3 computes each tile's scale online from the tile itself; a history per tile
        # (thousands of them) would be state larger than the scales, for tiles whose amax
        # swings far more step to step than a whole tensor's.
        raise UserError("fp8 block recipe uses dynamic per-tile scales (as DeepSeek-V3); "
                        "delayed scaling is for the tensorwise recipe")
    if int(block) != block or block < 1:
        raise UserError(f"fp8 block must be a positive integer, got {block}")


class Float8Linear(nn.Module):
    """A bias-free (or biased) linear whose matmuls run in fp8. `weight` is the SAME
    Parameter the nn.Linear had (fp32 master, same name and shape), so state_dict keys,
    optimizers and data-parallel wrappers see what they saw before. The delayed-scaling
    amax history (rows x, w, g; H columns, newest first) is a NON-persistent buffer: a
    checkpoint keeps exactly the plain GPT's keys, and a resume restarts the history (the
    first step after it scales with the current amax)."""

    def __init__(self, weight, bias=None, recipe="tensorwise", scaling="dynamic",
                 block=128, history=16):
        super().__init__()
        check_options(recipe, scaling, block)
        if recipe == "block" and (weight.shape[0] % block or weight.shape[1] % block):
            raise UserError(f"fp8 block {block} does not divide the linear's "
                            f"{weight.shape[0]}x{weight.shape[1]} weight")
        if history < 1:
            raise UserError(f"fp8 amax history must hold at least 1 step, got {history}")
        self.weight, self.bias = weight, bias      # Parameters, not copies
        self.recipe, self.scaling, self.block = recipe, scaling, int(block)
        self.register_buffer("amax_history",
                             torch.zeros(len(ROLES), history, device=weight.device),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear, recipe="tensorwise", scaling="dynamic", block=128,
                    history=16):
        return cls(linear.weight, linear.bias, recipe, scaling, block, history)

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def amax_for(self, role, tensor):
        """The amax to scale `tensor` (role "x", "w" or "g") with. Delayed: the history's
        max, pushed only in training mode (an evaluation pass must not move the scales).
        Activation checkpointing replays the forward, so it pushes x and w twice a step;
        gradient accumulation pushes once per micro-batch: H counts calls, not steps."""
        current = tensor.detach().abs().amax().float()
        if self.scaling == "dynamic":
            return current
        row = self.amax_history[ROLES.index(role)]
        return delayed_amax(row, current, record=self.training)

    def forward(self, x):
        y = fp8_linear(x, self.weight, self.recipe, self.block, self.amax_for)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"recipe={self.recipe}, scaling={self.scaling}, block={self.block}")


def layer_linears(model):
    """[(name, parent, attribute, module)] of every nn.Linear inside model.layers -- the
    only ones converted (the header says why the embedding, heads and norms are not)."""
    if not hasattr(model, "layers"):
        raise UserError("fp8 conversion expects a GPT (model.layers holds the blocks)")
    found = []
    for parent_name, parent in model.layers.named_modules(prefix="layers"):
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((f"{parent_name}.{attr}", parent, attr, child))
    return found


def largest_block_dividing(widths, cap=128):
    """The largest power of two <= cap dividing every width: the block to suggest."""
    b = cap
    while b > 1 and any(w % b for w in widths):
        b //= 2
    return b


def default_block(model, cap=128):
    """The block recipe's tile when none is asked for: V3's 128, or the largest power of two
    below it dividing every converted linear's width (the demo model: 64)."""
    return largest_block_dividing([w for *_, m in layer_linears(model)
                                   for w in (m.in_features, m.out_features)], cap)


def convert_to_fp8(model, recipe="tensorwise", scaling="dynamic", block=128, history=16):
    """Swap every nn.Linear inside model.layers for a Float8Linear sharing its Parameters,
    in place. -> the converted names. For the block recipe every converted layer's
    in_features and out_features must be multiples of `block` (tiles must not straddle a
    matrix edge); all are checked before anything is swapped, so an error leaves the
    model as it was."""
    check_options(recipe, scaling, block)
    linears = layer_linears(model)
    if recipe == "block":
        widths = [w for *_, m in linears for w in (m.in_features, m.out_features)]
        for name, _, _, m in linears:
            for what, width in (("in_features", m.in_features),
                                ("out_features", m.out_features)):
                if width % block:
                    raise UserError(
                        f"fp8 block recipe: {name} has {what} {width}, not a multiple of "
                        f"the block {block}; pick a block dividing every linear's width "
                        f"(e.g. --fp8-block {largest_block_dividing(widths)})")
    for name, parent, attr, m in linears:
        setattr(parent, attr, Float8Linear.from_linear(m, recipe, scaling, block, history))
    return [name for name, *_ in linears]


# ----------------------------------------------------------------------------------------
# Bytes: what the matmuls read and what they keep for the backward

@dataclass(frozen=True)
class MatmulBytes:
    """Bytes per element of the operands a linear's matmuls read and autograd keeps for
    the backward: `weight` per parameter of the weight operand (fp32: the master itself,
    no copy; bf16 autocast and fp8: a copy made each forward, kept until the backward),
    `activation` per element of the saved input. Not changed by any of them: the fp32
    master weights (4 B), their gradients (4 B) and the optimizer state (Adam: 8 B) per
    parameter -- fp8 saves activation memory and matmul time, not model-state memory."""
    precision: str
    weight: float
    activation: float


def matmul_bytes(precision, weight_shape=(128, 128), activation_shape=(1024, 128), block=128):
    """precision: "fp32", "bf16", "fp8-tensorwise" or "fp8-block".
    bf16: 2 and 2. fp8-tensorwise: 1 B + one 4 B scale per tensor (weight 1 + 4/(N·K),
    activation 1 + 4/(M·K)). fp8-block: 1 B + a 4 B scale per B×B weight block (1 + 4/B²)
    and per 1×B activation tile (1 + 4/B)."""
    (n, k), (m, k_act) = weight_shape, activation_shape
    if precision == "fp32":
        return MatmulBytes(precision, 4.0, 4.0)
    if precision == "bf16":
        return MatmulBytes(precision, 2.0, 2.0)
    if precision == "fp8-tensorwise":
        return MatmulBytes(precision, 1 + 4 / (n * k), 1 + 4 / (m * k_act))
    if precision == "fp8-block":
        if n % block or k % block or k_act % block:
            raise UserError(f"fp8 block {block} does not divide the shapes {weight_shape}, "
                            f"{activation_shape}")
        return MatmulBytes(precision, 1 + 4 / block ** 2, 1 + 4 / block)
    raise UserError(f"unknown precision {precision!r}: fp32, bf16, fp8-tensorwise, fp8-block")


# ----------------------------------------------------------------------------------------
# `python -m training.fp8`: error, time and bytes at the demo model's shapes

def relative_error(y, ref):
    """Mean over rows (tokens) of |y_i - ref_i| / |ref_i|: each token's output is what the
    next RMSNorm rescales, so every token's error counts, not just the largest tokens'."""
    return ((y - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-30)).mean().item()


def make_input(kind, tokens, width, gen):
    """normal: N(0, 1). channels×100: 4 channels 100× (the outlier channels of LLM
    activations, Dettmers et al. 2022). tokens×1e4 / ×1e5: 3 tokens that large (the
    "massive activations" of a few tokens, Sun et al. 2024: ~1e4× the median)."""
    x = torch.randn(tokens, width, generator=gen)
    if kind == "channels x100":
        x[:, torch.arange(4) * (width // 4) + 3] *= 100
    elif kind.startswith("tokens x"):
        x[torch.tensor([5, tokens // 2, tokens - 7]) % tokens] *= float(kind.split("x")[1])
    return x


def error_table(args, gen):
    """Output error of both recipes vs fp32 per input kind, and the gradients' on the
    normal input (e5m2 vs e4m3-in-tiles)."""
    w = torch.randn(args.out_features, args.in_features, generator=gen) * 0.02
    print(f"relative error vs fp32 (mean over tokens), {args.tokens} tokens, "
          f"{args.in_features} -> {args.out_features}, block {args.block}")
    print(f"  {'input':<16} {'tensorwise':>11} {'block':>8}")
    for kind in ("normal", "channels x100", "tokens x1e4", "tokens x1e5"):
        x = make_input(kind, args.tokens, args.in_features, gen)
        ref = x @ w.T
        errs = [relative_error(fp8_linear(x, w, r, args.block), ref) for r in RECIPES]
        print(f"  {kind:<16} {errs[0]:>10.2%} {errs[1]:>8.2%}")
    x = make_input("normal", args.tokens, args.in_features, gen)
    g = torch.randn(args.tokens, args.out_features, generator=gen)
    grads = {}
    for recipe in (None,) + RECIPES:
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = xr @ wr.T if recipe is None else fp8_linear(xr, wr, recipe, args.block)
        y.backward(g)
        grads[recipe] = (xr.grad, wr.grad)
    line = "  ".join(f"{r}: grad_x {relative_error(grads[r][0], grads[None][0]):.2%}, "
                     f"grad_w {relative_error(grads[r][1], grads[None][1]):.2%}"
                     for r in RECIPES)
    print(f"  gradients (normal input): {line}  (tensorwise: e5m2, 2 mantissa bits)")


def median_seconds(fn, repeats):
    """[seconds of each of `repeats` calls of fn] after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def timing_table(args, gen):
    """CPU time of one forward+backward of the fp32 nn.Linear and of each fp8 recipe, in
    the same run, and of torch._scaled_mm's CPU kernel vs the textbook path."""
    base = nn.Linear(args.in_features, args.out_features, bias=False)
    layers = {"fp32 nn.Linear": base}
    for recipe in RECIPES:
        layers[f"fp8 {recipe}"] = Float8Linear.from_linear(copy.deepcopy(base), recipe,
                                                           block=args.block)
    x = torch.randn(args.tokens, args.in_features, generator=gen, requires_grad=True)
    g = torch.randn(args.tokens, args.out_features, generator=gen)
    repeats = {}
    with TimingConditions() as conditions:
        for label, layer in layers.items():
            repeats[label] = median_seconds(lambda: layer(x).backward(g), args.repeats)
        m = args.scaled_mm_tokens
        qa, sa = quantize_tensorwise(x.detach()[:m], E4M3)
        qb, sb = quantize_tensorwise(base.weight.detach(), E4M3)
        for kernel in ("dequant", "scaled_mm"):
            repeats[f"{kernel} {m} tokens"] = median_seconds(
                lambda: scaled_matmul(qa, sa, qb, sb, kernel), max(1, args.repeats // 4))
    t = {k: statistics.median(v) for k, v in repeats.items()}
    print(f"CPU time, forward+backward of one linear (median of {args.repeats}):")
    for label in layers:
        print(f"  {label:<16} {t[label] * 1e3:8.2f} ms  {t[label] / t['fp32 nn.Linear']:5.2f}x")
    print(f"  torch._scaled_mm on this CPU, forward matmul of {m} tokens: "
          f"{t[f'scaled_mm {m} tokens'] * 1e3:.1f} ms vs {t[f'dequant {m} tokens'] * 1e3:.2f} "
          f"ms dequantize + fp32 matmul ({t[f'scaled_mm {m} tokens'] / t[f'dequant {m} tokens']:.0f}x"
          f", same numbers): a reference kernel, so CPU runs take the textbook path")
    conditions.report(repeats)


def bytes_table(args):
    shapes = ((args.out_features, args.in_features), (args.tokens, args.in_features))
    print(f"bytes per element (weight {shapes[0][0]}x{shapes[0][1]}, activation "
          f"{shapes[1][0]}x{shapes[1][1]}, block {args.block}); fp32 master 4 + grad 4 + "
          f"Adam 8 B/param unchanged in every row:")
    for precision in ("fp32", "bf16", "fp8-tensorwise", "fp8-block"):
        b = matmul_bytes(precision, *shapes, block=args.block)
        print(f"  {precision:<15} weight operand {b.weight:.5f} B/param   saved activation "
              f"{b.activation:.5f} B/element")


KNOBS = [
    knob("--tokens", 1024, "M: tokens through the linear"),
    knob("--in-features", 192, "K: the demo model's width (--preset small)"),
    knob("--out-features", 512, "N: the demo model's SwiGLU hidden width"),
    knob("--block", 64, "B of the block recipe (DeepSeek-V3: 128, which does not divide 192)"),
    knob("--repeats", 10, "timed repeats per row (median)"),
    knob("--scaled-mm-tokens", 64, "tokens for the torch._scaled_mm CPU timing (it is slow)"),
    knob("--seed", 0, "random inputs and weights"),
]


def main(argv=None):
    p = command_line("FP8 linears by hand: the tensorwise and DeepSeek-V3 block recipes' "
                     "error vs fp32, CPU time and bytes.", {None: KNOBS},
                     prog="python -m training.fp8")
    args = p.parse_args(argv)
    require_at_least_one(args, ["tokens", "in_features", "out_features", "block", "repeats",
                                "scaled_mm_tokens"])
    for what in ("in_features", "out_features"):
        if getattr(args, what) % args.block:
            raise UserError(f"--block {args.block} does not divide --{what.replace('_', '-')} "
                            f"{getattr(args, what)}")
    gen = torch.Generator().manual_seed(args.seed)
    error_table(args, gen)
    timing_table(args, gen)
    bytes_table(args)
    print("On a GPU: an H100's fp8 tensor cores run dense matmuls at ~2x bf16's peak (1,979 "
          "vs 989 TFLOPS), so the fp8 rows above would be faster than bf16, not slower; the "
          "amax and cast passes stay memory-bound extras (torchtitan: +28% tok/s end to end).")


if __name__ == "__main__":
    run_cli(main)
