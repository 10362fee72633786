# The layout planner (`python parallel.py plan`): pure arithmetic, checked against numbers
# worked out by hand and against the published Llama 3 405B layouts (Table 4).
import argparse
import math

import pytest

from parallelism.planner import (UserError, activation_bytes_per_layer, add_plan_arguments,
                     check_plan_args, evaluate_layout, param_counts, parse_quantity, plan,
                                 plan_layouts, stage_layers)

LLAMA3_405B = ["--params", "405B", "--layers", "126", "--hidden", "16384", "--heads", "128",
               "--kv-heads", "8", "--ffn", "53248", "--vocab", "128256", "--gpu-mem", "80"]


def plan_args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def chosen(*argv):
    best = plan_layouts(plan_args(*argv))[3]
    return best and (best.tp, best.cp, best.pp, best.dp)


def test_quantities_parse_like_the_papers_write_them():
    assert parse_quantity("405e9", "--params") == 405 * 10**9
    assert parse_quantity("405B", "--params") == 405 * 10**9
    assert parse_quantity("8.03B", "--params") == 8_030_000_000
    assert parse_quantity("7b", "--params") == 7 * 10**9
    assert parse_quantity("16M", "--global-batch-tokens", binary=True) == 16 * 2**20


def test_llama3_split_puts_one_layer_less_on_the_first_and_last_stage():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert stage_layers(126, 1) == [126]
    for layers in (1, 7, 32, 80, 126):
        for pp in (1, 2, 4, 8, 16, 32):
            if pp <= layers:
                split = stage_layers(layers, pp)
                assert sum(split) == layers and len(split) == pp and min(split) >= 0
                assert max(split) <= math.ceil((layers + 2) / pp)


def test_activation_rows_are_korthikanti_and_agree_with_train_estimate():
    # the 7B of train.py --estimate: L=32, h=4096, a=32, s=4096, b=1 -> 104.2 / 18.3 / 1.1 GB
    s, h, a = 4096, 4096, 32
    per_layer = {"none": s * h * (34 + 5 * a * s / h), "selective": s * h * 34, "full": 2 * s * h}
    for mode, want in per_layer.items():
        args = plan_args("--params", "7B", "--seq", s, "--recompute", mode)
        plan_layouts(args)                                   # fills the derived defaults
        assert activation_bytes_per_layer(args, 1, 1) == want
    assert round(per_layer["none"] * 32 / 1e9, 1) == 104.2
    assert round(per_layer["selective"] * 32 / 1e9, 1) == 18.3
    # tensor + sequence parallelism divide everything by t; CP keeps s/c of the tokens
    args = plan_args(*LLAMA3_405B, "--seq", 131072)
    plan_layouts(args)
    assert activation_bytes_per_layer(args, 8, 16) == 8192 * 16384 * 34 / 8


def test_405b_row_by_hand():
    args = plan_args(*LLAMA3_405B, "--seq", 8192, "--gpus", 16384)
    psi = plan_layouts(args)[0]
    assert psi == 405e9
    r = evaluate_layout(args, psi, tp=8, cp=1, pp=16)
    assert (r.dp, r.m) == (128, 16)                          # 2048 sequences / 128 replicas
    assert r.weights == pytest.approx(405e9 * 2 / 128)       # whole shard: ZeRO-2
    assert r.grads == pytest.approx(405e9 * 2 / 128 / 128)   # sharded over dp·cp = 128
    assert r.optimizer == pytest.approx(405e9 * 12 / 128 / 128)
    # 1F1B: stage 1 holds 8 layers × 15 microbatches (stage 0: 7 × 16 = 112 < 120)
    assert r.busiest == (1, 8, 15)
    assert r.acts == pytest.approx(120 * 8192 * 16384 * 34 / 8)
    assert r.total / 1e9 == pytest.approx(75.1, abs=0.05) and r.status == "fits"
    sp_bytes = 8192 * 16384 * 2                              # one bf16 activation b·s·h
    assert r.sent["TP"] == pytest.approx(2 * 4 * 7 / 8 * sp_bytes * 8 * 16)
    assert r.sent["PP"] == pytest.approx(2 * 16 * sp_bytes / 8)
    assert r.sent["CP"] == 0
    assert r.sent["DP"] == pytest.approx(2 * 2 * 405e9 / 128 * 127 / 128)
    args = plan_args(*LLAMA3_405B, "--seq", 8192, "--gpus", 16384, "--zero", 1)
    plan_layouts(args)                                       # fills the derived defaults
    zero1 = evaluate_layout(args, psi, 8, 1, 16)
    assert zero1.grads == pytest.approx(405e9 * 2 / 128)     # ZeRO-1 keeps whole gradients


