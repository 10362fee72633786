"""
reproduction/tradeoffs.py -- what reproduce.py runs and the table it writes: the RUNS (each
topic's headline command, its --quick twin, and the figures read from its output) and the
ROWS (one per technique: what it saves, what it adds, what it costs, as templates whose
{run.figure} placeholders are filled from those figures).

A figure is read by one of the small readers of reproduction/readers.py -- a table cell by
its row label and column, a regex's first group, the last match of a logged series, a
ratio or difference of two figures, a test's outcome -- never typed: a number in docs/tradeoffs.md is what a
command printed on the machine and commit named there.

To add a row: give the figure a name in its run's `figures`; write the row with
"{run.name}" where the number goes; `python reproduce.py --quick --only RUN` shows it
filled, and tests/test_reproduce.py checks every placeholder names a figure.
"""
import dataclasses

from reproduction.readers import (cell, difference, grab, last, md_cell, ratio, table_figures,
                                   test_result)


@dataclasses.dataclass
class Run:
    name: str
    command: str               # as the README (or the topic's page) writes it
    quick: str                 # the same command at tiny sizes, for --quick
    figures: dict              # figure name -> reader(output) -> str or None
    needs: tuple = ()          # runs whose files (checkpoints) this one reads


TRAIN_BENCH_ROWS = {"base": "baseline fp32", "selective": "selective checkpointing",
                    "full": "full checkpointing", "accum": "grad accumulation ×4",
                    "autocast": "autocast bf16", "bf16": "bf16 + fp32 master",
                    "fp16": "fp16 + master + loss scaling", "fp8": "fp8 tensorwise",
                    "fp8block": "fp8 block (V3)"}
DP_ROWS = {"ddp": "--dp ddp", "zero1": "--dp zero1", "zero2": "--dp zero2",
           "zero3": "--dp zero3", "fsdp": "--dp fsdp"}
LORA_ROWS = ("full", "lora", "loraplus", "qlora", "vera", "dora")
TINY = "--preset tiny --seq-len 32"
SWEEP = "val loss per domain"
# the --quick sizes several runs share: a few short requests; a tiny base LM and task model,
# barely trained
SERVE_QUICK = "--num-requests 8 --prompt-len 8:16 --output-len 4:8"
TASK_QUICK = "--base-steps 2 --task-preset tiny --sft-steps 2 --n-train 50"
V3_PLAN = ("python parallel.py plan --layers 61 --hidden 7168 --heads 128 --vocab 129280 "
           "--ffn 18432 --experts 256 --shared-experts 1 --top-k 8 --expert-ffn 2048 "
           "--dense-layers 3 --kv-lora-rank 512 --q-lora-rank 1536 --qk-rope-dim 64 "
           "--qk-nope-dim 128 --v-head-dim 128 --seq 4096 --gpu-mem 80 --gpus 2048 "
           "--global-batch-tokens 62914560 --state-bytes 2,6,8 --zero 1 --ep 64")
# The rows a test proves rather than a command measures (a fault handled, a file refused):
# the full run runs them; --quick only collects them, since the suite that runs --quick
# runs these very tests already.
ASSERTED = {
    "watchdog": "tests/test_faults.py::test_frozen_rank_is_named_and_the_restart_finishes",
    "generations": "tests/test_faults.py::test_corrupt_latest_falls_back_to_the_previous_generation",
    "sigint": "tests/test_faults.py::test_sigint_two_ranks_saves_and_resumes",
    "error_line": "tests/test_faults.py::test_one_error_line_when_rank0_is_late",
    "safe_loading": "tests/test_safe_loading.py::test_every_command_line_entry_point_refuses_a_malicious_pickle",
    "hf_round_trip": "tests/test_llama_format.py::test_export_import_round_trip_is_exact",
    "merge": "tests/test_lora.py::test_merge_and_unload_is_a_plain_gpt_that_load_model_and_the_engine_read",
    "isolation": "tests/test_serve.py::test_a_poisoned_sequence_fails_alone",
    "deadlines": "tests/test_api_server.py::test_hundreds_of_idle_and_slow_connections_do_not_starve_a_request",
    "n_choices": "tests/test_serve.py::test_n_choices_wait_for_the_first_prefill_and_share_its_blocks",
}
PYTEST = "python -m pytest -p no:cacheprovider -o addopts= -v " + " ".join(ASSERTED.values())


