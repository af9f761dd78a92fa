"""Every python code block of README.md and docs/**/*.md runs (blocks of a file share one namespace)."""

from __future__ import annotations

import glob
import os
import re
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]


def python_blocks(path):
    text = open(path, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(f, ROOT) for f in FILES])
def test_code_blocks_run(path, tmp_path, monkeypatch):
    """The blocks run in one real module (registered in sys.modules, as Dynamo's tracing of a
    torch.compile'd function imports its globals' module by ``__name__`` on older torch),
    each block from a real .py file named after the page and the block (tracebacks and
    ``inspect`` find its lines)."""
    blocks = python_blocks(path)
    if not blocks:
        pytest.skip("no python blocks")
    stem = re.sub(r"\W", "_", os.path.relpath(path, ROOT))
    module = types.ModuleType(f"{stem}_blocks")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    files = tmp_path / "blocks"
    files.mkdir()
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(blocks):
        file = files / f"{stem}_block{i}.py"
        file.write_text(block, encoding="utf-8")
        code = compile(block, str(file), "exec")
        exec(code, module.__dict__)  # noqa: S102 - the docs are ours


def test_every_docs_page_has_a_runnable_example_or_is_reference():
    pages_without = [f for f in FILES if not python_blocks(f) and not f.endswith(("benchmarks.md", "install.md"))]
    assert not pages_without, pages_without


def test_examples_run():
    import runpy
    import sys

    argv = sys.argv
    try:
        sys.argv = ["megatron_loss.py", os.path.join(ROOT, "examples", "loss_aggregation.yaml")]
        runpy.run_path(os.path.join(ROOT, "examples", "megatron_loss.py"), run_name="__main__")
    finally:
        sys.argv = argv
