"""The README's example, run as a user runs it: twice in one directory, the second run resuming
from the first one's checkpoint."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_example_trains_then_resumes(tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "load_checkpoint" in b and "save_checkpoint" in b)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "step 20:" in out and "step 40:" in out, out
    assert (tmp_path / "run" / "ckpt" / "manifest.parquet").exists()