RUNS = [
    # The demo (README's first command): `small` for 600 steps, writes out/ckpt.pt, the
    # model every later run that `needs` "demo" reads. Quick: tiny for 30 steps, same files.
    # quick keeps the files and the log format, not the loss.
    Run("demo", "python train.py",
        "python train.py --preset tiny --steps 30 --batch-size 4 --seq-len 32 "
        "--eval-interval 15 --eval-iters 2 --sample-tokens 0",
        {"val": last(r"step +\d+ \| val loss ([\d.]+)"),
         "steps": grab(r"trained (\d+) steps in"),
         "time": grab(r"trained \d+ steps in ([\d.]+ s)")}),
    # One process, the same tokens per step, seven ways: what each memory technique does to
    # model state, activation bytes (saved tensors, ActivationMeter) and step time, each as a
    # ratio to fp32 measured in the same run (the ratios, not the milliseconds, carry over).
    # quick: tiny, 4×32 tokens; the ratios keep their order (full < selective < none).
    Run("train_bench", "python -m scripts.train_bench",
        f"python -m scripts.train_bench {TINY} --n-layer 1 --bench-steps 2",
        {**table_figures(TRAIN_BENCH_ROWS, {"state": 0, "act": 1, "actx": 2, "timex": 4}),
         "preset": grab(r"bench: preset (\w+),"),
         "tokens": grab(r"bench: preset \w+, attention \w+, (\d+×\d+) tokens")}),
    # FP8 linears against bf16 at the same seed: the demo model for 200 steps under
    # --precision bf16, fp8 (tensorwise) and fp8-block (1×64 tiles and 64×64 blocks: 64
    # divides the demo's widths, V3's 128 does not). quick: tiny, 10 steps, block 16.
    *[Run(name, f"python train.py --precision {flags} --steps 200 --eval-interval 100 "
          f"--log-interval 50 --sample-tokens 0 --ckpt out/fp8/{name}.pt",
          f"python train.py {TINY} --precision {quick} --steps 10 --eval-interval 10 "
          f"--log-interval 5 --eval-iters 2 --sample-tokens 0 --ckpt out/fp8/{name}_quick.pt",
          {"loss": last(r"step +\d+ \| loss ([\d.]+)"),
           "val": last(r"step +\d+ \| val loss ([\d.]+)")})
      for name, flags, quick in (("bf16_ref", "bf16", "bf16"), ("fp8", "fp8", "fp8"),
                                 ("fp8_block", "fp8-block --fp8-block 64",
                                  "fp8-block --fp8-block 16"))],
    # The same bench under torchrun: every --dp mode on 2 ranks. State per rank falls as
    # ZeRO shards optimizer state (1), then gradients (2), then parameters (3); bytes sent are
    # the CommMeter's count, to compare with 2Ψ(N−1)/N (DDP, ZeRO-1/2) and 3Ψ(N−1)/N (ZeRO-3).
    # quick: tiny; the byte counts still equal the formulas for its Ψ.
    Run("dp", "torchrun --standalone --nproc_per_node=2 -m scripts.train_bench",
        f"torchrun --standalone --nproc_per_node=2 -m scripts.train_bench {TINY} "
        "--bench-steps 2",
        {**table_figures(DP_ROWS, {"state": 0, "timex": 4, "sent": 5}),
         "zero3_fsdp": grab(r"hand zero3 / fsdp step time: ([\d.]+)")}),
    # Muon on ZeRO-2's sharded state, 2 ranks: momentum on each rank's pieces, each matrix
    # gathered at its owner for Newton–Schulz, the update's pieces sent back (two bf16
    # all-to-alls, counted by the meter and from the layout). quick: tiny, 4 steps.
    Run("muon_zero", "torchrun --standalone --nproc_per_node=2 train.py --dp zero2 "
        "--optimizer muon --steps 60 --eval-interval 30 --ckpt out/muon_zero2.pt "
        "--sample-tokens 0",
        f"torchrun --standalone --nproc_per_node=2 train.py {TINY} --dp zero2 "
        "--optimizer muon --steps 4 --eval-interval 2 --eval-iters 1 "
        "--ckpt out/muon_zero2_quick.pt --sample-tokens 0",
        {"a2a": grab(r"all-to-alls sent (\S+ \S+)/step"),
         "layout": grab(r"all-to-alls sent \S+ \S+/step \(layout: (\S+ \S+)\)"),
         "ns_share": grab(r"MFLOP/step \((\d+%)"),
         "state": grab(r"(?m)^  0 +\S+ \S+ +\S+ \S+ +(\S+ \S+)"),
         "val": last(r"step +\d+ \| val loss ([\d.]+)")}),
    # Megatron tensor parallelism on 2 ranks, --check: every loss, gradient and weight
    # compared with one process each step (the run fails if they differ). Sent = the 4
    # all-reduces of b·s·h per layer (Shoeybi et al. 2019) the ledger counts.
    # quick: tiny, 2 steps; the check is as strict as at full size.
    Run("tp", "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check",
        "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check --preset tiny "
        "--steps 2",
        {"state": grab(r"state ([\d.]+ [KMG]?B)/rank"),
         "sent": grab(r"sent ([\d.]+ [KMG]?B)/step"),
         "check": grab(r"(every gradient \(max \|diff\| [\d.e-]+\))"),
         "act": grab(r"activations of one microbatch, this rank's stages: ([\d.]+ [KMG]?B)"),
         "act_one": grab(r"one process, all \d+ sequences and layers: ([\d.]+ [KMG]?B)")}),
    # Every schedule on P ranks: the measured bubble next to the theory (P−1)/(M+P−1) for
    # GPipe and 1F1B (Narayanan et al. 2021), and the zero-bubble schedules (Qi et al. 2023;
    # DeepSeek-V3's DualPipeV) that run the weight-gradient matmuls in the gaps.
    # Sequence parallelism on top: norms and dropout regions sharded along the sequence,
    # the all-reduce split into reduce-scatter + all-gather (Korthikanti et al. 2022).
    # quick: tiny, 2 steps.
    Run("sp", "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --sp --check",
        "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --sp --check "
        "--preset tiny --steps 2",
        {"act": grab(r"activations of one microbatch, this rank's stages: ([\d.]+ [KMG]?B)"),
         "act_one": grab(r"one process, all \d+ sequences and layers: ([\d.]+ [KMG]?B)"),
         "gathers": grab(r"(?m)^ +tp +all_gather +(\d+)"),
         "check": grab(r"(every gradient \(max \|diff\| [\d.e-]+\))")}),
    # Context parallelism: ring attention over 2 ranks, each holding half the tokens in the
    # zigzag layout (chunks r and 2C−1−r) so causal work is balanced. quick: tiny.
    Run("cp", "torchrun --standalone --nproc_per_node=2 parallel.py --cp 2 --check",
        "torchrun --standalone --nproc_per_node=2 parallel.py --cp 2 --check --preset tiny "
        "--steps 2",
        {"act": grab(r"activations of one microbatch, this rank's stages: ([\d.]+ [KMG]?B)"),
         "act_one": grab(r"one process, all \d+ sequences and layers: ([\d.]+ [KMG]?B)"),
         "kv_sent": grab(r"(?m)^ +cp +send +\d+ +([\d.]+ [KMG]?B)"),
         "grads": grab(r"(?m)^ +data +all_reduce +\d+ +([\d.]+ [KMG]?B)"),
         "check": grab(r"(every gradient \(max \|diff\| [\d.e-]+\))")}),
    # Expert parallelism: the experts split over 2 ranks, tokens exchanged by all-to-all
    # (GShard, Lepikhin et al. 2020). quick: one MoE layer of width 48, the 512-token BPE.
    Run("ep", "torchrun --standalone --nproc_per_node=2 parallel.py --preset moe --ep 2 "
        "--check",
        "torchrun --standalone --nproc_per_node=2 parallel.py --preset moe --n-layer 1 "
        "--n-embd 48 --vocab-size 512 --ep 2 --check --steps 2",
        {"state": grab(r"state ([\d.]+ [KMG]?B)/rank"),
         "one": grab(r"\(one process: params ([\d.]+ [KMG]?B)"),
         "a2a": grab(r"(?m)^ +ep +all_to_all(?:_single)? +\d+ +([\d.]+ [KMG]?B)"),
         "check": grab(r"(every gradient \(max \|diff\| [\d.e-]+\))")}),
    # DeepSeek-V3's ideas on the repo's scale: fine-grained + shared experts, routing
    # balanced by a bias instead of a loss (Wang et al. 2024), an MTP head; then the same
    # model balanced by the Switch aux loss at Switch's coefficient 0.01 (the v3 preset's own
    # α = 1e-4 is V3's complementary loss, too weak to balance alone). quick: 1 layer, 2
    # steps, the tiny tokenizer.
    Run("v3", "python train.py --preset v3 --steps 400 --ckpt out/v3.pt --sample-tokens 0",
        "python train.py --preset v3 --n-layer 1 --vocab-size 512 --steps 2 --batch-size 2 "
        "--seq-len 32 --eval-interval 2 --eval-iters 1 --ckpt out/v3.pt --sample-tokens 0",
        {"busiest": grab(r"max/mean tokens per expert ([\d.]+) over"),
         "busiest_last": grab(r"over \d+ steps, ([\d.]+) over the last"),
         "val": last(r"step +\d+ \| val loss ([\d.]+)"),
         "active": grab(r"active params ([\d,]+ of [\d,]+)")}),
    Run("v3_aux", "python train.py --preset v3 --steps 400 --moe-balance aux "
        "--moe-aux-coef 0.01 --ckpt out/v3_aux.pt --sample-tokens 0",
        "python train.py --preset v3 --n-layer 1 --vocab-size 512 --steps 2 --batch-size 2 "
        "--seq-len 32 --eval-interval 2 --eval-iters 1 --moe-balance aux --moe-aux-coef 0.01 "
        "--ckpt out/v3_aux.pt --sample-tokens 0",
        {"busiest": grab(r"max/mean tokens per expert ([\d.]+) over"),
         "busiest_last": grab(r"over \d+ steps, ([\d.]+) over the last"),
         "val": last(r"step +\d+ \| val loss ([\d.]+)")}),
    # The layout planner on DeepSeek-V3's published shape and recipe (EP 64 given): the
    # arithmetic alone picks the rest. Pure arithmetic: the same command for --quick.
    Run("plan", V3_PLAN, V3_PLAN,
        {"psi": grab(r"plan: Ψ = ([\d.]+B)"),
         "active": grab(r"top-\d+: ([\d.]+B) active"),
         "layout": grab(r"-> (TP \d+ × CP \d+ × PP \d+ × DP \d+ \(EP \d+\)) holds"),
         "per_gpu": grab(r"\(EP \d+\) holds ([\d.]+ GB)"),
         "a2a_vs_dp": ratio(grab(r"sent per GPU and step: .*EP ([\d.]+ [KMGT]?B)"),
                            grab(r"sent per GPU and step: .*DP ([\d.]+ [KMGT]?B)"),
                            "{:.0f}")}),
    # quick: 2 ranks, 4 microbatches; the bubble is measured, not assumed.
    Run("pipeline", "torchrun --standalone --nproc_per_node=4 -m parallelism.pipeline bench",
        "torchrun --standalone --nproc_per_node=2 -m parallelism.pipeline bench "
        "--microbatches 4 --steps 1 --seq-len 16 --microbatch-size 2 --n-embd 32 --n-layer 4",
        {f"{s}_{col}": cell(s, i) for s in ("gpipe", "1f1b", "zb", "dualpipev")
         for col, i in {"bubble": 3, "theory": 4, "p2p": 5}.items()}),
    # Each optimizer's state in B/param (SGD 0, momentum 4, RMSProp 4, Adam/AdamW 8, Muon 4
    # on hidden matrices) and the step's cost; the Newton–Schulz share of the step's FLOPs.
    # quick: one layer of width 32; the state column is size-independent.
    Run("optim_bench", "python optim.py bench",
        "python optim.py bench --n-layer 1 --n-embd 32 --vocab-size 300 --bench-steps 2",
        {"ns_share": grab(r"Newton–Schulz: [\d.]+ [MGT]?FLOP per step = ([\d.]+%)"),
         "muon_ms": cell("Muon (hidden matrices)", 1), "adamw_ms": cell("AdamW", 1)}),
    # AdamW vs Muon on one token budget, each at its best lr of a small grid: the tokens each
    # needs to reach the same validation loss (Moonlight, Liu et al. 2025: ≈2× at scale).
    # quick: 12 steps of one layer; the ratio means nothing there.
    Run("optim", "python optim.py compare",
        "python optim.py compare --vocab-size 300 --n-layer 1 --n-embd 32 --steps 12 "
        "--batch-size 4 --seq-len 32 --warmup-steps 2 --eval-interval 3 --eval-iters 2 "
        "--lrs 3e-3,1e-2 --muon-lrs 1e-2,3e-2",
        {"speedup": grab(r"AdamW/Muon = ([\d.]+×)"),
         "target": grab(r"(?m)^val loss ([\d.]+): AdamW needs")}),
    # Every adapter and full fine-tuning on the arithmetic task, the same steps: trainable
    # parameters (= the formula, asserted by the script), state, activations, step time,
    # answer loss and exact match, and NF4's measured bits/param with double quantization.
    # quick: 3 steps; the ledger columns (bytes) are exact at any size.
    Run("lora", "python lora.py compare",
        "python lora.py compare --steps 3 --batch-size 8 --n-train 200 --eval-problems 16 "
        "--warmup 1 --log-interval 100",
        {**{f"{m}_{col}": cell(m, i, after="ledger (") for m in LORA_ROWS
            for col, i in {"trainable": 0, "state": 5, "statex": 6, "actx": 8,
                           "timex": 10, "exact": 11, "loss": 12}.items()},
         "nf4_bits": grab(r"NF4 with double quantization: measured ([\d.]+) bits"),
         "nf4_err": grab(r"NF4 with double quantization: .* max \|W - deq\(W\)\| ([\d.e-]+)")},
        needs=("demo",)),
    # KV bytes per token of MHA, GQA and MLA read from the caches themselves (= the formula
    # (d_c + d_R)·L·bytes for MLA, DeepSeek-V2), and decode time with and without absorption.
    # quick: 32 tokens of context; bytes per token do not depend on it.
    Run("mla", "python -m scripts.mla_bench",
        "python -m scripts.mla_bench --context 32 --new-tokens 4 --repeats 1",
        {"mla_bytes": cell("MLA", 2), "mha_bytes": cell("MHA", 2),
         "gqa_bytes": cell("GQA 2 kv heads", 2),
         "less": grab(r"MLA caches [\d.]+ [KMG]?B/token: ([\d.]+x) less than MHA"),
         "unabsorbed": ratio(cell("MLA unabsorbed", 0), cell("MLA absorbed", 0))}),
    # The engine vs sequential generate() and static batching on one seeded workload: KV slots
    # left unfilled by paging (< one block per sequence), throughput, SLO goodput.
    # quick: 8 short requests; the outputs must still equal generate()'s.
    Run("serve", "python -m scripts.serve_bench",
        f"python -m scripts.serve_bench {SERVE_QUICK}",
        {"slots": grab(r"unfilled slots per running sequence: mean ([\d.]+)"),
         "per_token": grab(r"KV cache \(float32, (\d+ B)/token"),
         "contig": grab(r"reserving the full context \(\d+\) per request: (\d+%) wasted"),
         "static_waste": grab(r"static batching reserves .* = (\d+%) wasted"),
         "engine_speedup": cell("engine (fcfs)", 2),
         "static_speedup": cell("static batching B=", 3),      # the label ends in "B=64"
         # goodput is the last column, "608.93 (8/8)" (the TPOT and ITL cells hold runs of
         # spaces of their own, so it is found from the end of the line)
         "fcfs_goodput": grab(r"(?m)^engine \(fcfs\) .* ([\d.]+) \(\d+/\d+\)\s*$"),
         "slo_goodput": grab(r"(?m)^engine \(slo\) .* ([\d.]+) \(\d+/\d+\)\s*$"),
         "same": grab(r"greedy outputs of fcfs == sequential generate\(\): (\d+/\d+)")},
        needs=("demo",)),
    # Multi-turn sessions through a small pool: without the second tier a session's history
    # is recomputed once evicted; with it, evicted blocks come back from host memory.
    # quick: 4 sessions of 3 turns, blocks of 4 tokens, a pool that must evict.
    Run("agent", "python -m scripts.serve_bench --workload agent --kv-tier host "
        "--num-blocks 96",
        "python -m scripts.serve_bench --workload agent --kv-tier host --num-blocks 24 "
        "--sessions 4 --turns 3 --system-len 8 --message-len 4:8 --answer-len 4:8 "
        "--block-size 4",
        {f"{key}_{tier}": grab(rf"(?m)^ *\d+ {tier} +(?:\S+ +){{{skip}}}(\S+)")
         for tier in ("none", "host")
         for key, skip in {"prompt": 0, "hit": 1, "tier_hit": 2, "computed": 5,
                           "ttft": 10}.items()},
        needs=("demo",)),
    # The same engine with a pool too small for the load: sequences are preempted and
    # recomputed (vLLM's recompute mode), outputs still exact. quick: a 64-slot pool.
    Run("preempt", "python -m scripts.serve_bench --num-blocks 160",
        f"python -m scripts.serve_bench {SERVE_QUICK} "
        "--num-blocks 16 --block-size 4",
        {"preemptions": grab(r"preemptions (\d+)"),
         "engine_work": grab(r"needed \d+; engine (\d+)"),
         "needed": grab(r"needed (\d+); engine"),
         "same": grab(r"greedy outputs of fcfs == sequential generate\(\): (\d+/\d+)")},
        needs=("demo",)),
    # Requests sharing a prompt prefix: its blocks are hashed and computed once.
    Run("prefix", "python -m scripts.serve_bench --shared-prefix 64 --prompt-len 16:64",
        f"python -m scripts.serve_bench {SERVE_QUICK} "
        "--shared-prefix 32",
        {"hits": grab(r"prefix cache: (\d+/\d+ prompt tokens hit \(\d+%\))"),
         "engine_work": grab(r"needed \d+; engine (\d+)"),
         "needed": grab(r"needed (\d+); engine")},
        needs=("demo",)),
    # int8 KV: one scale per token and KV head, quantized on write (KIVI-style absmax).
    Run("int8", "python -m scripts.serve_bench --kv-dtype int8",
        f"python -m scripts.serve_bench {SERVE_QUICK} "
        "--kv-dtype int8",
        {"per_token": grab(r"KV cache \(int8, (\d+ B)/token"),
         "tok_s": cell("engine (fcfs)", 1)},
        needs=("demo",)),
    # Structured output: the same workload free vs every request under a JSON schema (the
    # engine masks every step's logits; masks cached per automaton state). quick: 8 requests.
    Run("structured", "python -m scripts.serve_bench --workload structured --repeats 3",
        f"python -m scripts.serve_bench {SERVE_QUICK} --workload structured",
        {"ratio": grab(r"json_schema \d+ tok/s \(([\d.]+)x\)"),
         "hits": grab(r"mask cache (\d+%) hits"),
         "mask_ms": grab(r"a fresh mask ([\d.]+ ms)"),
         "decode_ms": grab(r"vs a decode step ([\d.]+ ms)")},
        needs=("demo",)),
    # Many LoRA adapters in one batch (BGMV) vs the base alone vs one merged adapter.
    Run("adapters", "python -m scripts.serve_bench --workload adapters --repeats 3",
        f"python -m scripts.serve_bench {SERVE_QUICK} --workload adapters",
        {"mixed": grab(r"mixed in every batch \d+ tok/s \(([\d.]+)x\)"),
         "merged": grab(r"one merged \d+ tok/s \(([\d.]+)x\)"),
         "k": grab(r"base \+ (\d+) adapters"),
         "memory": grab(r"own (\S+ \S+), [\d.]+% of the base model"),
         "share": grab(r"own \S+ \S+, ([\d.]+%) of the base model")},
        needs=("demo",)),
    # Sessions over 4 engine replicas under three routing policies: the prefix hit rate
    # each gets, against one cache holding everything (the ceiling).
    # quick: 4 sessions of 2 turns; outputs must agree across the policies.
    Run("router", "python kv_router.py bench",
        "python kv_router.py bench --sessions 4 --turns 2",
        {f"{policy}_{col}": cell(policy, i) for policy in ("cache_aware", "least_loaded",
                                                           "round_robin")
         for col, i in {"hit": 0, "one_cache": 1, "computed": 3}.items()}),
    # A stream many times the context: dense recompute (the reference), a window, and
    # attention sinks + window (StreamingLLM, Xiao et al. 2023) -- bytes held and loss each.
    # It trains its own sink-token model unless given --checkpoint: the demo has no sink.
    # quick: 2 training steps, 150 tokens, window 32: the wiring, not the sink.
    Run("streaming", "python streaming.py measure --bos",
        "python streaming.py measure --bos --train-steps 2 --tokens 150 --sinks 2 --window 30",
        {"model": grab(r"model: ([^(,]+?)\s*[(,]"),
         "stream": grab(r"stream: (\d+ val tokens = [\d.]+x the context)"),
         "whole_bytes": grab(r"\| full KV cache \(model\.KVCache\) \|[^|]+\| ([^|]+?) \|"),
         "held": grab(r"\| sinks \d+ \+ window \d+ \| (\d+) \|"),
         "bytes": grab(r"\| sinks \d+ \+ window \d+ \| \d+ \| ([^|]+?) \|"),
         "rerotated": grab(r"\| sinks \d+ \+ window \d+ \| \d+ \|[^|]+\|[^|]+\| (\d+) \|"),
         "dense": grab(r"dense recompute \(\d+\): mean loss ([\d.]+)"),
         "window": grab(r"(?m)^window \(\d+\): mean loss ([\d.]+)"),
         "sinks": grab(r"sinks \d+ \+ window \d+: mean loss ([\d.]+)")}),
    # The corpus before the tokenizer: what the Gopher/Codex/StarCoder quality rules remove.
    # quick: 200 KB per domain; the rules are the same.
    Run("curate", "python curate.py stats",
        "python curate.py stats --max-bytes-per-domain 200000",
        {"rules": grab(r"all rules: remove (\d+ of \d+ documents, [\d.]+ [KMG]?B of "
                       r"[\d.]+ [KMG]?B)")}),
    # Perplexity and bits per byte of the demo model on held-out text (bits/byte compares
    # across tokenizers; perplexity does not), with a bootstrap interval.
    # quick: 8,192 tokens of the validation text.
    Run("ppl", "python evaluate.py ppl", "python evaluate.py ppl --max-tokens 8192",
        {"ppl": cell("perplexity", 0), "bpb": cell("bits/byte", 0),
         "loss": cell("loss (nats)", 0)},
        needs=("demo",)),
    # Generative exact match vs log-likelihood ranking of given candidates, base model and
    # a task fine-tune; and the time saved by reusing the prompt's KV across candidates.
    # This run and the next three train their own tiny base (its 512-token BPE spells
    # numbers digit by digit): they do not read the demo model, so they need no run.
    # quick: a tiny task model, 2 SFT steps, 40 problems.
    Run("task", "python evaluate.py task",
        f"python evaluate.py task {TASK_QUICK} "
        "--eval-problems 40",
        {"gen": grab(r"task SFT \(\w+\) +([\d.]+%)"),
         "rank": grab(r"task SFT \(\w+\) +[\d.]+% \[[^]]*\] +([\d.]+%)"),
         "cached_s": grab(r"prompt KV cache reused ([\d.]+ s)"),
         "rerun_s": grab(r"prompt re-run per candidate ([\d.]+ s)")}),
    # Expected calibration error before and after temperature scaling (Guo et al. 2017):
    # one scalar T fitted on a dev split, judged on the test split.
    # quick: a tiny task model; its ECE near 0 says nothing.
    Run("calibration", "python -m scripts.calibration",
        f"python -m scripts.calibration {TASK_QUICK} "
        "--eval-problems 40",
        {"T": grab(r"fitted T = ([\d.]+)"),
         "seq_before": grab(r"sequence prob +1\.000 +\S+ +\S+ +(\S+)"),
         "seq_after": last(r"sequence prob +[\d.]+ +\S+ +\S+ +(\S+)"),
         "first_before": grab(r"first-token prob +1\.000 +\S+ +\S+ +(\S+)"),
         "first_after": last(r"first-token prob +[\d.]+ +\S+ +\S+ +(\S+)")}),
    # Is the model's confidence a usable signal of a wrong answer? AUROC of each
    # detector (Kuhn et al. 2023's semantic entropy among them). quick: 2 samples.
    Run("uncertainty", "python -m scripts.uncertainty",
        f"python -m scripts.uncertainty {TASK_QUICK} "
        "--eval-problems 20 --samples 2",
        {"maxprob": cell("max prob (1-p)", 0),
         "consistency": grab(r"self-consistency K=\d+ +(\S+)"),
         "semantic": cell("semantic entropy", 0)}),
    # Contamination: planted test items found by n-gram overlap with the training data
    # (GPT-3's rule), and by Min-K% Prob from the model alone (Shi et al. 2024).
    Run("contamination", "python -m scripts.contamination",
        "python -m scripts.contamination --base-steps 2 --task-preset tiny --sft-steps 20 "
        "--eval-problems 60 --planted 10 --repeats 3 --ft-clean 40 --bootstrap 20",
        {"n": grab(r"n-gram overlap with the training data, n = (\d+)"),
         "precision": grab(r"contaminated data +flagged +\d+ \| precision ([\d.]+)"),
         "recall": grab(r"contaminated data +flagged .*\| recall ([\d.]+)"),
         "mink": cell("contaminated", 4, after="planted acc")}),
    # Exact and near duplicates (MinHash LSH, FineWeb's 14 bands × 8 rows), with the
    # S-curve 1 − (1 − s^r)^b measured on planted edits.
    Run("dedup", "python curate.py dedup",
        "python curate.py dedup --max-bytes-per-domain 200000",
        {"exact": grab(r"exact: \d+ clusters, (\d+ copies removed)"),
         "exact_bytes": grab(r"copies removed \(([\d.]+ [KMG]?B) of"),
         "near": grab(r"near \(.*\): \d+ clusters, (\d+ documents removed)"),
         "near_bytes": grab(r"documents removed \(([\d.]+ [KMG]?B)\)"),
         "detected_78": cell("0.7-0.8", 1), "theory_78": cell("0.7-0.8", 2),
         "detected_89": cell("0.8-0.9", 1), "theory_89": cell("0.8-0.9", 2)}),
    # One tiny model per data mixture, the same token budget: per-domain validation loss.
    # quick: 4 steps on 20% of 200 KB per domain, two mixtures (+ the fixed raw/dedup/seed
    # runs).
    Run("sweep", "python -m scripts.curate_sweep",
        "python -m scripts.curate_sweep --steps 4 --max-bytes-per-domain 200000 --subset 0.2 "
        "--eval-tokens 512 "
        "--mixtures 'natural;uniform'",
        # (the progress lines "  uniform: 9 s" come first: read below the table's title)
        {**{f"uniform_{d}": difference(cell("uniform", i, after=SWEEP),
                                       cell("natural", i, after=SWEEP))
            for d, i in {"arith": 0, "headers": 1, "lib": 2, "tests": 5}.items()},
         "noise": difference(cell("natural, seed + 1 (the noise)", 7, after=SWEEP),
                             cell("natural", 7, after=SWEEP))}),
    # Prefill on one rank, decode on the other: decode tokens that waited behind a prefill
    # (none, by construction) vs two colocated engines; KV bytes sent = 2·L·H_kv·D·bytes·tokens.
    # quick: tiny, 8 requests with short prompts; KV bytes still = the formula.
    Run("disagg", "torchrun --standalone --nproc_per_node=2 disagg.py bench --rate 40 "
        "--num-requests 96",
        "torchrun --standalone --nproc_per_node=2 disagg.py bench --preset tiny "
        "--num-requests 8 --long-len 20:30",
        {"delayed": grab(r"disaggregated 1P \+ 1D .*?(\d+ of \d+) +\("),
         "delayed_colocated": grab(r"colocated x2 \(half each\) .*?(\d+ of \d+) +\("),
         "kv": grab(r"KV moved by disaggregation: ([\d.]+ [KMG]?B)"),
         "kv_formula": grab(r"KV moved by disaggregation: .*= the formula's (\d+ B)"),
         "kv_measured": grab(r"KV moved by disaggregation: [\d.]+ [KMG]?B \((\d+ B)"),
         "same": grab(r"greedy outputs identical in the three systems: (\d+/\d+)")}),
    # The draft model speculative decoding uses, written beside the demo model.
    # quick: a one-layer tiny model (the demo's tokenizer) for 2 steps.
    Run("draft", "python train.py --preset draft --ckpt out/draft.pt --sample-tokens 0",
        "python train.py --preset tiny --n-layer 1 --ckpt out/draft.pt --steps 2 "
        "--batch-size 2 --seq-len 32 --sample-tokens 0",
        {"val": last(r"step +\d+ \| val loss ([\d.]+)|saved step (\d+)")}),
    # Every drafter against plain decoding of the same target: acceptance α, speedup at
    # T = 0 (outputs must equal greedy) and T = 1 (the distribution must equal the target's).
    # quick: drafters trained 5 steps, 8 new tokens; =greedy must still hold.
    Run("spec", "python spec_decode.py bench",
        "python spec_decode.py bench --train-steps 5 --max-new-tokens 8 --bench-prompts 1 "
        "--repeats 1",
        {**{f"{m}_speedup": grab(rf"(?m)^{m} +.*\| +\d+ +([\d.]+x)")
            for m in ("draft", "tree", "medusa", "eagle", "dflash", "mtp")},
         **{f"{m}_alpha_t1": grab(rf"(?m)^{m} +\S+ +\S+ +1 +\S+ \| +([\d.]+)")
            for m in ("draft", "medusa", "eagle", "dflash")},
         "drafters": grab(r"drafters: ([\d.]+ [KMG]?B)")},
        needs=("demo", "draft")),
    # Every quantization and pruning method on the demo model in one table: bits/weight,
    # bytes, Δ validation loss against fp32, top-1 and greedy agreement, decode time.
    # quick: one evaluation batch, one prompt, 2 QAT steps.
    Run("quantize", "python quantize.py compare",
        "python quantize.py compare --qat-steps 2 --eval-batches 1 --prompts 1 "
        "--new-tokens 4 --repeats 1 --seq-len 32 --batch-size 2 --calib-batches 1",
        {**{f"{key}_{col}": md_cell(first, i)
            for key, first in {"fp32": "| fp32 | fp32 |", "int8": "| rtn | int8 per-row |",
                               "int4": "| rtn | int4 g32 |", "int3": "| rtn | int3 g32 |",
                               "gptq3": "| gptq | int3 g32 |", "awq3": "| awq | int3 g32 |",
                               "sq": "| smoothquant |", "mag24": "| magnitude | 2:4 50% |",
                               "wanda24": "| wanda | 2:4 50% |",
                               "mag50": "| magnitude | unstructured 50% |",
                               "wanda50": "| wanda | unstructured 50% |"}.items()
            for col, i in {"bits": 2, "bytes": 3, "dloss": 5, "top1": 7, "greedy": 8,
                           "decode": 10}.items()},
         # the QAT rows' labels carry the step count: matched by pattern, int3's Δ loss
         **{key: grab(rf"\| {label} \| int3 g32 \|(?: [^|]+ \|){{3}} ([^|]+?) \|")
            for key, label in {"qat_ste": r"qat-ste \d+ steps", "qat_lsq": r"qat-lsq \d+ steps",
                               "qat_base": r"fp32 \+ \d+ steps, rtn"}.items()},
         "qat_steps": grab(r"\| qat-ste (\d+) steps \|")},
        needs=("demo",)),
    # Seven RL and distillation methods from one SFT policy, the same budget: state each
    # holds (PPO's critic), step time as a ratio to GRPO's, held-out accuracy before→after.
    # quick: 2 RL steps on a 20-step SFT policy; held-out accuracy barely moves.
    Run("rl", "python rl.py compare",
        "python rl.py compare --checkpoint none --preset tiny --teacher-preset tiny "
        "--digits 1 --ops +- --max-new 4 --steps 2 --group 4 --sft-steps 20 "
        "--teacher-sft-steps 20 --eval-samples 2 --eval-problems 20",
        {**{f"{algo}_{col}": cell(algo, i, after="ledger (") for algo in ("ppo", "grpo", "drgrpo", "distill",
                                                        "softkd", "seqkd")
            for col, i in {"state": 1, "vs_grpo": 7, "held_out": 10,
                           "zero_var": 15}.items()},
         "critic": grab(r"PPO's critic: \+([\d.]+k parameters \(\d+% of the policy's\))"),
         "critic_state": grab(r"PPO's critic: .*, \+([\d.]+ [KMG]?B) state")}),
    # The step-time and dollar model, from data sheets: the published runs' MFU, GPU-hours
    # and dollars against what Meta and DeepSeek report; serving $/M tokens from the decode
    # roofline. Arithmetic, seconds: quick is the same command.
    Run("cost", "python parallel.py plan --published", "python parallel.py plan --published",
        {"llama_mfu": grab(r"Llama 3 405B\s+as published\s+\S+\s+\S+\s+\S+ \|\s+(\d+%)"),
         "llama_gpuh": grab(r"Llama 3 405B\s+as published[^|]*\|[^|]*\|\s+(\S+)"),
         "llama_ratio": grab(r"Llama 3 405B\s+as published[^|]*\|[^|]*\|\s+\S+\s+\S+\s+(\S+)"),
         "v3_gpuh": grab(r"DeepSeek-V3\s+as published[^|]*\|[^|]*\|\s+(\S+)"),
         "v3_ratio": grab(r"DeepSeek-V3\s+as published[^|]*\|[^|]*\|\s+\S+\s+\S+\s+(\S+)"),
         "v3_cost": grab(r"DeepSeek-V3\s+as published[^|]*\|[^|]*\|[^|]*\|\s+(\S+)")}),
    Run("cost_serving", "python -m parallelism.cost_model", "python -m parallelism.cost_model",
        {f"{name}_{batch}": grab(rf"{label}\s+{batch}\s+\d+\s+\d+\s+\S+ GB(?:\s+\S+){{3}}\s+(\S+)")
         for name, label in (("b7", "Llama-2 7B"), ("b70", "Llama-3 70B"))
         for batch in (1, 256)}),
    # GRPO with its rollouts through serve.py's engine on a synced copy of the policy:
    # rollout tok/s, generation's share of the step, the group prompts' prefix-cache hits,
    # the weight sync per step, the sampler/trainer mismatch; then the engine two steps
    # ahead (K = 2) with truncated importance sampling. quick: tiny, 3 steps.
    *[Run(name, f"python rl.py --algo grpo --rollout engine{flags}",
          "python rl.py --checkpoint none --preset tiny --digits 1 --ops +- --max-new 4 "
          f"--steps 3 --group 4 --sft-steps 20 --eval-samples 2 --eval-problems 20 "
          f"--algo grpo --rollout engine{flags}",
          {"tok_s": grab(r"engine rollouts: (\d+ tok/s)"),
           "gen_share": grab(r"generation (\d+%) of the time"),
           "hits": grab(r"prefix-cache hits (\d+%)"),
           "sync": grab(r"sync (\S+ \S+) in"),
           "sync_ms": grab(r"in ([\d.]+ ms) per step"),
           "mismatch": grab(r"mismatch KL\(μ‖π_old\) (\S+)/token"),
           "staleness": grab(r"staleness ([\d.]+) steps"),
           "held_out": cell("grpo", 10, after="ledger (")}, needs=("demo",))
      for name, flags in (("rl_engine", ""),
                          ("rl_offpolicy", " --max-offpolicy-steps 2 --tis-cap 2"))],
    # The tests behind the rows no command measures (ASSERTED above), in one pytest run.
    Run("asserted", PYTEST, PYTEST.replace(" -v ", " --collect-only -q "),
        {name: test_result(node) for name, node in ASSERTED.items()}),
]


