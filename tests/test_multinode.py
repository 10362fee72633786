"""Multi-node data parallelism on one machine (docs/data_parallel.md, "Multi-node"). Two
torchrun agents, each a "node" of one rank on loopback, train `train.py --dp zero2` and must
equal the one-node run of two ranks to the last bit: the same global batch, the same ranks
doing the same arithmetic, only the rendezvous differs. Launched as a reader types it on
two machines (static rendezvous: --node-rank, --master-addr) and through the Slurm batch
script (scripts/slurm_train.sh: c10d rendezvous), with stand-ins for srun and scontrol
that start the "nodes" here. All launches run side by side: eleven processes, ~19 s of CPU
in all, mostly their start-up (import torch), so ~10 s on 2 idle cores.
"""
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from training import data_parallel
from training import resume as saved
import train
from harness import ROOT, free_ports, run_together, torchrun_cmd, torchrun_node_cmd

SCRIPT = os.path.join(ROOT, "scripts", "slurm_train.sh")
DOC = os.path.join(ROOT, "docs", "data_parallel.md")
STEPS = 3

# Stand-ins for Slurm on this machine. srun: its own options skipped, the command started
# once per node of the allocation (SLURM_NNODES), all at once, and the worst exit status
# returned, as srun does. scontrol: every node of the allocation is this machine.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = "#!/bin/bash\necho 127.0.0.1\n"
# torchrun as the script calls it, but with this interpreter and its packages (harness.py)
FAKE_TORCHRUN = f'#!/bin/bash\nexec "{sys.executable}" -m torch.distributed.run "$@"\n'


def tiny(text_file, ckpt):
    return ["--dp", "zero2", "--preset", "tiny", "--data", text_file, "--steps", STEPS,
            "--log-interval", "1", "--eval-iters", "1", "--sample-tokens", "0",
            "--ckpt", ckpt]


def static_nodes(port, run_id, args):
    """The two-node command of docs/data_parallel.md, one per "node", on loopback."""
    return [torchrun_node_cmd(["--nnodes", 2, "--node-rank", rank, "--nproc-per-node", 1,
                               "--master-addr", "127.0.0.1", "--master-port", port,
                               "--rdzv-id", run_id], "train.py", *args)
            for rank in (0, 1)]


def slurm_job(tmp_path, port, job_id, args):
    """-> (argv, env) of the batch script as a 2-node allocation of one rank per node would
    run it: Slurm's variables set, the stand-ins (written to tmp_path/bin) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("torchrun", FAKE_TORCHRUN)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": job_id,
           "SLURM_SUBMIT_DIR": ROOT, "SLURM_CPUS_PER_TASK": "1", "NPROC_PER_NODE": "1",
           "MASTER_PORT": str(port)}
    return ["bash", SCRIPT, *map(str, args)], env


def losses(output):
    """The per-step losses rank 0 printed (`step N | loss X`), in order."""
    return re.findall(r"^step +\d+ \| loss (\S+)", output, flags=re.MULTILINE)


def saved_state(ckpt):
    """What a --dp run left under --ckpt, read as a resume reads it: the single-file export
    (weights, loss history, run id) and the last save's shards of every rank, assembled into
    whole flat tensors (parameters and Adam moments)."""
    export = torch.load(ckpt, weights_only=True)
    folder = data_parallel.generations(saved.shards_dir(train.parse_args(["--ckpt", ckpt])))[0]
    meta, full = data_parallel.read_generation(folder)
    return export, meta, full


def assert_same_state(got, want, where):
    (export, meta, full), (export0, meta0, full0) = got, want
    assert export["model"].keys() == export0["model"].keys(), where
    for name, w in export0["model"].items():
        assert torch.equal(export["model"][name], w), f"{where}: weight {name} differs"
    assert export["history"] == export0["history"], where
    assert meta["step"] == STEPS and meta["world_size"] == 2, where
    assert full.keys() == full0.keys(), where
    for name, f0 in full0.items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full[name][key], f0[key]), f"{where}: shard {name}.{key} differs"


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_the_one_node_run(text_file, tmp_path):
    one, two, job = (str(tmp_path / d / "ckpt.pt") for d in ("one", "two", "slurm"))
    static_port, slurm_port = free_ports(2)
    script_cmd, script_env = slurm_job(tmp_path, slurm_port, "4242", tiny(text_file, job))
    # side by side, one environment: torchrun and train.py read none of Slurm's variables,
    # and the stand-ins on PATH are found by the batch script only (the others name
    # their interpreter)
    ref, node0, node1, slurm = run_together(
        [torchrun_cmd(2, "train.py", *tiny(text_file, one)),
         *static_nodes(static_port, "two-nodes", tiny(text_file, two)), script_cmd],
        timeout=240, env=script_env)
    for name, result in (("one node", ref), ("node 0", node0), ("node 1", node1),
                         ("slurm_train.sh", slurm)):
        assert result.returncode == 0, f"{name}:\n{result.output[-3000:]}"
    want = losses(ref.output)
    assert len(want) == STEPS, ref.output
    # the rank-0 lines: node 0's agent under --node-rank 0; under c10d whichever agent won
    assert losses(node0.output) == want and losses(node1.output) == []
    assert losses(slurm.output) == want, slurm.output[-3000:]
    reference = saved_state(one)
    for ckpt, run_id in ((two, "two-nodes"), (job, "4242")):
        got = saved_state(ckpt)
        assert_same_state(got, reference, ckpt)
        # --rdzv-id is the run id every save records (a restart adopts only its own)
        assert got[0]["run_id"] == run_id and got[1]["run_id"] == run_id


def test_slurm_script_is_valid_bash_and_the_docs_show_it_verbatim():
    result = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = open(SCRIPT, encoding="utf-8").read()
    lines = text.splitlines()
    # sbatch reads #SBATCH lines only before the first command
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.lstrip().startswith("#"))
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    for option in ("--nodes", "--ntasks-per-node=1", "--gpus-per-node"):
        assert any(lines[i].split()[1].startswith(option) for i in directives), option
    # the train.py flags the script passes (before the user's "$@") all exist
    tail = text[text.index("/train.py\"") + len("/train.py\""):].split('"$@"')[0]
    argv = [a.strip('"') for a in tail.split()]
    args = train.parse_args(argv)
    assert args.dp == "zero2"
    doc = open(DOC, encoding="utf-8").read()
    assert "## Multi-node" in doc
    assert f"```bash\n{text}```" in doc, "docs/data_parallel.md: show slurm_train.sh as it is"


def test_a_launch_without_a_run_id_does_not_claim_another_launchs_saves(monkeypatch):
    """A static multi-node launch without --rdzv-id gets torchrun's default run id "none"
    in every launch: it must not count as a launch identity (a restart would adopt
    another launch's save), nor become the run's id (every such run would share it)."""
    for value, want in (("none", None), (None, None), ("job-7", "job-7")):
        if value is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
        assert saved.launch_id() == want
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert saved.identity(types.SimpleNamespace(run_id="r1"), 3)["launch_id"] is None
