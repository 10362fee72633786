# Shared by every test file: the repo root on sys.path (the scripts are flat modules),
# and the `slow` marker for tests that take more than a few seconds.
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still run by default)")
