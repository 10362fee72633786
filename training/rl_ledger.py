"""
training/rl_ledger.py -- the ledger `python rl.py compare` prints: per algorithm what it holds
besides the policy (π_ref, a teacher, PPO's critic), its state and activation bytes, the
seconds of each phase (generation, scoring, training, the critic) and their ratio to GRPO's
step, the tokens it sampled, and what it changed (reward, held-out accuracy, answer length,
KL, the share of clipped tokens, GRPO's zero-variance groups); for the distilled students,
how close each came to the teacher (KL in both directions, greedy agreement) and exposure
bias (exact match continuing from its own first token vs from the data's).

rl.py holds the algorithms, the loop that trains with them and the measurements of the
distilled students (rl.distill_metrics); this file only lays out the tables, so the loop
reads without a screen of column formatting. It imports no topic: rl.py imports it.
"""
from core.cli import fmt_bytes, fmt_count
from core.runtime import print0

RL_COLUMNS = ("algo", "extra held", "state", "act", "gen s", "score s", "train s", "critic s",
              "×ref", "tok samp", "reward", "held-out greedy", "held-out sampled",
              "length", "KL", "clip", "zero-var")
RL_WIDTHS = (9, 24, 9, 9, 6, 7, 7, 8, 6, 8, 11, 15, 16, 11, 7, 6, 8)
DISTILL_COLUMNS = ("student", "KL direction", "trains on", "stud tok", "teach tok", "held-out",
                   "rev KL", "fwd KL", "own start", "data start", "other split", "agree")
DISTILL_WIDTHS = (9, 20, 16, 8, 9, 8, 7, 7, 9, 10, 11, 6)


DISTILL_ROW = {"distill": ("reverse KL(s‖t), k1", "its own samples"),
               "softkd": ("forward KL(t‖s), τ", "ground truth"),
               "seqkd": ("forward KL (CE)", "teacher samples")}


def first_last(xs, k=5):
    """Means of the first and the last k entries (k at most half of them)."""
    k = max(1, min(k, len(xs) // 2))
    return sum(xs[:k]) / k, sum(xs[-k:]) / k


def print_table(cols, widths, rows):
    for r in (cols, *rows):
        print0(" ".join(f"{v:>{n}}" for v, n in zip(r, widths)))


def step_seconds(r):
    return r["gen"] + r["score"] + r["train"] + r["critic"]


def rl_row(r, ref):
    """One algorithm's cells, first -> last for what its training changed."""
    r0, r1 = first_last(r["reward"])
    l0, l1 = first_last(r["length"])
    s = r["start"]
    e = r["end"]
    held = " + ".join(f"{n} {fmt_bytes(b)}" for n, b in r["held"]) or "-"
    seconds = [f"{r[k]:.1f}" for k in ("gen", "score", "train", "critic")]
    ratio = step_seconds(r) / step_seconds(ref)
    kl = f"{first_last(r['kl'])[1]:.3f}" if r["kl"] else "-"
    clip = f"{sum(r['clip']) / len(r['clip']):.1%}" if r["clip"] else "-"
    zero_var = f"{r['zero_var'] / r['groups']:.0%}" if r["groups"] else "-"
    return (r["algo"], held, fmt_bytes(r["state"]), fmt_bytes(r["act"] + r["critic_act"]),
            *seconds, f"{ratio:.2f}", fmt_count(r["sampled"]),
            f"{r0:.2f}→{r1:.2f}",
            f"{s['greedy']:.0%}→{e['greedy']:.0%}",
            f"{s['sampled']:.0%}→{e['sampled']:.0%}",
            f"{l0:.2f}→{l1:.2f}", kl, clip, zero_var)


def print_rl_table(rows):
    ref = next((r for r in rows if r["algo"] == "grpo"), rows[0])
    columns = tuple(f"×{ref['algo']}" if c == "×ref" else c for c in RL_COLUMNS)
    print_table(columns, RL_WIDTHS, [rl_row(r, ref) for r in rows])
    for r in rows:
        if r["critic_params"]:
            share = r["critic_params"] / r["params"]
            print0(f"PPO's critic: +{fmt_count(r['critic_params'])} parameters ({share:.0%} of "
                   f"the policy's), +{fmt_bytes(r['critic_state'])} state")
        if r["algo"] in ("grpo", "drgrpo"):
            a, b = first_last(r["length"])
            c, d = first_last(r["len_wrong"])
            print0(f"{r['algo']}: answer length {a:.2f}→{b:.2f} tokens, wrong answers only "
                   f"{c:.2f}→{d:.2f} (first→last 5 steps)")


def print_distill_table(rows):
    """rows: (name, KL direction, trains on, student tokens, teacher tokens, held-out
    accuracy, distill_metrics' dict)."""
    cells = []
    for name, kl, on, st, tt, acc, d in rows:
        cells.append((name, kl, on, fmt_count(st), fmt_count(tt), f"{acc:.0%}",
                      f"{d['rev_kl']:.3f}", f"{d['fwd_kl']:.3f}",
                      f"{d['own']:.1%}", f"{d['data']:.1%}",
                      f"{d['split']:.1%}", f"{d['agree']:.0%}"))
    print_table(DISTILL_COLUMNS, DISTILL_WIDTHS, cells)
    print0("rev/fwd KL per token on the student's/teacher's samples; own/data start: exact match"
           " continuing from its own right first token / the data's; own < data: exposure bias")


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nrl_ledger.py runs as part of `python rl.py compare` (see its --help).")


def print_engine_line(r, steps):
    """What rollouts through the serving engine cost and gave (rl.py --rollout engine): the
    sampled tokens per second of generation, generation's share of the step, the prompt
    tokens the prefix cache served (a group's G answers share one prompt), the weight sync
    per step, the sampler/trainer mismatch KL(μ‖π_old) and the mean staleness. With a
    sampler rank (--rollout-rank) the trainers only WAIT for batches: that wait is shown,
    and the sampler rank prints its own tokens and prefix hits."""
    stats = r["engine"]                 # None: the engine is another rank's
    share = r["gen"] / step_seconds(r)
    if stats is not None:
        hits = stats["cached_tokens"] / max(stats["prompt_tokens"], 1)
        source = (f"{r['sampled'] / r['gen']:.0f} tok/s sampled | generation {share:.0%} of "
                  f"the time | prefix-cache hits {hits:.0%} of prompt tokens")
    else:
        source = f"waited {r['gen']:.1f} s for the sampler rank's batches ({share:.0%} of the time)"
    mismatch = sum(r["mismatch"]) / max(len(r["mismatch"]), 1)
    print0(f"{r['algo']} engine rollouts: {source} | sync "
           f"{fmt_bytes(r['sync_bytes'] / steps)} in {1e3 * r['sync_s'] / steps:.2f} ms per "
           f"step | mismatch KL(μ‖π_old) {mismatch:.2e}/token | staleness "
           f"{sum(r['staleness']) / steps:.2f} steps")
