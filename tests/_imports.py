"""Optional test dependencies: skipped when not installed, a failure when installed but broken.

torchaudio refuses to import beside a torch built for another CUDA version (a RuntimeError, not an
ImportError): such an environment must fail the tests loudly, not skip the checks that need it.
"""

import importlib
import importlib.util

import pytest


def require(module, extra):
    """Import ``module`` (a dotted name); skip if its package is not installed, fail if it cannot be imported."""
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[{extra}]'", allow_module_level=True)
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of an installed package is the message
        pytest.fail(
            f"{package} is installed but cannot be imported: {type(e).__name__}: {e}\n"
            f"Install a working set with pip install -e '.[{extra}]' (README: tested torch/torchaudio "
            f"pairs).",
            pytrace=False,
        )
