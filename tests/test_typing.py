"""Static tools see the public API: mypy flags a misspelled keyword in a call of every public function and module
(transducer's ``__all__`` and the integrations' public callables), as it would in a user's code. Skipped where mypy
is not installed (the ``test`` extra brings it)."""

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import transducer

ROOT = Path(__file__).resolve().parent.parent
INTEGRATIONS = ("transformers", "nemo", "espnet", "speechbrain")


def _public_callables():
    """(import line, name, callable) of every public function and class of transducer and its integrations."""
    import importlib

    out = [(f"from transducer import {name}", name, getattr(transducer, name)) for name in transducer.__all__]
    for module_name in INTEGRATIONS:
        module = importlib.import_module(f"transducer.integrations.{module_name}")
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):
                alias = f"{module_name}_{name}"
                out.append((f"from transducer.integrations.{module_name} import {name} as {alias}", alias, obj))
    return out


def _takes_any_keyword(obj):
    function = obj.__init__ if inspect.isclass(obj) else obj
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def _call(alias, obj):
    """A call of ``obj`` with its required arguments (None) and one misspelled keyword."""
    function = obj.__init__ if inspect.isclass(obj) else obj
    params = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    args = ", ".join(f"{p.name}=None" for p in required)
    misspelled = (params[-1].name if params else "value") + "x"
    return f"{alias}({args}{', ' if args else ''}{misspelled}=None)"


def test_mypy_flags_a_misspelled_keyword_of_every_public_entry(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (the test extra brings it)")
    # a callable that takes **kwargs (transformers' loss functions: the model passes them keywords of its own)
    # accepts any keyword
    entries = [e for e in _public_callables() if not _takes_any_keyword(e[2])]
    assert len(entries) >= 15
    calls = [_call(alias, obj) for _, alias, obj in entries]
    source = "\n".join(line for line, _, _ in entries) + "\n\n" + "\n".join(calls) + "\n"
    path = tmp_path / "calls.py"
    path.write_text(source)
    first_call = source[: source.index(calls[0])].count("\n") + 1
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    flagged = {
        int(m.group(1)) for m in re.finditer(r"calls\.py:(\d+): error: Unexpected keyword argument", result.stdout)
    }
    missed = [calls[i] for i in range(len(calls)) if first_call + i not in flagged]
    assert not missed, textwrap.dedent(f"""mypy did not flag these calls' misspelled keywords: {missed}
        {result.stdout}{result.stderr}""")
