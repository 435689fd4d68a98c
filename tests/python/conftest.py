"""pytest configuration of tests/python: the moe_harness plugin (also registered by the package's
pytest11 entry point; naming it here keeps the suite working from a source tree on PYTHONPATH)
and the location of the moe-harness CLI for the golden-file round trips."""
import os
import shutil

import pytest

pytest_plugins = ["moe_harness.pytest"]
# test_golden.py is a script with its own ctest (python_golden), run as `python3 test_golden.py`.
collect_ignore = ["test_golden.py"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_cli():
    """$MOE_HARNESS_CLI, else moe-harness on PATH, else a build tree's (build*/moe-harness)."""
    cli = os.environ.get("MOE_HARNESS_CLI")
    if cli:
        return cli
    cli = shutil.which("moe-harness")
    if cli:
        return cli
    for d in sorted(os.listdir(REPO)):
        p = os.path.join(REPO, d, "moe-harness")
        if d.startswith("build") and os.access(p, os.X_OK):
            return p
    return None


@pytest.fixture(scope="session")
def cli():
    c = find_cli()
    if c is None:
        pytest.skip("no moe-harness CLI (set MOE_HARNESS_CLI)")
    return c
