"""The README's usage block runs as written."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def usage_block():
    text = README.read_text()
    section = text[text.index("## Usage"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_usage_block_runs(monkeypatch):
    """Every label the block draws at its largest value (torch.randint's high - 1), the case that reaches the
    columns next to the blanks; and as drawn."""
    code = usage_block()
    assert "multiblank_loss" in code and "tdt_loss" in code and "FusedJoinerLoss" in code
    torch.manual_seed(0)
    exec(compile(code, str(README), "exec"), {})
    monkeypatch.setattr(torch, "randint", lambda low, high, size, **kw: torch.full(size, high - 1, dtype=torch.long))
    exec(compile(code, str(README), "exec"), {})
