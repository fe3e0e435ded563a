"""mkdocs hook: the benchmarks' results page, their README and their chart, added to the site from benchmarks/,
where benchmarks/bench.py writes them and the tests read them (the site copies nothing by hand); the docs link
them by their paths in the repository, which the hook turns into the site's."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("benchmarks/RESULTS.md", "benchmarks/README.md", "benchmarks/results.png")
# links in those files that point outside benchmarks/, as the site names their targets
LINKS = {"](../DESIGN.md)": "](../design.md)"}


def on_files(files, config):
    for name in BENCHMARKS:
        files.append(File.generated(config, name, abs_src_path=str(ROOT / name)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in BENCHMARKS:
        for old, new in LINKS.items():
            markdown = markdown.replace(old, new)
    else:
        # the docs link benchmarks/ by its path in the repository (../benchmarks/ from docs/), which the site
        # holds inside docs/ (on_files)
        depth = page.file.src_uri.count("/")
        markdown = markdown.replace("](" + "../" * (depth + 1) + "benchmarks/", "](" + "../" * depth + "benchmarks/")
    return markdown
