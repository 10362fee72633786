"""Run under torchrun by tests/test_parallel.py: one launch trains several layouts of the
same world size with parallel.py --check, so every step is compared with one process on
the same global batch (loss, every gradient, every weight) and every collective's calls
and bytes with the formulas; parallel.py raises on any mismatch. Each finished layout
prints "LAYOUT OK <flags>".

    torchrun --nproc_per_node=N tests/dist_parallel_check.py N DATA
"""
import os
import sys

import torch

import parallel
from core.distributed import setup_runtime
from core.errors import UserError
from core.runtime import print0

COMMON = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--steps", "2",
          "--warmup-steps", "1", "--check"]
MHA4 = ["--n-head", "4", "--n-kv-head", "4"]          # 4 KV heads: tp=4 needs them
# DeepSeek-V3's MoE: a shared expert, sigmoid affinities, the loss-free bias (γ large enough
# that step 2 routes differently from step 1); --check also compares loads and bias (and,
# with --n-extra-heads, the MTP head on the last pipeline stage)
V3 = ["--n-expert", "4", "--n-shared-expert", "1", "--moe-score", "sigmoid", "--moe-balance",
      "loss_free", "--moe-bias-rate", "0.05"]
LAYOUTS = {
    2: [["--dp", "2"], ["--tp", "2"], ["--tp", "2", "--sp"], ["--cp", "2"],
        ["--cp", "2", "--cp-layout", "plain"], ["--ep", "2", "--n-expert", "4"],
        ["--ep", "2", *V3]],
    4: [["--tp", "4", *MHA4], ["--tp", "4", "--sp", *MHA4], ["--cp", "4"],
        ["--cp", "4", "--cp-layout", "plain"], ["--tp", "2", "--cp", "2"],
        ["--tp", "2", "--cp", "2", "--sp"],
        # 8 tokens × top-2 over 8 experts: some expert receives no token
        ["--ep", "4", "--n-expert", "8", "--seq-len", "2"],
        ["--dp", "2", "--ep", "2", "--n-expert", "4"], ["--cp", "2", "--ep", "2", "--n-expert", "4"],
        ["--dp", "2", "--ep", "2", *V3],
        # experts inside a V-shaped pipeline: the balance loss joins each stage's backward
        ["--pp", "2", "--ep", "2", "--n-expert", "4", "--n-layer", "4", "--schedule", "dualpipev",
         "--microbatches", "4", "--batch-size", "8"],
        # ... with the bias: some rank's experts all go idle, its backward must still
        # join both all-to-alls
        ["--pp", "2", "--ep", "2", *V3, "--n-layer", "4", "--schedule", "dualpipev",
         "--microbatches", "4", "--batch-size", "8", "--n-extra-heads", "1"]],
    8: [["--dp", "2", "--pp", "2", "--tp", "2", "--steps", "3", "--microbatches", "2",
         "--n-layer", "4"],
        ["--pp", "2", "--cp", "2", "--tp", "2", "--sp", "--schedule", "zb", "--microbatches", "2",
         "--n-layer", "4"]],
}
# bad layouts: every rank raises the same UserError before any collective
BAD = {2: [["--tp", "4"], ["--tp", "2", "--n-kv-head", "1"], ["--cp", "2", "--seq-len", "30"],
           ["--ep", "2", "--n-expert", "3"], ["--pp", "2", "--n-layer", "3"]]}



def main(world, data_path):
    common = COMMON + ["--data", data_path]
    rt = setup_runtime("cpu")
    for flags in LAYOUTS[world]:
        result = parallel.train(parallel.parse_args(common + flags), rt)
        print0("LAYOUT OK " + " ".join(flags))
        print0(f"MEMORY {' '.join(flags)} | activations {result['activation_bytes']} | "
               f"state {result['state_bytes']}")
    for flags in BAD.get(world, []):
        try:
            parallel.train(parallel.parse_args(common + flags), rt)
        except UserError as e:
            print0(f"REFUSED {' '.join(flags)}: {e}")
        else:
            raise AssertionError(f"{flags} should have been refused")
    if world == 2:
        parallel.bench_tp(parallel.parse_args(["bench-tp"] + [f for f in common if f != "--check"]), rt)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)   # skip interpreter teardown (see runtime.run_cli)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
