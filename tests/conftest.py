# Shared by every test file: the repo root on sys.path (the scripts are flat modules),
# the `slow` marker for tests that take more than a few seconds, and the skips of the GPU
# tiers (markers `gpu`: needs CUDA, `multigpu`: needs >= 2 CUDA devices; registered in
# pytest.ini). Where the hardware is missing those tests are skipped with the reason shown
# (-ra prints it), so a CPU-only CI runs what it ran before; `python -m pytest -m gpu`
# selects the GPU tier.
import glob
import os
import sys
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still run by default)")


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