# ----------------------------------------------------------------------------------------
# The rows: technique, what it saves, what it adds, what it costs

ROWS = [
    # the reference every ratio below divides by: 16 B/param of model state
    # here: Adam's m and v (8 B) + fp32 weights and gradients (8 B) per parameter
    ("fp32 baseline (`{train_bench.cmd}`, {train_bench.preset}, {train_bench.tokens} tokens)",
     "—", "—",
     "model state {train_bench.base_state}; activations {train_bench.base_act}"),
    # Micikevicius et al. 2018: 16-bit compute, fp32 master weights; state is 16 B/param either way
    ("mixed precision: bf16 autocast / bf16 + fp32 master / fp16 + master + loss scaling",
     "model state **none** ({train_bench.autocast_state} / {train_bench.bf16_state} / "
     "{train_bench.fp16_state}); activations ×{train_bench.autocast_actx} / "
     "×{train_bench.bf16_actx} / ×{train_bench.fp16_actx} (norms, RoPE, softmax, loss stay fp32)",
     "casts; fp16: an inf/NaN check per step",
     "rounding error; fp16 skips steps on overflow; step time ×{train_bench.autocast_timex} / "
     "×{train_bench.bf16_timex} / ×{train_bench.fp16_timex} (CPU: emulated matmuls)"),
    # Korthikanti et al. 2022: recompute only the cheap, big tensors (the s² scores)
    # the ratio to read: activations saved vs the step time paid
    ("selective activation checkpointing",
     "activations ×{train_bench.selective_actx} (the T² attention scores and the SwiGLU "
     "product are recomputed)",
     "+1 attention-core and SwiGLU forward per layer",
     "×{train_bench.selective_timex} step time"),
    # Chen et al. 2016: keep each block's input, recompute the block in backward
    # expect about one more forward: +33% of a forward+backward's 3 units
    ("full activation checkpointing",
     "activations ×{train_bench.full_actx} (block inputs only)",
     "+1 forward of every block",
     "×{train_bench.full_timex} step time (≈ +33% expected: one more forward)"),
    # k micro-batches of b/k: activations ÷k, the same gradient (tested equal)
    ("gradient accumulation ×4",
     "activations ×{train_bench.accum_actx}",
     "none (same math, tested equal)",
     "4 sequential micro-steps: ×{train_bench.accum_timex} step time"),
    # Micikevicius et al. 2022 (tensorwise), DeepSeek-V3 §3.3 (1×B tiles, B×B blocks)
    ("FP8 linears: tensorwise / V3 blocks (`{fp8.cmd}`)",
     "the linears' saved inputs at 1 B: activations ×{train_bench.fp8_actx} / "
     "×{train_bench.fp8block_actx} of fp32's; model state unchanged (fp32 masters)",
     "an amax and a cast per tensor per step: ×{train_bench.fp8_timex} / "
     "×{train_bench.fp8block_timex} fp32's step on this CPU (no fp8 units; H100: 2× bf16's "
     "matmul peak)",
     "loss at step 200: {fp8.loss} / {fp8_block.loss} vs bf16's {bf16_ref.loss} (val "
     "{fp8.val} / {fp8_block.val} vs {bf16_ref.val})"),
    # one all-reduce of the gradients: a ring sends 2Ψ(N−1)/N bytes per rank
    # every rank holds everything: the baseline the ZeRO rows divide
    ("DDP, N=2 (`{dp.cmd}`)",
     "none: {dp.ddp_state}/rank",
     "all-reduce 2Ψ(N−1)/N: {dp.ddp_sent} per step",
     "replicated state"),
    # Rajbhandari et al. 2020, P_os: optimizer state ÷N
    ("ZeRO-1, N=2",
     "optimizer state ÷N: {dp.zero1_state}/rank",
     "same bytes as DDP: {dp.zero1_sent} (reduce-scatter + all-gather)",
     "{dp.zero1_timex}× DDP's step time"),
    # P_os+g: + gradients ÷N (reduce-scatter instead of all-reduce)
    ("ZeRO-2, N=2",
     "+ gradients ÷N: {dp.zero2_state}/rank",
     "same bytes as DDP: {dp.zero2_sent}",
     "{dp.zero2_timex}× DDP's step time"),
    # P_os+g+p: + parameters ÷N, gathered per block in forward and backward
    # the extra Ψ(N−1)/N: parameters all-gathered again for backward
    ("ZeRO-3, N=2",
     "+ parameters ÷N: {dp.zero3_state}/rank",
     "3Ψ(N−1)/N: {dp.zero3_sent} per step (+50%)",
     "all-gather on the critical path of every block: {dp.zero3_timex}× DDP's; "
     "hand ZeRO-3 / FSDP2 = {dp.zero3_fsdp}"),
    # column- then row-parallel matmuls: f (identity fwd, all-reduce bwd) and g (the reverse)
    # activations shrink less than ÷2: norms, residual and embeddings stay whole
    ("tensor parallelism, t=2 (`{tp.cmd}`)",
     "model state ÷2: {tp.state}/rank; activations {tp.act} vs {tp.act_one} in one process",
     "4 all-reduces of b·s·h per layer (+ embedding, head, the loss): {tp.sent} per step, "
     "on the critical path",
     "keep it inside a node; {tp.check} equal to one process"),
    # Korthikanti et al. 2022: the regions tp leaves whole are split along the sequence
    ("+ sequence parallelism (`{sp.cmd}`)",
     "activations {sp.act} vs {tp.act} with tp alone ({sp.act_one} in one process)",
     "same wire bytes as tp; {sp.gathers} all-gathers per step rebuild saved inputs",
     "norm-weight gradients summed over tp each step; {sp.check} equal to one process"),
    # Liu et al. 2023 (ring attention); zigzag chunks balance the causal work
    ("context parallelism, c=2 (`{cp.cmd}`, zigzag)",
     "activations {cp.act} vs {cp.act_one} (half the tokens per rank)",
     "the ring: {cp.kv_sent} of K and V sent per step; gradients all-reduced over cp "
     "({cp.grads})",
     "model state replicated; {cp.check} equal to one process"),
    # GShard / Switch: each rank holds E/ep experts; tokens travel to their experts
    ("expert parallelism, e=2 (`{ep.cmd}`)",
     "expert weights ÷2: state {ep.state}/rank (one process: params {ep.one})",
     "2 all-to-alls forward + 2 backward per MoE layer: {ep.a2a} payload per step",
     "dropless: imbalanced routing means imbalanced ranks; {ep.check} equal to one process"),
    # DeepSeekMoE (Dai et al. 2024): many narrow experts + always-on shared ones
    ("fine-grained + shared experts (`{v3.cmd}`)",
     "{v3.active} parameters active per token",
     "under `--ep` each token's top-k copies go through the all-to-all",
     "every expert held in memory; the busiest expert gets {v3.busiest}× the mean tokens"),
    # Wang et al. 2024: a per-expert bias, moved by γ·sign(mean − load), routes around
    # the overloaded experts without a loss term pulling on the model
    ("auxiliary-loss-free balancing (v3 vs `--moe-balance aux --moe-aux-coef 0.01`)", "—",
     "a bias update after each step: nothing on the wire under `--ep`",
     "busiest expert {v3.busiest}× the mean over the run, {v3.busiest_last}× over its last 40 "
     "steps, vs {v3_aux.busiest}× / {v3_aux.busiest_last}× with the Switch aux loss (the bias "
     "needs steps to catch up); val {v3.val} vs {v3_aux.val} (one seed)"),
    # the planner's arithmetic on DeepSeek-V3's published shape (V3 report §3)
    ("the planner with MoE + MLA (`parallel.py plan`, DeepSeek-V3's shape, 2,048 × 80 GB)",
     "picks {plan.layout} at {plan.per_gpu}/GPU ({plan.psi} / {plan.active} active from the "
     "shape)",
     "the all-to-all: {plan.a2a_vs_dp}× the data-parallel traffic per step",
     "EP 64 and V3's byte recipe (2, 6, 8) are inputs; the MTP module is not counted"),
    # bubble fraction (P−1)/(M+P−1) with M microbatches on P stages
    # 1F1B holds P microbatches' activations at most, GPipe all M
    ("pipeline, 1F1B (`{pipeline.cmd}`)",
     "weights, grads, Adam ÷P; activations: up to P microbatches in flight (GPipe: M)",
     "one activation and one gradient per microbatch per boundary: {pipeline.1f1b_p2p} "
     "sent per rank",
     "bubble: GPipe {pipeline.gpipe_bubble}, 1F1B {pipeline.1f1b_bubble} "
     "(theory {pipeline.1f1b_theory})"),
    # B split into dX (on the critical path) and W (deferred into the bubble)
    ("zero-bubble ZB-H1 / DualPipeV",
     "— / DualPipeV: 2 half-stages per rank",
     "W's dW = dYᵀX matmuls run apart from dX (X, dY kept until then)",
     "bubble {pipeline.zb_bubble} / {pipeline.dualpipev_bubble} vs 1F1B's "
     "{pipeline.1f1b_bubble}"),
    # state per parameter: momentum 1 buffer, RMSProp 1, Adam 2
    ("SGD / momentum / RMSProp vs Adam (`{optim_bench.cmd}`)",
     "8 / 4 / 4 B/param less optimizer state",
     "elementwise only",
     "one lr for every coordinate (SGD, momentum), no bias correction (RMSProp)"),
    # Jordan et al. 2024: orthogonalised momentum via a quintic Newton–Schulz iteration
    # the Newton–Schulz cost ≈ 5·d/tokens of the step: large at d = 192, small at scale
    ("Muon hybrid (`{optim.cmd}`)",
     "momentum only on hidden matrices: 4 instead of 8 B/param there",
     "Newton–Schulz: {optim_bench.ns_share} of step FLOPs here (< 1% at scale); optimizer "
     "step {optim_bench.muon_ms} vs {optim_bench.adamw_ms} ms",
     "needs whole matrices (ZeRO must shard by matrix); {optim.speedup} fewer tokens than "
     "AdamW to val loss {optim.target}"),
    # Muon under ZeRO: Newton–Schulz needs whole matrices, so each goes to one owner
    ("Muon on sharded state, ZeRO-2 N=2 (`{muon_zero.cmd}`)",
     "momentum ÷N like Adam's moments: optimizer state {muon_zero.state}/rank",
     "two bf16 all-to-alls (to the owners, back): {muon_zero.a2a}/step, "
     "≈ 2·2 B·Ψ_m(N−1)/N²",
     "Newton–Schulz split by matrix: {muon_zero.ns_share} of one process's FLOPs on rank 0; "
     "val loss {muon_zero.val}"),
    # Hu et al. 2021: W0 + (α/r)·BA, B = 0 at start; r(in+out) trainable per matrix
    # state = frozen base (4 B/param) + 16 B per trainable parameter
    ("LoRA r=8, all linears (`{lora.cmd}`)",
     "model state {lora.full_state} → {lora.lora_state} ({lora.lora_statex}×); trainable "
     "{lora.full_trainable} → {lora.lora_trainable}",
     "2 thin matmuls per layer: ×{lora.lora_timex} full's step",
     "ΔW of rank ≤ 8: answer loss {lora.lora_loss} vs full {lora.full_loss} (exact match "
     "{lora.lora_exact} vs {lora.full_exact})"),
    # Hayou et al. 2024: B's learning rate λ× A's
    ("LoRA+ λ=16", "as LoRA", "none",
     "one more hyper-parameter; answer loss {lora.loraplus_loss} vs LoRA's {lora.lora_loss}"),
    # Dettmers et al. 2023: 4 + 8/64 + 32/(64·256) bits/param with double quantization
    # the base stored in NF4; the adapters and their optimizer in fp32
    ("QLoRA (NF4 + double quant)",
     "block weights 32 → {lora.nf4_bits} bits/param; state {lora.qlora_statex}× full",
     "dequantize every weight in forward and backward: ×{lora.qlora_timex} full's step",
     "quantization error (max {lora.nf4_err}); answer loss {lora.qlora_loss}"),
    # Kopiczko et al. 2024: one frozen random pair shared by all layers, per-layer scaling vectors
    ("VeRA (shared r=64)",
     "trainable {lora.vera_trainable}",
     "elementwise scalings",
     "a random subspace: answer loss {lora.vera_loss}; activations ×{lora.vera_actx} full's"),
    # Liu et al. 2024: magnitude · direction, the direction's norm detached
    ("DoRA",
     "as LoRA + one float per output row: trainable {lora.dora_trainable}",
     "W0 + sBA and its row norms every step: ×{lora.dora_timex} full's step",
     "activations ×{lora.dora_actx} full's; answer loss {lora.dora_loss}"),
    # DeepSeek-V2: cache a d_c latent + a d_R rope key per token
    # GQA equivalent: the KV heads whose cache would be the same size
    ("multi-head latent attention (`{mla.cmd}`)",
     "KV {mla.mla_bytes} B/token vs MHA's {mla.mha_bytes} ({mla.less} less), GQA with 2 KV "
     "heads {mla.gqa_bytes}; measured = the formula (d_c + d_R)·L·bytes",
     "absorbed decode: the query through W_UK, the output through W_UV",
     "MLA without absorption (the training path): {mla.unabsorbed}× the absorbed decode "
     "step, same outputs"),
    # Kwon et al. 2023 (vLLM): fixed-size blocks, so waste < one block per sequence
    # a contiguous cache reserves the whole context per request
    ("paged KV cache, block 16 (`{serve.cmd}`)",
     "waste < 1 block per sequence (mean {serve.slots} unfilled slots) vs {serve.contig} for "
     "a contiguous full-context reservation",
     "a K/V gather through the block table per layer per step",
     "block tables to keep; greedy outputs = sequential generate() {serve.same}"),
    # Yu et al. 2022 (Orca): admit and retire sequences at every step
    ("continuous batching + chunked prefill",
     "no padding (static batching wastes {serve.static_waste} of its reservation)",
     "scheduling every step",
     "{serve.engine_speedup} sequential, static batching {serve.static_speedup} here"),
    # Kwon et al. 2023: when the pool runs out, free a sequence's blocks and recompute later
    ("recompute preemption (`{preempt.cmd}`)",
     "no up-front reservation: the small pool serves every request",
     "{preempt.engine_work} positions computed vs {preempt.needed} needed "
     "({preempt.preemptions} preemptions)",
     "latency of the preempted; outputs = generate()'s {preempt.same}"),
    # SGLang's RadixAttention / vLLM's automatic prefix caching, by block hash chains
    ("prefix caching (`{prefix.cmd}`)",
     "shared blocks stored once: {prefix.hits}",
     "a hash per full block, reference counts",
     "cached blocks hold the pool until evicted; {prefix.engine_work} positions computed "
     "vs {prefix.needed} needed"),
    # 2·L·H_kv·(D·1 + scale bytes) per token instead of 2·L·H_kv·D·4
    ("int8 KV cache (`{int8.cmd}`)",
     "{int8.per_token} vs {serve.per_token} per token (fp32)",
     "quantize on write, dequantize per layer per step",
     "rounding of K and V (its error bound: tests/test_kvcache.py); engine {int8.tok_s} "
     "tok/s"),
    # Willard & Louf 2023 (regular constraints as automata), xgrammar's per-state mask cache
    ("structured output: JSON schema, regex, choice (`{structured.cmd}`)",
     "every output parses and validates (asserted, tests/test_structured.py)",
     "a mask per step: {structured.hits} cache hits; a fresh mask {structured.mask_ms} vs a "
     "decode step {structured.decode_ms}",
     "engine tok/s ×{structured.ratio} of free text; a schema outside the subset is a 400"),
    # S-LoRA / Punica: the base matmul shared, each row's low-rank pair gathered (BGMV)
    ("{adapters.k} LoRA adapters in one batch, unmerged (`{adapters.cmd}`)",
     "one base for all: {adapters.memory} per rank-8 adapter ({adapters.share} of the base)",
     "two thin matmuls per layer and a gather of each row's pair",
     "engine tok/s ×{adapters.mixed} of the base's (one adapter merged: ×{adapters.merged}); "
     "each request equals its adapter merged, token for token"),
    # priority then earliest deadline first; goodput = requests that met their SLOs per second
    ("SLO-aware scheduling",
     "—", "none measurable",
     "goodput {serve.fcfs_goodput} → {serve.slo_goodput} req/s; batch requests wait longer"),
    # evicted blocks kept in host memory and reloaded on a prefix hit
    # what a larger pool would compute, at the cost of host memory and copies
    ("second KV tier, host memory (`{agent.cmd}`)",
     "prompt tokens computed {agent.computed_none} → {agent.computed_host} of "
     "{agent.prompt_none} ({agent.tier_hit_host} reloaded from the tier)",
     "a copy per evicted block out, and back on a hit",
     "host memory; TTFT p50/p99 {agent.ttft_none} → {agent.ttft_host} ms"),
    # send a request to the replica holding most of its prefix, within a load bound
    ("cache-aware routing (`{router.cmd}`, 4 replicas)",
     "prefix hit rate {router.cache_aware_hit} vs {router.round_robin_hit} round-robin, "
     "{router.least_loaded_hit} least-loaded (one shared cache: {router.cache_aware_one_cache})",
     "a hash chain per prompt, an index of every replica's blocks",
     "positions computed {router.cache_aware_computed} vs {router.round_robin_computed}; "
     "balance is a threshold to tune"),
    # Xiao et al. 2023: keep the first tokens' KV forever; re-rotate kept keys as the window slides
    # the reference is dense recompute: each token sees the full window, no cache
    ("attention sinks + window (`{streaming.cmd}`, {streaming.model}, a stream of "
     "{streaming.stream})",
     "KV bounded at {streaming.held} tokens: {streaming.bytes} vs {streaming.whole_bytes} "
     "for the whole stream",
     "re-rotating the kept keys when the window slides: {streaming.rerotated} key vectors "
     "per token",
     "mean loss {streaming.sinks} (sinks + window) vs {streaming.window} (window only) and "
     "{streaming.dense} (dense recompute)"),
    # Zhong et al. 2024 (DistServe): prefill and decode on separate ranks
    ("prefill/decode disaggregation, 1 + 1 ranks (`{disagg.cmd}`)",
     "decode tokens delayed by a prefill: {disagg.delayed} vs {disagg.delayed_colocated} "
     "in two colocated engines (the decode rank prefills only what it must recompute)",
     "the prompt's KV point-to-point: {disagg.kv} ({disagg.kv_measured} = the formula's "
     "{disagg.kv_formula})",
     "a fixed prefill:decode split; outputs = one engine's {disagg.same}"),
    # Leviathan et al. 2023 / Chen et al. 2023: exact, τ = (1−α^(γ+1))/(1−α) tokens per step
    # on CPU the drafter's cost c is large, so τ must be large to gain
    ("speculative sampling, draft model (`{spec.cmd}`)",
     "none; adds the drafter and its KV cache",
     "γ sequential drafter passes + one (γ+1)-token target pass per step",
     "{spec.draft_speedup} at T = 0 (α at T = 1: {spec.draft_alpha_t1}); a second model"),
    # SpecInfer / Medusa trees: several candidates per depth, verified in one pass
    ("draft tree (width 3)", "none", "the tree's tokens in one verification",
     "FLOPs on dead branches; {spec.tree_speedup} at T = 0"),
    # Cai et al. 2024: extra heads on the target's last hidden state
    ("Medusa heads", "none; adds heads (the drafters: {spec.drafters} in all)",
     "one batched head matmul per step",
     "α falls with depth ({spec.medusa_alpha_t1} at T = 1); {spec.medusa_speedup} at T = 0"),
    # Li et al. 2024: a one-block drafter on the target's features
    ("EAGLE-style drafter", "none; adds a one-block drafter + a KV cache",
     "γ one-block passes per step",
     "sequential drafting; {spec.eagle_speedup} at T = 0 (α {spec.eagle_alpha_t1} at T = 1)"),
    # a block drafter: all γ tokens in one pass
    ("DFlash-style block drafter", "none; adds a block drafter",
     "one pass per step whatever γ",
     "α {spec.dflash_alpha_t1} at T = 1: {spec.dflash_speedup} at T = 0"),
    # the rows a test proves (ASSERTED): what they save is what the test asserts
    ("hang watchdog (`train.py --timeout`, `--step-timeout`)",
     "a frozen rank is named and the job ends, not 30 silent minutes",
     "one store write per rank per second",
     "a rank slower than the timeout is killed; {asserted.watchdog}: "
     "`test_frozen_rank_is_named_and_the_restart_finishes`"),
    ("checkpoint generations (`--keep 2`)",
     "a corrupt newest checkpoint resumes from the previous one, same losses",
     "none", "K× the checkpoint's disk; {asserted.generations}"),
    ("graceful Ctrl-C (SIGINT / SIGTERM)", "the work since the last save",
     "the current step + one save", "the stop waits for the step; {asserted.sigint}"),
    ("one error line per job (torchrun)", "the line a late rank 0 used to lose",
     "a store round trip, on the error path only", "≤ 10 s wait there; {asserted.error_line}"),
    ("safe loading (`torch.load(weights_only=True)` everywhere)",
     "opening a file cannot run code (a malicious pickle at every entry point: nothing runs, "
     "one error line)", "none measurable",
     "an old pickled checkpoint needs one deliberate `python -m core.checkpoint convert`; "
     "{asserted.safe_loading}"),
    ("Hugging Face Llama export / import (`python -m core.checkpoint export`)",
     "the model goes to and comes from standard tools; round trip bit for bit",
     "q/k rows permuted (interleaved → rotate-half) on the way out and back",
     "no MoE or extra heads; {asserted.hf_round_trip}"),
    ("merge-and-unload (`lora.py eval --load A --export M`)",
     "no adapter matmuls at inference (the base model's cost)",
     "one fp32 W per adapted layer", "the adapter can no longer be swapped; {asserted.merge}"),
    ("per-sequence fault isolation (`serve.py`)", "one bad request costs only itself",
     "extra forwards, only on a failure", "nothing; {asserted.isolation}"),
    ("header/body deadlines + a connection cap that evicts (`serving/api_server.py`)",
     "hundreds of idle or trickling connections do not starve a request",
     "one thread per connection up to the cap", "slow clients are cut off; {asserted.deadlines}"),
    ("`n` through the prefix cache", "choices 2..n reuse the first choice's prompt blocks",
     "choices 2..n wait for one prefill", "their TTFT ≥ the first's; {asserted.n_choices}"),
    # round-to-nearest, one absmax scale per output row
    # bits/weight counts the scales: 8 + 32/in_features per weight
    ("RTN int8 per output row (`{quantize.cmd}`)",
     "linears 32 → {quantize.int8_bits} bits/weight; model {quantize.fp32_bytes} → "
     "{quantize.int8_bytes}",
     "a dequantization per matmul: decode ×{quantize.int8_decode}",
     "Δ loss {quantize.int8_dloss}, top-1 = fp32's {quantize.int8_top1}"),
    # groups of 32 weights share a scale: bits + 16/32 per weight
    ("RTN int4 / int3, groups of 32",
     "{quantize.int4_bits} / {quantize.int3_bits} bits/weight; {quantize.int4_bytes} / "
     "{quantize.int3_bytes}",
     "unpack + dequantize per matmul: decode ×{quantize.int4_decode} / "
     "×{quantize.int3_decode}",
     "Δ loss {quantize.int4_dloss} / {quantize.int3_dloss}; top-1 {quantize.int4_top1} / "
     "{quantize.int3_top1}"),
    # Frantar et al. 2023: quantize column by column, error fed back through the inverse Hessian
    # compare Δ loss with RTN's at the same bits: the error feedback is the difference
    ("GPTQ int3 (the authors' block-start group fit)", "as RTN",
     "calibration forwards, a Hessian + Cholesky per layer",
     "Δ loss {quantize.gptq3_dloss} vs RTN's {quantize.int3_dloss}; top-1 "
     "{quantize.gptq3_top1}, greedy agreement {quantize.gptq3_greedy}"),
    # Lin et al. 2024: scale salient input channels by s^α before quantizing
    ("AWQ int3 (llm-awq's module-output search)", "as RTN",
     "1 calibration forward + a 20-point α grid",
     "Δ loss {quantize.awq3_dloss}; top-1 {quantize.awq3_top1}"),
    # Xiao et al. 2023: move activation outliers into the weights (α = 0.5)
    ("SmoothQuant W8A8", "int8 weights, per-token int8 activations",
     "activation quantization per matmul: decode ×{quantize.sq_decode}",
     "Δ loss {quantize.sq_dloss}, greedy agreement {quantize.sq_greedy}"),
    # Jacob et al. 2018 (STE) / Esser et al. 2020 (LSQ): train through the rounding
    ("QAT int3, {quantize.qat_steps} steps (STE / LSQ)", "as PTQ",
     "fake-quant training steps",
     "Δ loss {quantize.qat_ste} / {quantize.qat_lsq} vs fp32 + the same steps then RTN "
     "{quantize.qat_base}"),
    # magnitude |W| vs Wanda |W|·‖X‖ (Sun et al. 2024); 2:4 = two of every four
    # 2:4 loses more than unstructured: the pattern is forced in every group of four
    ("pruning 50% unstructured / 2:4 (magnitude; Wanda)",
     "nothing as stored (dense here)", "Wanda: calibration forwards",
     "Δ loss {quantize.mag50_dloss} / {quantize.mag24_dloss} (magnitude), "
     "{quantize.wanda50_dloss} / {quantize.wanda24_dloss} (Wanda)"),
    # Schulman et al. 2017: clipped ratio, a learned value baseline, GAE
    # the critic is a second model: its state is the figure to read
    ("PPO, critic + GAE (`{rl.cmd}`)",
     "– (+{rl.critic_state} critic state: {rl.critic})",
     "critic forward/backward: {rl.ppo_vs_grpo}× GRPO's step",
     "most knobs; held-out greedy {rl.ppo_held_out}"),
    # Shao et al. 2024: the group's mean and std replace the critic
    # a group with equal rewards has zero advantage: its samples teach nothing
    ("GRPO", "the critic; keeps a frozen reference",
     "G samples per prompt, a reference forward per batch",
     "{rl.grpo_zero_var} of groups had equal rewards: sampled for nothing; held-out "
     "{rl.grpo_held_out}"),
    # Liu et al. 2025: no std division, a constant length normaliser
    ("Dr. GRPO", "as GRPO", "as GRPO: {rl.drgrpo_vs_grpo}× its step",
     "advantage scale follows the reward scale (no std division); held-out "
     "{rl.drgrpo_held_out}"),
    # Agarwal et al. 2024 / Lu et al. 2025: reverse KL on the student's own samples
    ("on-policy distillation", "no reward model, no critic; a frozen teacher",
     "student sampling + a teacher forward on every sampled token: {rl.distill_vs_grpo}× "
     "GRPO's step",
     "noisy sampled-token signal; needs the teacher's tokenizer; held-out "
     "{rl.distill_held_out}"),
    # Hinton et al. 2015 (τ) / Kim & Rush 2016 (teacher's sequences)
    ("soft-label / sequence-level KD", "no sampling / cheapest step",
     "teacher forward (full-vocabulary KL) / teacher generation: {rl.softkd_vs_grpo}× / "
     "{rl.seqkd_vs_grpo}× GRPO's step",
     "exposure bias; held-out {rl.softkd_held_out} / {rl.seqkd_held_out}"),
    # Hockney's α–β links, 6Ψ FLOPs at 0.75 of peak, the bubble, what overlaps
    # the published figures: Llama 3 (Dubey et al. 2024), DeepSeek-V3 (2024)
    ("step time and dollars from data sheets (`{cost.cmd}`; serving: `{cost_serving.cmd}`)",
     "—", "arithmetic: the planner's bytes priced by α–β links, its FLOPs at 0.75 of peak",
     "Llama 3 405B: MFU {cost.llama_mfu} predicted vs 41% published, {cost.llama_gpuh} "
     "GPU-hours (×{cost.llama_ratio} the published); DeepSeek-V3: {cost.v3_gpuh} H800-hours, "
     "${cost.v3_cost} (×{cost.v3_ratio}); decode on an H100 at $2/h: 7B ${cost_serving.b7_1} / "
     "${cost_serving.b7_256} per M tokens at batch 1 / 256, 70B ${cost_serving.b70_1} / "
     "${cost_serving.b70_256}"),
    # the sampler a serving engine on its own copy (verl, OpenRLHF, torchtitan's RL): the
    # prompt shared by a group's G answers is computed once; K = 2 trades staleness for overlap
    ("GRPO rollouts through the serving engine (`{rl_engine.cmd}`; K = 2: `{rl_offpolicy.cmd}`)",
     "the group's prompt computed once ({rl_engine.hits} of prompt tokens from the prefix "
     "cache); paged KV and continuous batching: {rl_engine.tok_s} sampled",
     "a sampler copy of the weights; a sync of {rl_engine.sync}/step in {rl_engine.sync_ms}; "
     "a no-grad forward for π_old",
     "generation {rl_engine.gen_share} of the step; mismatch KL {rl_engine.mismatch}/token "
     "on-policy, {rl_offpolicy.mismatch} at K = 2 (staleness {rl_offpolicy.staleness} "
     "steps); held-out {rl_engine.held_out} / {rl_offpolicy.held_out}"),
    # bits/byte = loss_nats · tokens / (bytes · ln 2)
    ("bits/byte instead of perplexity (`{ppl.cmd}`)",
     "—", "one forward over the text; the bootstrap only resamples",
     "none: comparable across tokenizers (perplexity {ppl.ppl} = {ppl.bpb} bits/byte, "
     "loss {ppl.loss} nats/token here)"),
    # the lm-eval-harness way: rank candidates by log-likelihood
    ("log-likelihood ranking (`{task.cmd}`)",
     "the prompt's K/V computed once and copied to each candidate ({task.cached_s} vs "
     "{task.rerun_s})",
     "one teacher-forced pass per candidate, no sampling",
     "measures preference among given answers: {task.rank} vs {task.gen} generative exact "
     "match"),
    # ECE = Σ_b (n_b/n)·|acc_b − conf_b| over equal-width bins
    # a single T cannot fix per-token and per-sequence calibration at once
    ("temperature scaling (`{calibration.cmd}`)",
     "—", "one scalar fitted on a dev split: T = {calibration.T}",
     "fixes one global scale: sequence ECE {calibration.seq_before} → "
     "{calibration.seq_after}, first-token ECE {calibration.first_before} → "
     "{calibration.first_after}; accuracy unchanged"),
    # Kuhn et al. 2023: cluster the K samples by meaning, entropy over the clusters
    ("sampled uncertainty (`{uncertainty.cmd}`)", "—", "K samples per question",
     "AUROC {uncertainty.consistency} (self-consistency) / {uncertainty.semantic} (semantic "
     "entropy) vs the free max-probability's {uncertainty.maxprob}"),
    # GPT-3 (Brown et al. 2020, app. C): an item is dirty if an n-gram of it is in training
    ("n-gram contamination check (`{contamination.cmd}`)", "—",
     "an n-gram index of the training data",
     "needs the data; n = {contamination.n}: precision {contamination.precision}, recall "
     "{contamination.recall}"),
    # Shi et al. 2024: the mean of the k% lowest token log-probs, from the model alone
    ("Min-K% Prob membership", "—", "one forward per item",
     "needs only the model; AUROC {contamination.mink} on the planted items"),
    # exact: SHA-256 of the normalised text; near: Broder 1997 MinHash + LSH banding
    ("exact dedup (`{dedup.cmd}`)", "{dedup.exact} ({dedup.exact_bytes})",
     "one SHA-256 per document",
     "nothing measurable"),
    ("near dedup, MinHash 5-gram shingles, 14 bands × 8", "{dedup.near} ({dedup.near_bytes})",
     "112 hashes per shingle",
     "pairs at Jaccard 0.7–0.8 detected {dedup.detected_78} (theory {dedup.theory_78}), "
     "0.8–0.9 {dedup.detected_89} ({dedup.theory_89})"),
    # Xie et al. 2023 (DoReMi) frame it: a mixture is a trade-off between domains
    ("mixture weights (`{sweep.cmd}`)", "—", "small domains repeated",
     "uniform vs natural, nats: headers {sweep.uniform_headers}, arith {sweep.uniform_arith}, "
     "tests {sweep.uniform_tests}, lib {sweep.uniform_lib} (another seed moves the mean "
     "{sweep.noise})"),
    # Rae et al. 2021 (Gopher), Chen et al. 2021 (Codex), Li et al. 2023 (StarCoder)
    ("quality rules, Gopher/Codex/StarCoder (`{curate.cmd}`)",
     "removes {curate.rules}",
     "per-document features",
     "written for web prose, they drop clean code"),
]


# ----------------------------------------------------------------------------------------


RUN_BY_NAME = {r.name: r for r in RUNS}
