"""The figures of the docs (``docs/img/*.svg``) are drawn by ``scripts/draw_docs.py`` from the
library itself; the checked-in files must be what it draws now. After a change that alters
one: ``PYTHONPATH=. .venv/bin/python scripts/draw_docs.py``."""
import importlib.util
import pathlib
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("draw_docs", ROOT / "scripts" / "draw_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_figures_are_what_the_script_draws():
    mod = _script()
    stale = []
    for name, draw in mod.FIGURES.items():
        text = draw()
        ET.fromstring(text)                      # well-formed SVG
        path = ROOT / "docs" / "img" / name
        if not path.exists() or path.read_text() != text:
            stale.append(name)
    assert not stale, (f"docs/img/{', '.join(stale)} out of date: run "
                       "PYTHONPATH=. .venv/bin/python scripts/draw_docs.py")


def test_every_figure_is_used_by_a_page():
    pages = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    unused = [n for n in _script().FIGURES if f"img/{n}" not in pages]
    assert not unused, f"figures no page shows: {unused}"
