"""Every pointer into the design notes resolves: a `docs/<note>.md` named in the code, the tests,
the benchmarks or the docs exists, and a section it names (`docs/x.md, "Heading"`, wrapped over
lines or not) is a heading, or a bold lead, of that note. Notes are split and trimmed as they
grow; a comment pointing at a section that moved sends a reader nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", ".cache", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache", "build", ".pp"}
SUFFIXES = {".py", ".md", ".sh", ".toml", ".c", ".service", ".cfg"}
# docs/x.md, then any quoted section names (`, "A", "B" and "C"`), possibly wrapped onto the next line
REF = re.compile(r'(docs/[A-Za-z0-9_.-]+\.md)((?:,?\s*(?:and\s+)?["“][^"”]{3,100}["”])*)')
QUOTED = re.compile(r'["“]([^"”]{3,100})["”]')


def sources(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file() and p != Path(__file__).resolve()
            and not SKIP.intersection(p.relative_to(root).parts)]  # (this file's examples are not references)


def flatten(text: str) -> str:
    """Lines joined, a continuation's comment marker or indent dropped (a wrapped reference reads as one)."""
    return re.sub(r"\n[ \t]*(?:#+[ \t]*)?", " ", text)


def sections(note: str) -> list[str]:
    """A note's headings and bold leads, without markdown emphasis, lower case."""
    heads = [ln.lstrip("#").strip() for ln in note.splitlines() if ln.startswith("#")]
    heads += re.findall(r"\*\*([^*]+)\*\*", note)
    return [re.sub(r"[`*]", "", h).strip().lower() for h in heads]


def broken(root: Path) -> list[str]:
    out: set[str] = set()
    notes: dict[str, list[str]] = {}
    for p in sources(root):
        for m in REF.finditer(flatten(p.read_text(errors="replace"))):
            doc, where = m.group(1), str(p.relative_to(root))
            if not (root / doc).is_file():
                out.add(f"{where}: {doc} does not exist")
                continue
            have = notes.setdefault(doc, sections((root / doc).read_text()))
            for head in QUOTED.findall(m.group(2)):
                name = re.sub(r"\s+", " ", re.sub(r"[`*]", "", head)).strip().lower()
                if not any(h.startswith(name) or name in h for h in have):
                    out.add(f'{where}: {doc} has no section "{head}"')
    return sorted(out)


def test_every_reference_to_a_design_note_resolves() -> None:
    assert broken(ROOT) == []


def test_a_reference_to_a_missing_note_or_section_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Who owns which state\n\n**The watch.** text\n")
    (tmp_path / "m.py").write_text('"""See docs/a.md, "Who owns\n# which state"; docs/a.md, "The watch"."""\n'
                                   '# docs/a.md, "Gone away" and docs/b.md\n'
                                   '# (docs/a.md, "The watch", "Who owns" and "Never was")\n')
    assert broken(tmp_path) == ['m.py: docs/a.md has no section "Gone away"',
                                'm.py: docs/a.md has no section "Never was"', "m.py: docs/b.md does not exist"]
