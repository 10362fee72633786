"""
The suite never touches the reader's folders (tests/conftest.py moves every test into a
folder of its own and points the caches there; tests/harness.py finds scripts in the repo
but runs them in that folder). Proven on the case that broke it: a torchrun worker that
trains with the default `--ckpt out/ckpt.pt`.
"""
import os

from conftest import fingerprint, fingerprint_changes
from harness import ROOT, torchrun


def test_a_worker_with_default_paths_writes_outside_the_repo(text_file, tmp_path):
    before = fingerprint()
    assert not str(tmp_path).startswith(ROOT + os.sep), "the test folder is inside the repo"
    assert os.getcwd() == str(tmp_path)
    # no --ckpt: the default out/ckpt.pt, relative to the working folder
    args = ["--preset", "tiny", "--data", text_file, "--steps", "2", "--batch-size", "2",
            "--seq-len", "32", "--eval-iters", "1", "--sample-tokens", "0", "--dp", "ddp"]
    result = torchrun("train.py", args, nproc=2, timeout=180)
    assert result.returncode == 0, result.output
    assert (tmp_path / "out" / "ckpt.pt").is_file(), "the worker wrote its checkpoint elsewhere"
    assert fingerprint_changes(before, fingerprint()) == []
    assert os.environ["NANOSCALE_CACHE"].startswith(os.path.dirname(str(tmp_path)))


def test_fingerprint_sees_every_kind_of_change(tmp_path):
    """The session-end check would notice: a file added, removed or changed."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.pt").write_bytes(b"one")
    (tmp_path / "out" / "b.pt").write_bytes(b"two")
    before = fingerprint(str(tmp_path))
    (tmp_path / "out" / "a.pt").write_bytes(b"ONE")
    (tmp_path / "out" / "b.pt").unlink()
    (tmp_path / "out" / "c.pt").write_bytes(b"three")
    assert fingerprint_changes(before, fingerprint(str(tmp_path))) == [
        "added out/c.pt", "changed out/a.pt", "removed out/b.pt"]
