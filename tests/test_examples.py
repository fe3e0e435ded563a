"""examples/: each script runs as a user runs it (offline, on the CPU, with this checkout's transducer) and fits its
batch: the loss it prints falls. Skipped where the example's library (transformers, NeMo) is not installed."""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _imports import require

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, cwd):
    """The losses an example prints ("step N: loss X"), run in ``cwd``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", p.stdout, re.MULTILINE)]


def test_transformers_example(tmp_path):
    require("transformers", "test")
    losses = run_example("transformers_parakeet.py", tmp_path)
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert not any(tmp_path.iterdir())  # it writes nothing


def test_nemo_example(tmp_path):
    try:  # the nemo-toolkit distribution, not an extract of its numba losses (test_nemo_cuda.py's peer)
        importlib.metadata.version("nemo-toolkit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nemo-toolkit is not installed: pip install -e '.[nemo]'")
    require("nemo.collections.asr", "nemo")
    losses = run_example("nemo_tdt.py", tmp_path)
    assert len(losses) == 4 and losses[-1] < 0.2 * losses[0], losses
    assert not any(tmp_path.iterdir())
