"""Every python code block of README.md and docs/*.md runs (blocks of a file share one namespace)."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def python_blocks(path):
    text = open(path, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(f, ROOT) for f in FILES])
def test_code_blocks_run(path, tmp_path, monkeypatch):
    blocks = python_blocks(path)
    if not blocks:
        pytest.skip("no python blocks")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{os.path.relpath(path, ROOT)}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the docs are ours


def test_every_docs_page_has_a_runnable_example_or_is_reference():
    pages_without = [f for f in FILES if not python_blocks(f) and not f.endswith("benchmarks.md")]
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
