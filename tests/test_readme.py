"""Every Python snippet of the README runs, in order, as a reader would paste them: on the tiny
models (`structkv.load` answers with them whatever the name), and the serve snippet against a
server of the tiny chat model started here."""
import re
from pathlib import Path

import pytest

import structkv

README = Path(__file__).parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_four_snippets():
    assert len(snippets()) == 4
    assert len(README.read_text().splitlines()) <= 200


def test_every_readme_snippet_runs(byte_model_dir, chat_model, monkeypatch, capsys):
    openai = pytest.importorskip("openai")
    from structkv.serve import app_for
    from structkv.serve.engine import Settings
    from structkv.serve.launch import Background

    base = structkv.load(byte_model_dir)
    monkeypatch.setattr(structkv, "load", lambda name, **kw: base)
    *library, serve = snippets()
    scope: dict = {}
    for code in library:
        exec(compile(code, str(README), "exec"), scope)  # each snippet builds on the ones before, as in the README
    settings = Settings(model_name="smollm2", method="structkv", kv_budget=0.1, compile=False, max_tokens=32,
                        room=64, min_context_tokens=32)
    with Background(app_for(chat_model, settings)) as running:
        code = serve.replace("http://127.0.0.1:8000", running.url)
        assert code != serve
        exec(compile(code, str(README), "exec"), {"OpenAI": openai.OpenAI})
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 2 + 2 + 1 + 2  # every print of every snippet printed
