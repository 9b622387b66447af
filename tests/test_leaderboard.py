"""The generated leaderboard (`structkv.harness.eval.leaderboard`): hand-made folders give the
tables they should, and the project's own page (docs/results.md) is what its folders give now."""
import json
from pathlib import Path

import pytest

from structkv.harness.eval import leaderboard

ROOT = Path(__file__).parents[1]


def _folder(path: Path, question_after: bool, rows: list[dict], partial: bool = False) -> Path:
    path.mkdir(parents=True)
    config = {"benchmark": "ruler", "model": "m", "lengths": [4096], "question_after": question_after}
    (path / "config.json").write_text(json.dumps({"config": config, "command": "structkv eval ..."}))
    (path / "metrics.json").write_text(json.dumps({"rows": rows}))
    title = "# ruler on m: 2 samples per task" + (" (not all scored yet: see the samples column)" if partial else "")
    (path / "summary.md").write_text(title + "\n")
    return path


def _row(label, method, budget, average):
    return {"label": label, "method": method, "kv_budget": budget, "length": 4096, "average": average,
            "n": {"qa_1": 2, "vt": 2}}


def test_tables_put_methods_down_budgets_across_and_link_each_cell(tmp_path):
    inside = _folder(tmp_path / "results" / "inside", False, [
        _row("full", "full", None, 40.0), _row("snapkv@0.1", "snapkv", 0.1, 25.0),
        _row("snapkv@0.2", "snapkv", 0.2, 30.0), _row("structkv@0.1", "structkv", 0.1, 35.0)])
    after = _folder(tmp_path / "results" / "after", True, [
        _row("full", "full", None, 41.0), _row("keydiff@0.1", "keydiff", 0.1, 10.0),
        _row("keydiff@0.1+recall0.2", "keydiff", 0.1, 38.0)], partial=True)
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    assert leaderboard.main([str(inside), str(after), "--out", str(page)]) == 0
    text = page.read_text()
    assert "## ruler, m, 4096 tokens, question inside: `inside` (4 prompts)" in text
    assert "## ruler, m, 4096 tokens, question after the compressed context: `after` (4 prompts)" in text
    link = "../results/inside/summary.md"
    assert f"| full | [40.0]({link}) | [40.0]({link}) |" in text  # the full cache stands in every column
    assert f"| snapkv | [25.0]({link}) | [30.0]({link}) |" in text
    assert f"| structkv | [35.0]({link}) |  |" in text
    assert "| keydiff +recall 0.2 | [38.0*](../results/after/summary.md) |" in text  # partial: starred
    assert text.index("| full |") < text.index("| snapkv |")


def test_a_folder_that_is_not_an_eval_folder_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert leaderboard.main([str(tmp_path / "empty"), "--out", str(tmp_path / "page.md")]) == 2
    assert "empty is not a complete eval folder" in capsys.readouterr().err
    assert not (tmp_path / "page.md").exists()


def test_the_committed_leaderboard_is_what_its_folders_give():
    """docs/results.md regenerated from the folders its command names: a folder rerun or extended
    without regenerating the page (or a hand edit) fails here."""
    page = ROOT / "docs" / "results.md"
    text = page.read_text()
    command = next(line.strip() for line in text.splitlines()
                   if line.strip().startswith("python -m structkv.harness.eval.leaderboard"))
    args = command.split()[3:]
    folders = [ROOT / a for a in args[:args.index("--out")]]
    if not all((f / "metrics.json").exists() for f in folders):
        pytest.fail(f"docs/results.md names folders that are gone: {[str(f) for f in folders if not f.exists()]}")
    assert leaderboard.render(folders, page, command) == text, (
        "docs/results.md is stale: rerun the command at its top")
