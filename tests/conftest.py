# Shared by every test file: the repo root on sys.path (the scripts are flat modules),
# the `slow` marker for tests that take more than a few seconds, and the skips of the GPU
# tiers (markers `gpu`: needs CUDA, `multigpu`: needs >= 2 CUDA devices; registered in
# pytest.ini). Where the hardware is missing those tests are skipped with the reason shown
# (-ra prints it), so a CPU-only CI runs what it ran before; `python -m pytest -m gpu`
# selects the GPU tier.
#
# Hermetic: the session runs in a temporary working folder, with the data cache
# (NANOSCALE_CACHE) and the usual cache homes pointed into it, so no test and no process a
# test starts reads or writes the reader's out/, the repo's .cache/ or ~/.cache. The repo's
# out/ and .cache/ are fingerprinted at the start and the end of the session; any change
# fails the run, naming the files.
import glob
import hashlib
import os
import sys
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


READER_FOLDERS = ("out", ".cache")          # the repo's folders the suite must not touch


def fingerprint(root=ROOT, folders=READER_FOLDERS):
    """{relative path: sha256} of every file under the reader's folders of the repo."""
    found = {}
    for folder in folders:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in names:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


def fingerprint_changes(before, after):
    """Sorted lines 'added|removed|changed PATH' between two fingerprints."""
    lines = [f"added {p}" for p in after.keys() - before.keys()]
    lines += [f"removed {p}" for p in before.keys() - after.keys()]
    lines += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(lines)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still run by default)")
    config.stash[READER_KEY] = fingerprint()


READER_KEY = pytest.StashKey[dict]()


def pytest_sessionfinish(session, exitstatus):
    changes = fingerprint_changes(session.config.stash[READER_KEY], fingerprint())
    if changes:
        print(f"\nthe suite touched the reader's folders ({', '.join(READER_FOLDERS)}):\n  "
              + "\n  ".join(changes[:20]), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def outside_the_repo(tmp_path_factory):
    """The whole session in a temporary working folder, caches pointed into it: default
    output paths such as out/ckpt.pt resolve there, for this process and every process a
    test starts (they inherit the folder and the environment)."""
    work = tmp_path_factory.mktemp("work")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("NANOSCALE_CACHE", str(work / ".cache" / "nanoscale"))
        mp.setenv("XDG_CACHE_HOME", str(work / ".cache"))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(work / ".cache" / "torchinductor"))
        mp.setenv("TRITON_CACHE_DIR", str(work / ".cache" / "triton"))
        yield work


@pytest.fixture(autouse=True)
def in_own_folder(outside_the_repo, tmp_path, monkeypatch):
    """Each test in a folder of its own (its tmp_path): two tests that both write the
    default out/ckpt.pt never meet."""
    monkeypatch.chdir(tmp_path)


def _missing_hardware():
    """-> (reason the gpu tier skips or None, reason the multigpu tier skips or None)."""
    import torch                      # here, not at import: collecting stays torch-free
    if not torch.cuda.is_available():
        why = (f"needs CUDA: torch {torch.__version__} sees no GPU"
               + ("" if torch.version.cuda else " (a CPU-only build: see docs/gpu.md)"))
        return why, why.replace("needs CUDA", "needs >= 2 GPUs")
    n = torch.cuda.device_count()
    return None, (f"needs >= 2 GPUs, found {n}" if n < 2 else None)


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if "gpu" in it.keywords or "multigpu" in it.keywords]
    if not marked:
        return
    no_gpu, no_multi = _missing_hardware()
    for item in marked:
        reason = no_multi if "multigpu" in item.keywords else no_gpu
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """~150 KB of real text (a few standard-library sources): enough to train `tiny` on in
    seconds; its tokenizer is trained once and cached."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    text, i = "", 0
    while len(text) < 150_000:
        text += open(files[i], encoding="utf-8").read()
        i += 1
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors run fastest on one thread: on a busy 2-core machine two spinning OpenMP
    threads make them many times slower. For a whole test module
    (`pytestmark = pytest.mark.usefixtures("one_thread")`); the setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
