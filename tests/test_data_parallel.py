"""train.py --dp: hand DDP and ZeRO-1/2/3 (and FSDP2) against one process, in real torchrun
processes on the CPU. The checks themselves live in dist_train_check.py (each rank asserts);
here we launch it and read the verdicts. One launch per group of checks: 2 and 4 ranks
take seconds just to start."""
import pytest

from harness import python_cmd, run_together, torchrun, torchrun_cmd
from model import GPT, get_config
from training.data_parallel import ZeRO

CHECK = "tests/dist_train_check.py"
MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def test_sharded_muon_equals_whole_matrix_muon_bit_for_bit(tmp_path):
    """optim.ShardedMuonAdamW on 2 ranks, matrices cut into uneven pieces: each matrix
    gathered at its owner, orthogonalised, its update sent back == one process's Muon on
    the whole matrices, bit for bit (N = 4 in the test below)."""
    result = torchrun(CHECK, ["muon-exact", tmp_path, "-"], nproc=2, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert "CHECK sharded Muon N=2 == whole-matrix Muon, bit for bit" in result.output


@pytest.mark.slow
def test_two_then_four_ranks_equal_one_process_and_reshard_two_to_four(text_file, tmp_path):
    """AdamW and Muon (its matrices gathered to owners for Newton–Schulz) in every mode."""
    result = torchrun(CHECK, ["equivalence", tmp_path, text_file], nproc=2, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    for optimizer in ("adamw", "muon"):
        for mode in MODES:
            assert (f"CHECK {optimizer} {mode} N=2: losses, weights, state and bytes sent "
                    "match") in result.output
    # 4 ranks, one launch: every mode against one process, then the zero2 checkpoints the
    # 2 ranks wrote after 3 steps, resumed by 4 ranks (AdamW in 3 modes, Muon in zero3)
    result = torchrun(CHECK, ["muon-exact,equivalence,reshard", tmp_path, text_file], nproc=4,
                      timeout=500)
    assert result.returncode == 0, result.output[-4000:]
    assert "CHECK sharded Muon N=4 == whole-matrix Muon, bit for bit" in result.output
    for optimizer in ("adamw", "muon"):
        for mode in MODES:
            assert (f"CHECK {optimizer} {mode} N=4: losses, weights, state and bytes sent "
                    "match") in result.output
    for label, mode in [("half", "ddp"), ("half", "zero1"), ("half", "zero3"),
                        ("muon-half", "zero3")]:
        assert (f"CHECK {label} zero2 N=2 -> {mode} N=4: resumed losses and weights "
                "match") in result.output


@pytest.mark.slow
def test_crash_restart_resume_finishes_like_the_uninterrupted_run(text_file, tmp_path):
    result = torchrun(CHECK, ["crash", tmp_path, text_file], nproc=2, timeout=300,
                      extra=["--max-restarts=1"])
    assert result.returncode == 0, result.output[-4000:]
    assert "crashing on purpose at step 3" in result.output
    assert "restart 1: resuming from the last checkpoint" in result.output
    assert "CHECK crash at step 3, restart, resume from step 2" in result.output


@pytest.mark.slow
def test_bad_input_one_message_all_ranks_exit(text_file, tmp_path):
    common = ["--preset", "tiny", "--data", text_file, "--steps", "2", "--sample-tokens", "0"]
    # (--resume with no sharded checkpoint, under torchrun: test_faults.py, rank 0 late)
    no_mode, zero4, alone = run_together([torchrun_cmd(2, "train.py", *common),
                                          python_cmd("train.py", *common, "--dp", "zero4"),
                                          python_cmd("train.py", *common, "--dp", "zero2")],
                                         timeout=120)
    assert no_mode.output.count("error: 2 processes but no --dp mode") == 1, no_mode.output
    assert zero4.returncode == 2 and "invalid choice: 'zero4'" in zero4.output
    assert alone.returncode == 2 and "launch with torchrun" in alone.output
    # a checkpoint trained on another corpus: refused, not silently continued
    ckpt = tmp_path / "run" / "ckpt.pt"
    result = torchrun("train.py", common + ["--dp", "zero2", "--ckpt", ckpt,
                                            "--save-interval", "1"], nproc=2, timeout=120)
    assert result.returncode == 0, result.output
    other = tmp_path / "other.txt"
    other.write_text(open(text_file, encoding="utf-8").read()[::-1], encoding="utf-8")
    result = torchrun("train.py", ["--preset", "tiny", "--data", other, "--steps", "4",
                                   "--dp", "zero2", "--ckpt", ckpt, "--resume"], nproc=2,
                      timeout=120)
    assert result.returncode != 0
    assert result.output.count("trained on another corpus") == 1, result.output


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_decays_the_pieces_of_matrices_only(stage):
    """Every flat piece ZeRO hands the optimizer is 1-D, so its weight-decay group must come
    from the parameter it belongs to (its matrix decays, a norm's gain does not) -- the
    2-rank equivalence test cannot see decay switched off: 5 steps move weights ~2e-5."""
    model = GPT(get_config("tiny"), seed=0)
    zero = ZeRO(model, stage, rank=0, world=1)
    decayed, plain = zero.optimizer_groups(0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert sum(t.numel() for t in decayed["params"]) == matrices
    assert sum(t.numel() for t in plain["params"]) == model.num_params() - matrices
