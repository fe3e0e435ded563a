"""The README's usage block runs as written (and the k2 page's example), its links and commands hold, .ci/run runs
its test command, and the docs' API reference names every public name (mkdocs build --strict checks the docs' own
links)."""

import re
import shlex
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def usage_block(path=README):
    text = path.read_text()
    section = text[text.index("## Usage") :]
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


def test_getting_started_shows_the_readme_usage_block():
    """The docs' usage example is the README's, which the test above runs."""
    assert usage_block(DOCS / "getting-started.md") == usage_block()


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path = link.split("#")[0]
        assert (ROOT / path).exists(), f"README links to {link}, which does not exist"


def _commands(text):
    """The README's shell commands: its indented lines outside fences, continuation lines joined."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    block = "\n".join(line[4:] for line in text.splitlines() if line.startswith("    "))
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_commands_parse():
    commands = _commands(README.read_text())
    assert any("pip install -e . pytest" in c for c in commands)
    for command in commands:
        shlex.split(command)
        subprocess.run(["bash", "-n", "-c", command], check=True)


def test_ci_runs_the_readme_test_command():
    """.ci/run's install and test command is the README's, word for word, with its own environment name, and
    docs/getting-started.md shows the same command and installs the same extras in its CPU-only variant."""
    ci = _normalise((ROOT / ".ci" / "run").read_text().replace("\\\n", " "))
    tests = [c for c in _commands(README.read_text()) if "python -m pytest -q" in c and ".[test," in c]
    assert len(tests) == 1
    assert _normalise(tests[0]) in ci.splitlines()
    assert ".venv-test" in tests[0]
    assert "mkdocs build --strict" in ci
    text = (DOCS / "getting-started.md").read_text()
    guide = [c for c in _commands(text) if ".venv-test" in c and "python -m pytest -q" in c]
    assert [_normalise(c) for c in guide] == [_normalise(tests[0])], "docs/getting-started.md's full test install"
    extras = re.findall(r'"\.\[(test,recipes[^\]]*)\]"', text)
    assert len(extras) == 2 and set(extras) == set(re.findall(r'"\.\[([^\]]*)\]"', tests[0])), extras


def _normalise(text):
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_setups_use_their_own_environments():
    """The set-up commands make environments of different names, so that none reuses another."""
    venvs = [
        re.search(r"python3 -m venv (\S+)", c).group(1)
        for c in _commands(README.read_text())
        if c.startswith("python3 -m venv")
    ]
    assert len(venvs) >= 3 and len(set(venvs)) == len(venvs)


def test_api_reference_names_every_public_name():
    """Every name of the public modules' ``__all__`` (transducer's, the integrations', ragged's, ops') has its
    ``:::`` entry in docs/api/, so the generated reference covers the public API."""
    import importlib

    text = "".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    entries = set(re.findall(r"^::: ([\w.]+)", text, re.M))
    for module in (
        "transducer",
        "transducer.integrations.transformers",
        "transducer.integrations.nemo",
        "transducer.integrations.espnet",
        "transducer.integrations.speechbrain",
        "ragged",
        "ops",
    ):
        for name in importlib.import_module(module).__all__:
            # a function named as its submodule (transducer.pack, ops.gather) is entered by its submodule's path
            assert {f"{module}.{name}", f"{module}.{name}.{name}"} & entries, (
                f"docs/api/ has no ::: entry for {module}.{name}"
            )


def test_k2_page_fuses_icefalls_joiner():
    """docs/switching/k2.md's example, run on a joiner of icefall's shape (a ragged batch with U_b = 0 and
    T_b = 1, labels padded with -1), is transducer_loss over that joiner's logits."""
    from torch import nn

    from transducer import transducer_loss

    class Joiner(nn.Module):
        def __init__(self, encoder_dim, decoder_dim, joiner_dim, vocab_size):
            super().__init__()
            self.encoder_proj = nn.Linear(encoder_dim, joiner_dim)
            self.decoder_proj = nn.Linear(decoder_dim, joiner_dim)
            self.output_linear = nn.Linear(joiner_dim, vocab_size)

        def forward(self, encoder_out, decoder_out):
            hidden = self.encoder_proj(encoder_out)[:, :, None] + self.decoder_proj(decoder_out)[:, None]
            return self.output_linear(torch.tanh(hidden))

    torch.manual_seed(0)
    joiner, decoder = Joiner(6, 5, 8, 11).double(), nn.Embedding(11, 5).double()
    x_lens, y_lens = torch.tensor([7, 5, 1]), torch.tensor([4, 2, 0])
    y_padded = torch.full((3, 4), -1)
    for b, n in enumerate(y_lens.tolist()):
        y_padded[b, :n] = torch.randint(1, 11, (n,))
    sos_y_padded = torch.cat([torch.zeros(3, 1, dtype=torch.long), y_padded.clamp(min=0)], 1)
    encoder_out = torch.randn(3, 7, 6, dtype=torch.double)
    scope = dict(joiner=joiner, decoder=decoder, encoder_out=encoder_out, sos_y_padded=sos_y_padded, blank_id=0)
    scope.update(y_padded=y_padded, x_lens=x_lens, y_lens=y_lens)
    path = DOCS / "switching" / "k2.md"
    exec(compile(re.search(r"```python\n(.*?)```", path.read_text(), re.S).group(1), str(path), "exec"), scope)
    logits = joiner(encoder_out, decoder(sos_y_padded))
    want = transducer_loss(logits, y_padded, x_lens, y_lens, blank=0, reduction="sum")
    torch.testing.assert_close(scope["loss"], want, rtol=1e-12, atol=1e-12)
    assert want.item() > 1.0


def test_docs_links_resolve_in_the_repository():
    """The docs' relative links name files of the repository, so that they hold where the pages are read
    unbuilt (docs/hooks.py turns those into benchmarks/ into the site's)."""
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) > 10
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link) or link.startswith("#"):
                continue
            target = (page.parent / link.split("#")[0]).resolve()
            assert target.exists(), f"{page.relative_to(ROOT)} links to {link}, which does not exist"
