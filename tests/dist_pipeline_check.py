"""Run under torchrun by tests/test_pipeline.py. For every schedule at the launched P, every
rank runs one step of pipeline.run_schedule and checks, against a single-process reference
computed right here (same seed, same microbatches, gradient accumulation), the loss (on the
rank holding the last stage) and the gradient of every parameter its stages hold; then that
a mistake raises UserError on every rank without hanging; then (with --bench) that
pipeline.py bench gives the same loss as torch.distributed.pipelining. Exits non-zero on
any mismatch.

    torchrun --nproc_per_node=P tests/dist_pipeline_check.py [--bench]
"""
import os
import sys

import torch
import torch.distributed as dist

from parallelism import pipeline
from model import GPT, get_config
from core.distributed import setup_runtime
from core.errors import UserError
from core.runtime import print0

SEQ, MB = 16, 2
rt = setup_runtime("cpu")
P, rank = rt.world_size, rt.rank
group = dist.new_group(list(range(P)))


def reference(cfg, xs, ys):
    """One process: the M microbatches with gradient accumulation (each loss / M)."""
    ref = GPT(cfg, seed=0)
    loss = 0.0
    for x, y in zip(xs, ys):
        _, l = ref(x, y)
        (l / len(xs)).backward()
        loss += l.item() / len(xs)
    return loss, dict(ref.named_parameters())


def run(schedule, M, n_layer, steps=1):
    cfg = get_config("tiny", n_layer=n_layer, block_size=32)
    data = torch.randint(0, cfg.vocab_size, (M, MB, SEQ + 1),
                         generator=torch.Generator().manual_seed(M))
    xs, ys = [d[:, :-1] for d in data], [d[:, 1:] for d in data]
    model = GPT(cfg, seed=0)
    n_stages = 2 * P if schedule == "dualpipev" else P
    owner = pipeline.stage_ranks(schedule, P)
    cos, sin = model.rope(torch.arange(SEQ))
    stages = {s: pipeline.Stage(model, s, n_stages, rng, pipeline.cross_entropy_loss, cos, sin)
              for s, rng in enumerate(pipeline.split_layers(n_layer, n_stages))
              if owner[s] == rank}
    actions = pipeline.build_schedule(schedule, P, M)[rank]
    store = pipeline.WeightGradStore()      # one for all the steps: count its jobs
    timeline = []
    for _ in range(steps):     # no zero_grad between steps: gradients must accumulate
        loss = pipeline.run_schedule(stages, actions, xs, ys, group, (MB, SEQ, cfg.n_embd),
                                     torch.float32, "cpu", timeline, weight_grads=store)
    ref_loss, ref_params = reference(cfg, xs, ys)
    label = f"{schedule} P={P} M={M} rank {rank}"
    holds_last = any(st.is_last for st in stages.values())
    assert (loss is not None) == holds_last, (label, loss)
    if holds_last:
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (label, loss, ref_loss)
    mine = {n: p for st in stages.values() for n, p in st.named_parameters()}
    for name, p in mine.items():
        want = steps * ref_params[name].grad
        err = (p.grad - want).abs().max().item()
        assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-7), (label, name, err)
    for name, p in model.named_parameters():          # nothing leaks outside our stages
        assert name in mine or p.grad is None, (label, name)
    everyone = [None] * P
    dist.all_gather_object(everyone, sorted(mine), group=group)
    assert set().union(*map(set, everyone)) == set(ref_params), label   # every param owned
    return loss, ref_loss, timeline, store


for schedule in pipeline.SCHEDULES:
    M = 2 * P if schedule == "dualpipev" else 2 * P + 1     # odd M: no lucky symmetry
    loss, ref_loss, timeline, store = run(schedule, M, n_layer=2 * P)
    jobs = store.deferred_jobs
    held, owed = pipeline.peak_in_flight(timeline)
    if schedule == "gpipe":
        assert held == M, (schedule, rank, held)
    if schedule in ("1f1b", "zb"):                    # 1F1B's bound: P - r microbatches
        assert held == P - rank, (schedule, rank, held)
    if schedule in ("zb", "dualpipev"):               # the W split really happened ...
        assert jobs > 0 and owed > 0, (schedule, rank, jobs, owed)
        assert not store.queue                        # ... and every W ran
    else:
        assert jobs == 0, (schedule, rank, jobs)
    dist.barrier()
    print0(f"CHECK {schedule} P={P} M={M}: loss {ref_loss:.6f} and every gradient match "
           f"one process (rank 0 held {held} microbatches, deferred {jobs} dW jobs)")

for schedule in ("1f1b", "zb"):                       # fewer microbatches than ranks
    run(schedule, max(P - 1, 1), n_layer=P)
    print0(f"CHECK {schedule} P={P} M={max(P - 1, 1)}: matches one process")
run("zb", 2 * P, n_layer=P, steps=2)                  # deferred W adds into existing .grad
print0(f"CHECK zb P={P}: two steps without zero_grad accumulate twice the gradient")

for what, call in [("layers", lambda: pipeline.split_layers(2 * P + 1, P)),
                   ("microbatches", lambda: pipeline.build_schedule("dualpipev", P, 2 * P - 1))]:
    try:
        call()
        raise AssertionError(f"no UserError for bad {what}")
    except UserError as e:
        message = str(e)
    dist.barrier()                                   # every rank got here: nobody hangs
    print0(f"CHECK bad {what}: UserError on every rank: {message}")

if "--bench" in sys.argv:
    results = pipeline.main(["bench", "--microbatches", str(2 * P), "--steps", "1",
                             "--seq-len", str(SEQ), "--microbatch-size", str(MB),
                             "--n-embd", "32", "--n-layer", str(2 * P),
                             "--vocab-size", str(get_config("tiny").vocab_size), "--device", "cpu"])
    for row in results:
        if row["torch_loss"] is not None:
            assert abs(row["hand_loss"] - row["torch_loss"]) <= 1e-5 * row["hand_loss"], row
        versus = "none" if row["torch_loss"] is None else f"{row['torch_loss']:.6f}"
        print0(f"CHECK bench {row['schedule']} P={P}: hand loss {row['hand_loss']:.6f} "
               f"torch {versus} {row['torch_note']}")

# Every check passed. Leave without tearing down (see tests/dist_train_check.py).
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
