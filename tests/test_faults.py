"""train.py under faults: bad input seen by a late rank 0, a frozen rank, stale / corrupt /
mixed checkpoints, Ctrl-C, read-only and full disks. Each fault must end in one line that
says what happened, and a resume must finish with the uninterrupted run's losses."""
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

from training import data_parallel
from training import resume as saved
import train
from harness import ROOT, python_cmd, run_python, torchrun, torchrun_cmd
from model import GPT, get_config


def tiny(text_file, ckpt, *extra):
    return ["--preset", "tiny", "--data", str(text_file), "--batch-size", "2", "--seq-len", "32",
            "--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--sample-tokens", "0", "--ckpt", str(ckpt), *map(str, extra)]


def error_lines(output):
    return [line for line in output.splitlines() if "error:" in line]


class Live:
    """A command whose output is read as it comes (to act on a line: SIGSTOP seen, a step
    logged), in a session of its own so a signal or a kill reaches every process."""

    def __init__(self, cmd, env=None):
        full = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **(env or {})}
        self.p = subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = []

    def until(self, text, timeout):
        """Read lines until one contains `text`; -> that line."""
        deadline = time.time() + timeout
        for line in self.p.stdout:
            self.lines.append(line)
            if text in line:
                return line
            if time.time() > deadline:
                break
        self.kill()
        raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(self.lines)}")

    def finish(self, timeout):
        try:
            rest, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{''.join(self.lines)}")
        self.lines.append(rest)
        return self.p.returncode, "".join(self.lines)

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def losses(ckpt):
    return torch.load(ckpt, weights_only=True)["history"]["loss"]


def same_losses(got, want):
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


# ----------------------------------------------------------------------------------------
# One process: resume flags, generations, mixed shards, Ctrl-C, disks

def test_resume_refuses_other_model_flags_in_one_line(text_file, tmp_path, capsys):
    ckpt = tmp_path / "c.pt"
    train.main(tiny(text_file, ckpt, "--steps", "2", "--save-interval", "2"))
    capsys.readouterr()
    for flags in (["--preset", "small"], ["--preset", "tiny", "--n-layer", "3"]):
        with pytest.raises(SystemExit) as e:
            train.run_cli(train.main, tiny(text_file, ckpt, "--steps", "4", "--resume")[2:] +
                          flags)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(error_lines(err)) == 1, err
        assert "holds another model" in err and "drop the model flags" in err
    # no model flags: the checkpoint's model (and name) continues
    hist = train.main(tiny(text_file, ckpt, "--steps", "4", "--resume")[2:])
    assert len(hist["loss"]) == 4 and "model tiny:" in capsys.readouterr().out


