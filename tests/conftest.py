# Shared by every test file: the repo root on sys.path (the scripts are flat modules),
# and the `slow` marker for tests that take more than a few seconds.
import glob
import os
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still run by default)")


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
