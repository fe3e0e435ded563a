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


def _readme_signatures():
    """(name, arguments text) of each signature line of the README's API section: an indented ``name(...)``
    (continued on more deeply indented lines); ``...`` in it stands for arguments the line leaves out."""
    text = README.read_text()
    section = text[text.index("## API"):text.index("## Results")]
    out = []
    for block in re.findall(r"(?:^    .*\n)+", section, re.M):
        for line in re.sub(r"\n {5,}", " ", block).splitlines():
            call = re.match(r"    (\w+)\(", line)
            if not call:
                continue
            depth, start = 0, call.end()
            for i, c in enumerate(line[start - 1:], start - 1):
                depth += {"(": 1, ")": -1}.get(c, 0)
                if depth == 0:
                    out.append((call.group(1), line[start:i]))
                    break
    return out


def test_readme_signatures_are_the_real_ones():
    """Every argument a README signature line names exists, with that default, in the function's or module's real
    signature (the declarations make them: transducer/options.py), the positional ones in the same order."""
    import inspect
    import transducer
    seen = set()
    for name, args in _readme_signatures():
        if not hasattr(transducer, name):
            continue
        params = inspect.signature(getattr(transducer, name)).parameters
        order = list(params)
        last, keyword_only = -1, False
        for arg in (a.strip() for a in re.sub(r"\s+", " ", args).split(",")):
            keyword_only |= arg == "*"
            if arg in ("*", "") or arg.startswith("..."):
                continue
            arg_name, _, default = arg.partition("=")
            assert arg_name in params, f"{name}: README names {arg_name}, not an argument"
            if default:
                assert repr(params[arg_name].default) == repr(eval(default)), f"{name}: {arg_name}={default}"
            if not keyword_only:
                assert params[arg_name].kind != inspect.Parameter.KEYWORD_ONLY, f"{name}: {arg_name} is keyword-only"
                assert order.index(arg_name) > last, f"{name}: {arg_name} out of order"
                last = order.index(arg_name)
        seen.add(name)
    assert {"transducer_loss", "rnnt_loss", "tdt_loss", "multiblank_loss", "fused_joiner_loss",
            "FusedJoinerLoss"} <= seen