def test_cp_ring_bytes_by_hand():
    args = plan_args(*LLAMA3_405B, "--seq", 131072, "--gpus", 16384)
    r = evaluate_layout(args, plan_layouts(args)[0], tp=8, cp=16, pp=16)
    kv_chunk = 8192 * 128 * 2          # 8192 local tokens × one KV head of 128 per TP rank
    # K and V forward, K, V and dK, dV backward: 3 laps of c−1 hops, 8 layers × 16 microbatches
    assert r.sent["CP"] == pytest.approx(3 * 15 * 2 * kv_chunk * 8 * 16)


def test_llama3_405b_published_layouts():
    # Llama 3 paper, Table 4 (16M tokens per step in every row)
    assert chosen(*LLAMA3_405B, "--seq", 8192, "--gpus", 16384) == (8, 1, 16, 128)
    assert chosen(*LLAMA3_405B, "--seq", 8192, "--gpus", 8192) == (8, 1, 16, 64)
    assert chosen(*LLAMA3_405B, "--seq", 131072, "--gpus", 16384) == (8, 16, 16, 8)
    text = plan(plan_args(*LLAMA3_405B, "--seq", 131072, "--gpus", 16384))
    assert text.splitlines()[-1] == "step 3 - layout: TP 8 × CP 16 × PP 16 × DP 8"
    assert "assumptions:" in text and len(text.splitlines()) <= 40


def test_why_not_less_pp_or_cp():
    args = plan_args(*LLAMA3_405B, "--seq", 131072, "--gpus", 16384)
    psi, _, rows, _ = plan_layouts(args)
    # PP 8 leaves the weights at 12.7 GB but not the activations in flight: over 80 GB
    assert evaluate_layout(args, psi, 8, 16, 8).status == "over"
    # CP 8 would squeeze into memory only because 128 sequences per step leave 8
    # microbatches for 16 stages: the pipeline would idle 65% of the time
    less_cp = evaluate_layout(args, psi, 8, 8, 16)
    assert less_cp.total <= 80e9 and (less_cp.m, less_cp.status) == (8, "m < pp")
    # the published layout needs Llama 3's ZeRO-2 (sharded gradients): with ZeRO-1 it is
    # 81.4 GB, and the planner goes one PP step further
    assert chosen(*LLAMA3_405B, "--seq", 8192, "--gpus", 16384, "--zero", 1) == (8, 1, 32, 64)


def test_7b_from_the_playbook():
    seven = ["--params", "7B", "--layers", 32, "--hidden", 4096, "--seq", 4096]
    text = plan(plan_args(*seven, "--gpus", 1))             # 112 GB of model state alone
    assert "112.0 GB" in text and text.endswith("step 3 - layout: none")
    assert chosen(*seven, "--gpus", 1) is None
    assert chosen(*seven, "--gpus", 8) == (1, 1, 1, 8)     # ZeRO-2 over 8 ranks is enough
    assert chosen(*seven, "--gpus", 64) == (1, 1, 1, 64)
    assert chosen(*seven, "--gpus", 8, "--zero", 0) == (2, 1, 1, 4)   # DDP: TP in the node


@pytest.mark.parametrize("argv, message", [
    (["--gpus", 12], "whole number of nodes"),
    (["--gpus", -8], "--gpus must be at least 1"),
    (["--layers", 0], "--layers must be at least 1"),
    (["--gpu-mem", -80], "--gpu-mem must be positive"),
    (["--params", "seven billion"], "cannot read a count"),
    (["--params=-7B"], "--params must be at least 1"),
    (["--global-batch-tokens", "16Q"], "cannot read a count"),
    (["--global-batch-tokens", 1000, "--seq", 4096], "less than one microbatch"),
    (["--hidden", 1000], "pass --heads"),
    (["--heads", 30], "must divide --hidden"),
])
def test_bad_input_is_one_clear_error(argv, message):
    with pytest.raises(UserError, match=message):
        plan(plan_args(*argv))


# DeepSeek-V3 (technical report, 2024): 61 layers (the first 3 dense), h 7168, 128 heads,
# MLA (d_c 512, q latent 1536, d_R 64, d_nope 128, d_v 128), 256 routed experts 2048 wide
# + 1 shared, top-8; 2,048 H800s, 15,360 sequences of 4,096 tokens per step
DEEPSEEK_V3 = ["--layers", 61, "--hidden", 7168, "--heads", 128, "--vocab", 129280,
               "--ffn", 18432, "--experts", 256, "--shared-experts", 1, "--top-k", 8,
               "--expert-ffn", 2048, "--dense-layers", 3, "--kv-lora-rank", 512,
               "--q-lora-rank", 1536, "--qk-rope-dim", 64, "--qk-nope-dim", 128,
               "--v-head-dim", 128, "--seq", 4096, "--gpu-mem", 80, "--gpus", 2048,
               "--global-batch-tokens", 15360 * 4096,
               # V3 §3.3: fp32 gradients for accumulation (+4 on bf16's 2), fp32 master
               # weights and bf16 Adam moments (4 + 2 + 2); ZeRO-1; EP over 8 nodes
               "--state-bytes", "2,6,8", "--zero", 1, "--ep", 64]