def test_corrupt_latest_falls_back_to_the_previous_generation(text_file, tmp_path, capsys):
    straight = train.main(tiny(text_file, tmp_path / "a.pt", "--steps", "6"))
    ckpt = tmp_path / "b.pt"
    train.main(tiny(text_file, ckpt, "--steps", "6", "--stop-after", "4", "--save-interval", "2"))
    assert torch.load(f"{ckpt}.1", weights_only=True)["step"] == 2       # --keep 2
    ckpt.write_bytes(ckpt.read_bytes()[:1000])                           # truncated
    capsys.readouterr()
    resumed = train.main(tiny(text_file, ckpt, "--steps", "6", "--resume", "--save-interval", "2"))
    out = capsys.readouterr().out
    assert "falling back to the previous checkpoint" in out and "(step 2)" in out, out
    assert resumed["loss"] == straight["loss"]
    # every generation unreadable: one line, no traceback
    for path in (ckpt, f"{ckpt}.1"):
        open(path, "w").write("not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.run_cli(train.main, tiny(text_file, ckpt, "--steps", "6", "--resume"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(error_lines(err)) == 1 and "no older checkpoint" in err


def test_a_shard_from_another_save_is_refused(tmp_path):
    """Two saves of a 1-rank ZeRO-1 layout; shard-0 of one copied into the other."""
    folders = [one_save(tmp_path, step) for step in (2, 4)]
    assert data_parallel.read_generation(folders[1])[0]["step"] == 4
    assert os.listdir(tmp_path / "step_2")      # kept: --keep 2
    os.replace(os.path.join(folders[0], "shard-0.pt"), os.path.join(folders[1], "shard-0.pt"))
    with pytest.raises(train.UserError, match="belongs to another save"):
        data_parallel.read_generation(folders[1])


def one_save(root, step=2, world=1):
    """A sharded save of a tiny model in a 1-rank ZeRO-1 layout (no process group needed);
    its meta has every key a resume reads (placeholders where this test needs none)."""
    from core.distributed import Runtime
    zero = data_parallel.ZeRO(GPT(get_config("tiny"), seed=step), 1, 0, 1)
    opt = torch.optim.AdamW(zero.optimizer_groups(0.1))
    meta = dict(world_size=world, step=step, save_id=f"run/step_{step}", run_id="run",
                config=asdict(get_config("tiny")), rng={}, tokenizer={}, history={},
                scaler={}, args={})
    return data_parallel.save_sharded_checkpoint(str(root), step, zero, opt, Runtime(), meta)


@pytest.mark.parametrize("damage,message", [
    ("truncated shard", "shard-0.pt is empty or truncated"),
    ("empty meta", "meta.pt is empty or truncated"),
    ("missing shard", "shard-1.pt' not found"),
    ("latest points nowhere", "step_9/meta.pt' not found"),
    ("bare tensor shard", "shard-0.pt is not a checkpoint shard of this repo"),
    ("text meta", "meta.pt is not a PyTorch checkpoint")])
def test_damaged_sharded_checkpoint_is_one_line_naming_the_file(tmp_path, damage, message):
    args = train.parse_args(["--dp", "zero1", "--resume", "--ckpt", str(tmp_path / "c.pt")])
    folder = one_save(tmp_path / "c_shards", world=2 if damage == "missing shard" else 1)
    shard, meta = os.path.join(folder, "shard-0.pt"), os.path.join(folder, "meta.pt")
    if damage == "truncated shard":
        open(shard, "r+b").truncate(0)
    elif damage == "empty meta":
        open(meta, "w").close()
    elif damage == "latest points nowhere":
        open(tmp_path / "c_shards" / "latest", "w").write("step_9")
        os.rename(folder, tmp_path / "moved")
    elif damage == "bare tensor shard":
        torch.save(torch.zeros(3), shard)
    elif damage == "text meta":
        open(meta, "w").write("hello")
    with pytest.raises(train.UserError) as e:
        saved.find_resume(args)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sharded_resume_falls_back_past_a_damaged_newest_save(tmp_path, capsys):
    args = train.parse_args(["--dp", "zero1", "--resume", "--ckpt", str(tmp_path / "c.pt")])
    older, newest = (one_save(tmp_path / "c_shards", step) for step in (2, 4))
    open(os.path.join(newest, "shard-0.pt"), "r+b").truncate(100)
    resume, full, where = saved.find_resume(args)
    assert where == older and resume["step"] == 2 and full
    out = capsys.readouterr().out
    assert "shard-0.pt" in out and "falling back to the previous checkpoint" in out, out


@pytest.mark.parametrize("content", ["text", "tensor", "folder"])
def test_wrong_file_as_resume_checkpoint_is_one_line(text_file, tmp_path, capsys, content):
    ckpt = tmp_path / "c.pt"
    if content == "text":
        ckpt.write_text("hello")
    elif content == "tensor":
        torch.save(torch.zeros(3), ckpt)
    else:
        ckpt.mkdir()
    with pytest.raises(SystemExit) as e:
        train.run_cli(train.main, tiny(text_file, ckpt, "--steps", "2", "--resume"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(error_lines(err)) == 1 and str(ckpt) in err, err
    assert "Traceback" not in err


def test_sigint_one_process_saves_and_resumes(text_file, tmp_path):
    ckpt = tmp_path / "i.pt"
    args = tiny(text_file, ckpt, "--steps", "40", "--save-interval", "100")
    ref = train.main(tiny(text_file, tmp_path / "ref.pt", "--steps", "40"))["loss"]
    live = Live(python_cmd("train.py", *args))
    live.until("step    3 |", timeout=120)
    os.killpg(live.p.pid, signal.SIGINT)
    status, out = live.finish(timeout=60)
    assert status == 130, out
    stops = [line for line in out.splitlines() if line.startswith("SIGINT: stopped after")]
    assert len(stops) == 1 and "--resume" in stops[0] and "Traceback" not in out, out
    step = int(stops[0].split("after step ")[1].split()[0])
    assert 3 <= step < 40 and torch.load(ckpt, weights_only=True)["step"] == step
    assert run_python("train.py", args + ["--resume"], timeout=180).returncode == 0
    same_losses(losses(ckpt), ref)




SECOND_SIGNAL = """
import os, signal, sys, time
from core.runtime import GracefulStop
with GracefulStop() as stop:
    os.kill(os.getpid(), signal.SIG{first})
    time.sleep(0.2)                      # handlers run between bytecodes
    print("requested", stop.signum, flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # torchrun's forward, milliseconds later: the same
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: out at once
    time.sleep(5)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("first", ["INT", "TERM"])
def test_second_signal_exits_at_once(first):
    """The first SIGINT / SIGTERM is only a request; a second SIGINT a second later exits
    130 at once, without saving."""
    r = subprocess.run([sys.executable, "-c", SECOND_SIGNAL.format(first=first)],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=60)
    number = int(getattr(signal, f"SIG{first}"))
    assert f"requested {number}" in r.stdout and "not reached" not in r.stdout, r.stdout
    assert r.returncode == 128 + int(signal.SIGINT) and "without saving" in r.stderr, r.stderr


def test_unwritable_output_fails_before_step_one(text_file, tmp_path, capsys):
    blocker = tmp_path / "a-file"            # a folder under a file: unwritable, even by root
    blocker.write_text("x")
    status, out = cli(capsys, tiny(text_file, blocker / "ckpt.pt", "--steps", "2"))
    assert status == 2 and len(error_lines(out)) == 1, out
    assert "cannot write checkpoints" in out and "step    1" not in out


def mount_tmpfs(path, size):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'})")


def cli(capsys, argv):
    """train.py through run_cli in this process: -> (exit status, stdout + stderr)."""
    with pytest.raises(SystemExit) as e:
        train.run_cli(train.main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_read_only_and_full_disks(text_file, tmp_path, capsys):
    """Needs `mount` (root, CAP_SYS_ADMIN): a read-only tmpfs, then one with room for one
    checkpoint and a half (the first save fits, the second does not)."""
    probe = tmp_path / "probe.pt"
    train.main(tiny(text_file, probe, "--steps", "1"))
    size = os.path.getsize(probe)
    disk = tmp_path / "disk"
    mount_tmpfs(disk, f"{(size * 3 // 2) // 4096 * 4096}")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        capsys.readouterr()
        status, out = cli(capsys, tiny(text_file, disk / "c.pt", "--steps", "2"))
        assert status == 2 and len(error_lines(out)) == 1, out
        assert "Read-only file system" in out and "step    1" not in out
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        args = tiny(text_file, disk / "c.pt", "--steps", "4", "--save-interval", "2")
        status, out = cli(capsys, args)
        assert status == 2 and len(error_lines(out)) == 1, out
        assert "no space left on device" in out and "Traceback" not in out
        assert sorted(os.listdir(disk)) == ["c.pt"]                 # no temporary files
        assert torch.load(disk / "c.pt", weights_only=True)["step"] == 2
        hist = train.main(args[:-2] + ["--save-interval", "0", "--resume"])
        assert len(hist["loss"]) == 4
    finally:
        subprocess.run(["umount", str(disk)])


# ----------------------------------------------------------------------------------------
# Under torchrun

def every_file(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, names in os.walk(folder) for f in names)


@pytest.mark.slow
def test_dp_read_only_and_full_disks(text_file, tmp_path):
    """--dp zero2 on 2 ranks. A read-only disk, a missing folder on it, a file where the
    folder should be: one `error:` line, every rank exits 2, no step runs. A disk that
    fills during the second save: one line, the failed save leaves no file at all (not a
    shard, not a temporary file), and `latest` and the export stay on the first save."""
    probe = tmp_path / "probe" / "c.pt"
    r = torchrun("train.py", tiny(text_file, probe, "--steps", "2", "--dp", "zero2",
                                  "--save-interval", "2"), nproc=2)
    assert r.returncode == 0, r.output
    one_save = sum(os.path.getsize(probe.parent / f) for f in every_file(probe.parent)
                   if not f.endswith(".svg"))
    disk = tmp_path / "disk"
    mount_tmpfs(disk, f"{(one_save * 3 // 2) // 4096 * 4096 + 4096}")
    (disk / "afile").write_text("not a folder")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for ckpt, why in ((disk / "c.pt", "Read-only file system"),
                          (disk / "new" / "c.pt", "Read-only file system"),
                          (disk / "afile" / "c.pt", "is a file, not a folder")):
            r = torchrun("train.py", tiny(text_file, ckpt, "--steps", "2", "--dp", "zero2"),
                         nproc=2)
            assert r.returncode != 0 and r.output.count("exitcode  : 2") == 2, r.output
            assert len(error_lines(r.output)) == 1 and why in r.output, r.output
            assert "step    1 |" not in r.output
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        ckpt = disk / "c.pt"
        r = torchrun("train.py", tiny(text_file, ckpt, "--steps", "4", "--dp", "zero2",
                                      "--save-interval", "2"), nproc=2)
        assert r.returncode != 0 and "saved step 2" in r.output, r.output
        lines = error_lines(r.output)
        assert len(lines) == 1 and "no space left on device" in lines[0], r.output
        shards = disk / "c_shards"
        # exactly the first save's files (and the file planted above); not one byte of the
        # second (the loss curve, written only by a run that finishes, is not a save's)
        saved_files = [f for f in every_file(disk) if not f.endswith(".svg")]
        assert saved_files == ["afile", "c.pt", "c_shards/latest", "c_shards/step_2/meta.pt",
                               "c_shards/step_2/shard-0.pt", "c_shards/step_2/shard-1.pt"], \
            every_file(disk)
        assert (shards / "latest").read_text() == "step_2"
        assert torch.load(ckpt, weights_only=True)["step"] == 2
    finally:
        subprocess.run(["umount", str(disk)])

@pytest.mark.slow
def test_one_error_line_when_rank0_is_late(text_file, tmp_path):
    late = {"NANOSCALE_TEST_DELAY_RANK0": "2"}
    common = tiny(text_file, tmp_path / "none.pt", "--steps", "2")
    for bad, message in ((["--dp", "zero1", "--resume"], "no sharded checkpoint"),
                         (["--dp", "zero4"], "invalid choice: 'zero4'")):
        r = torchrun("train.py", common + bad, nproc=2, timeout=120, env=late)
        assert r.returncode != 0 and "exitcode  : 2" in r.output, r.output
        lines = error_lines(r.output)
        assert len(lines) == 1 and message in lines[0], r.output


@pytest.fixture(scope="module")
def zero1_reference(text_file, tmp_path_factory):
    """The uninterrupted run the interrupted ones must end like: 2 ranks, zero1, 30 steps."""
    ref = tmp_path_factory.mktemp("ref") / "ref.pt"
    r = torchrun("train.py", tiny(text_file, ref, "--steps", "30", "--dp", "zero1"), nproc=2)
    assert r.returncode == 0, r.output
    return losses(ref)


@pytest.mark.slow
def test_frozen_rank_is_named_and_the_restart_finishes(text_file, tmp_path, zero1_reference):
    """Two-phase hang detection: start-up waits --timeout (120 s here), every step after the
    first waits --step-timeout (6 s): the frozen rank is named within 6 s + slack, which
    only the second phase can do."""
    args = ["train.py", *tiny(text_file, tmp_path / "h.pt", "--steps", "30", "--dp", "zero1",
                              "--save-interval", "2", "--timeout", "120",
                              "--step-timeout", "6")]
    live = Live(torchrun_cmd(2, *args, "--hang-at-step", "3", extra=["--max-restarts=1"]))
    pid = int(live.until("stopping itself at step 3", timeout=120).split("pid ")[1].split(")")[0])
    t0 = time.time()
    line = live.until("no answer within the timeout", timeout=60)
    detected = time.time() - t0
    os.kill(pid, signal.SIGKILL)        # torchrun itself would SIGKILL it only after 30 s
    status, out = live.finish(timeout=180)
    assert "rank 0:" in line and "rank 1 (no heartbeat" in line, line
    assert re.search(r"in (all_reduce|reduce_scatter|all_gather|barrier) \(world\)", line), line
    assert detected < 6 + 10, detected
    assert status == 0 and "restart 1: resuming from the last checkpoint" in out, out
    same_losses(losses(tmp_path / "h.pt"), zero1_reference)


def test_a_slow_save_does_not_look_like_a_frozen_peer(text_file, tmp_path):
    """--step-timeout 2, but the last rank's every save takes 3 s longer (--save-delay):
    saves wait the start-up --timeout (distributed.long_phase), so the run finishes."""
    ckpt = tmp_path / "slow.pt"
    r = torchrun("train.py", tiny(text_file, ckpt, "--steps", "4", "--dp", "zero1",
                                  "--save-interval", "2", "--timeout", "60",
                                  "--step-timeout", "2", "--save-delay", "3"), nproc=2)
    assert r.returncode == 0, r.output
    assert "a collective waits 2 s for a silent peer" in r.output, r.output
    assert r.output.count("saved step") == 2


@pytest.fixture(scope="module")
def older_bytes(text_file, tmp_path_factory):
    """A finished 2-step tiny run under torchrun: its checkpoint's bytes (made once; each
    test copies them to its own path)."""
    ckpt = tmp_path_factory.mktemp("older") / "s.pt"
    old = torchrun("train.py", tiny(text_file, ckpt, "--steps", "2", "--save-interval", "2"),
                   nproc=1)
    assert old.returncode == 0, old.output
    return ckpt.read_bytes()


@pytest.mark.slow
def test_a_refusal_survives_a_restart(text_file, tmp_path, older_bytes):
    """Another model's flags in a folder holding an older run's checkpoint: refused on the
    first attempt, and refused again on torchrun's restart -- which used to train the new
    model over the old checkpoint and exit 0. The old file is byte for byte unchanged, no
    step ran, and the output says why on each attempt."""
    ckpt = tmp_path / "s.pt"
    ckpt.write_bytes(older_bytes)
    new = torchrun("train.py", tiny(text_file, ckpt, "--steps", "3", "--n-layer", "1",
                                    "--save-interval", "3"),
                   nproc=1, extra=["--max-restarts=1"])
    assert new.returncode != 0, new.output
    assert "holds another model" in new.output, new.output                  # attempt 0
    assert "restart 1:" in new.output and "never writes over it" in new.output  # attempt 1
    assert new.output.count("exitcode  : 2") >= 1 and "step    1 |" not in new.output
    assert ckpt.read_bytes() == older_bytes


def test_a_restart_never_writes_over_a_checkpoint_its_launch_did_not_create(
        text_file, tmp_path, older_bytes):
    """A finished run of the SAME model may be trained again by a fresh run -- but if that
    run crashes before its first save, its restart finds no save of its own launch there
    and refuses to write over the older run's file (--overwrite would allow it)."""
    ckpt = tmp_path / "s.pt"
    ckpt.write_bytes(older_bytes)
    new = torchrun("train.py", tiny(text_file, ckpt, "--steps", "4", "--save-interval", "3",
                                    "--crash-at-step", "1"), nproc=1, extra=["--max-restarts=1"])
    assert new.returncode != 0 and "never writes over it" in new.output, new.output
    assert ckpt.read_bytes() == older_bytes


@pytest.mark.slow
def test_sigint_two_ranks_saves_and_resumes(text_file, tmp_path, zero1_reference):
    ckpt = tmp_path / "t.pt"
    args = tiny(text_file, ckpt, "--steps", "30", "--dp", "zero1", "--save-interval", "100")
    live = Live(torchrun_cmd(2, "train.py", *args))
    live.until("step    3 |", timeout=120)
    os.killpg(live.p.pid, signal.SIGINT)          # as a terminal's Ctrl-C: every process
    status, out = live.finish(timeout=90)
    stops = [line for line in out.splitlines() if line.startswith("SIGINT: stopped after")]
    # (torchrun prints its own SignalException traceback; none may come from a rank)
    assert len(stops) == 1 and 'train.py", line' not in out, out
    step = int(stops[0].split("after step ")[1].split()[0])
    assert torch.load(ckpt, weights_only=True)["step"] == step
    r = torchrun("train.py", args + ["--resume"], nproc=2)
    assert r.returncode == 0, r.output
    same_losses(losses(ckpt), zero1_reference)


def test_a_fresh_run_refuses_to_write_over_another_run(tmp_path):
    """resume.check_overwrite: another configuration, an unfinished run, or a file that is
    not a checkpoint are refused in one line naming the way out; a finished run of the
    same configuration, a missing file and --overwrite are not."""
    import argparse
    from core.errors import UserError
    path = str(tmp_path / "ckpt.pt")
    tiny = asdict(get_config("tiny"))
    args = argparse.Namespace(ckpt=path, overwrite=False)
    saved.check_overwrite(args, tiny)                        # nothing there yet
    finished = dict(config=tiny, step=100, args=dict(preset="tiny", steps=100))
    torch.save(finished, path)
    saved.check_overwrite(args, tiny)                        # same model, finished
    with pytest.raises(UserError, match=r"another model .*n_layer.*--resume continues it"):
        saved.check_overwrite(args, {**tiny, "n_layer": 3})
    torch.save({**finished, "step": 40}, path)
    with pytest.raises(UserError, match="unfinished run .*step 40 of 100"):
        saved.check_overwrite(args, tiny)
    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(UserError, match="not a checkpoint of this repo"):
        saved.check_overwrite(args, tiny)
    saved.check_overwrite(argparse.Namespace(ckpt=path, overwrite=True), tiny)
