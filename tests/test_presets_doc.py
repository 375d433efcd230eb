"""docs/presets.md lists every preset in presets/*.json, and only those, with exactly what the files say.

The table in docs/presets.md is generated from the preset files by this module:
``python tests/test_presets_doc.py --write`` rewrites it (between its markers) after a preset changes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"
DOC = REPO / "docs" / "presets.md"
BEGIN = "<!-- presets table: generated from presets/*.json by `python tests/test_presets_doc.py --write` -->"
END = "<!-- end of presets table -->"
HEADER = ("| preset | covers | ComfyUI classes (checked first) | key fingerprint (fallback) | stays float (`keep_float`) "
          "| int4-sensitive (`int4_sensitive`, ranked: first get INT8 first) | notes |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _codes(items) -> str:
    return ", ".join(f"`{_cell(str(item))}`" for item in items) or "-"


def _key(entry) -> str:
    """One ``all``/``none`` entry: a key, or a list of alternative spellings."""
    return " or ".join(f"`{_cell(k)}`" for k in entry) if isinstance(entry, list) else f"`{_cell(entry)}`"


def _fingerprint(detect, priority: int) -> str:
    alternatives = detect if isinstance(detect, list) else [detect] if detect else []
    rendered = []
    for fp in alternatives:
        parts = []
        if fp.get("all"):
            parts.append("all of " + "; ".join(f"({_key(e)})" if isinstance(e, list) else _key(e) for e in fp["all"]))
        if fp.get("none"):
            parts.append("none of " + ", ".join(_key(e) for e in fp["none"]))
        if fp.get("shapes"):
            parts.append("shapes " + ", ".join(
                f"`{_cell(k)}` = [{', '.join('any' if d is None else str(d) for d in shape)}]"
                for k, shape in fp["shapes"].items()))
        rendered.append("; ".join(parts))
    text = " **or** ".join(rendered) or "none (used when nothing else matches)"
    return text + (f" (priority {priority})" if priority else "")


def preset_files() -> dict[str, dict]:
    """``{file stem: parsed JSON}`` of every preset file."""
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(PRESETS.glob("*.json"))}


def preset_row(data: dict) -> str:
    notes = data.get("notes", "")
    notes = " ".join(notes) if isinstance(notes, list) else notes
    cells = [f"`{data['name']}`", _cell(data.get("description", "")), _codes(data.get("comfy_classes", [])),
             _fingerprint(data.get("detect"), data.get("priority", 0)), _codes(data.get("keep_float", [])),
             _codes(data.get("int4_sensitive", [])), _cell(notes) or "-"]
    return "| " + " | ".join(cells) + " |"


def generated_table() -> str:
    rows = [preset_row(data) for data in preset_files().values()]
    return "\n".join([HEADER, "|" + "---|" * HEADER.count(" | ") + "---|", *rows])


def documented_table(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise AssertionError(f"docs/presets.md lost its table markers {BEGIN!r} ... {END!r}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def documented_names(text: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", documented_table(text), flags=re.MULTILINE)


def write() -> None:
    text = DOC.read_text(encoding="utf-8")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{BEGIN}\n{generated_table()}\n{END}{after}", encoding="utf-8")


# ---- tests ----------------------------------------------------------------------------------

def test_every_preset_file_is_documented_and_every_documented_preset_has_a_file():
    names = documented_names(DOC.read_text(encoding="utf-8"))
    files = preset_files()
    assert len(names) == len(set(names)), f"docs/presets.md lists a preset twice: {names}"
    assert set(files) - set(names) == set(), "preset files missing from docs/presets.md: run the --write command"
    assert set(names) - set(files) == set(), "docs/presets.md lists presets that have no file in presets/"
    assert all(data["name"] == stem for stem, data in files.items())  # the row names the file


def test_the_table_says_what_the_files_say():
    documented = documented_table(DOC.read_text(encoding="utf-8")).splitlines()
    generated = generated_table().splitlines()
    stale = [name for name, got, want in zip(documented_names("\n".join([BEGIN, *documented, END])),
                                             documented[2:], generated[2:]) if got != want]
    assert documented == generated, (f"docs/presets.md is stale (rows {stale or 'order/header'}); run "
                                     f"python tests/test_presets_doc.py --write")


def test_the_sd15_row_says_convolutions_are_not_quantized():
    sd15 = next(line for line in generated_table().splitlines() if line.startswith("| `sd15` |"))
    assert "Convolutions" in sd15 and "stay as stored" in sd15


def test_readme_links_the_presets_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/presets.md)" in readme


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(generated_table())