def test_deepseek_v3_parameters_from_the_shape():
    args = plan_args(*DEEPSEEK_V3)
    check_plan_args(args)
    counts = param_counts(args)
    h = 7168
    mla = (h * 1536 + 1536 + 1536 * 128 * 192          # wq_a, q_norm, wq_b
           + h * (512 + 64) + 512 + 512 * 128 * 256     # wkv_a, kv_norm, wkv_b
           + 128 * 128 * h)                             # wo
    expert = 3 * h * 2048
    total = 61 * (mla + 2 * h) + 3 * 3 * h * 18432 + 58 * (256 * h + 257 * expert) \
        + 2 * 129280 * h + h
    assert counts["total"] == total and round(total / 1e9) == 671     # published: 671B
    assert counts["active"] == total - 58 * 248 * expert
    assert round(counts["active"] / 1e9) == 38                         # published: 37B


def test_deepseek_v3_published_layout():
    # no TP, PP 16, EP 64 inside DP 128, ZeRO-1: the cheat sheet with TP last (MoE)
    args = plan_args(*DEEPSEEK_V3)
    psi, _, rows, best = plan_layouts(args)
    assert (best.tp, best.cp, best.pp, best.dp, best.ep) == (1, 1, 16, 128, 64)
    assert evaluate_layout(args, psi, 1, 1, 8, 64).status == "over"     # 85.9 GB
    assert evaluate_layout(args, psi, 1, 1, 16, 32).status == "over"    # EP 32: 81.3 GB
    assert plan(args).splitlines()[-1] == "step 3 - layout: TP 1 × CP 1 × PP 16 × DP 128 (EP 64)"


def test_deepseek_v3_row_by_hand():
    args = plan_args(*DEEPSEEK_V3)
    psi = plan_layouts(args)[0]
    counts = param_counts(args)
    r = evaluate_layout(args, psi, tp=1, cp=1, pp=16, ep=64)
    dense = (counts["total"] - counts["routed"]) / 16          # one stage's dense share
    experts = counts["routed"] / 16 / 64                       # and its 4 experts per layer
    assert (r.dp, r.m) == (128, 120)                           # 15360 sequences / 128
    assert r.weights == pytest.approx(2 * (dense + experts))
    assert r.grads == pytest.approx(6 * (dense + experts))     # ZeRO-1: whole gradients
    # ZeRO-1: the dense optimizer over 128 replicas, the experts' over 128/64 = 2
    assert r.optimizer == pytest.approx(8 * (dense / 128 + experts / 2))
    assert r.busiest == (1, 4, 15) and r.acts == pytest.approx(60 * 4096 * 7168 * 34)
    # all-to-all: 4096 tokens × 8 copies × h, bf16, there and back, forward and backward,
    # 63/64 to other GPUs; 4 layers × 120 microbatches, 58 of 61 layers MoE
    a2a = 4 * 4096 * 8 * 7168 * 2 * 63 / 64
    assert r.sent["EP"] == pytest.approx(a2a * 4 * 120 * 58 / 61)
    assert r.total / 1e9 == pytest.approx(76.2, abs=0.05) and r.status == "fits"


@pytest.mark.parametrize("preset", ["moe", "v3"])
def test_planner_counts_equal_the_models_own(preset):
    from model import GPT, get_config
    cfg = get_config(preset)
    model = GPT(cfg, seed=None)
    heads = sum(p.numel() for p in model.extra_heads.parameters())     # MTP: not counted
    argv = ["--layers", cfg.n_layer, "--hidden", cfg.n_embd, "--heads", cfg.n_head,
            "--kv-heads", cfg.n_kv_head, "--vocab", cfg.vocab_size, "--ffn", cfg.ffn_dim,
            "--experts", cfg.n_expert, "--shared-experts", cfg.n_shared_expert,
            "--top-k", cfg.expert_top_k, "--seq", cfg.block_size]
    if cfg.mla:
        argv += ["--kv-lora-rank", cfg.kv_lora_rank, "--q-lora-rank", cfg.q_lora_rank,
                 "--qk-rope-dim", cfg.qk_rope_head_dim, "--qk-nope-dim", cfg.head_dim,
                 "--v-head-dim", cfg.head_dim]
    args = plan_args(*argv)
    check_plan_args(args)
    counts = param_counts(args)
    assert counts["total"] == model.num_params() - heads
    assert counts["active"] == model.num_params(active=True) - heads
    assert counts["total"] > counts["active"]
