"""README.md and docs/ stay true (issue 35, item 15).

Checked in-process, starting no rank: every docs/ page is linked from the README;
every relative link of the README and of docs/ resolves to a file, and its #anchor to a heading
of that file (GitHub's slugs); every `colonnade` command quoted in a shell block of the README
or docs/ parses (the subcommand's own argument parser, config fields spelled
--section.field=value that exist, config files that exist), and the README's `train` commands
are valid configurations for their world size; `make` targets quoted exist. The README's dry
run runs as quoted (in a scratch folder with a tiny prepared data/mine; `--dry-run` starts no
rank and writes nothing), and the README's support matrix is the one the validator gives
(:func:`support_matrix`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from colonnade.cli import build_parser, main
from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$")


def _prose(page: Path) -> list[str]:
    """The lines of ``page`` outside fenced code blocks."""
    out, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def _anchors(page: Path) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    found = set()
    for line in _prose(page):
        m = HEADING.match(line)
        if m:
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def _links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose(page) for m in LINK.finditer(line)]


def _shell_commands(page: Path) -> list[list[str]]:
    """Each command of the page's ```bash blocks as argv: continuation lines joined, comments
    dropped, ``$C`` (the README's alias) read as ``colonnade``."""
    text = page.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if not argv or argv[0].startswith("C="):
                continue
            if argv[0] in ("$C", ".venv/bin/colonnade"):
                argv[0] = "colonnade"
            out.append(argv)
    return out


def test_every_docs_page_is_linked_from_the_readme() -> None:
    assert len(DOCS) >= 9
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert missing == [], f"docs/ pages the README does not link: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert broken == []


def _check_command(argv: list[str], validate_train: bool) -> str:
    """'' when ``argv`` (a quoted colonnade / make command) parses, else what is wrong."""
    if argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M)
        return "" if argv[1] in targets else f"no make target {argv[1]}"
    if argv[0] != "colonnade":
        return ""  # torchrun, python: not ours to parse
    args, rest = build_parser().parse_known_args(argv[1:])
    overrides = [a for a in rest if a.startswith("--") and "." in a.split("=", 1)[0]]
    if unknown := [a for a in rest if a not in overrides]:
        return f"unknown arguments {unknown}"
    if args.command in ("train", "prepare"):
        config = load_config(args.config, overrides)  # a field that does not exist raises
        world = (getattr(args, "nproc", None) or 1) * getattr(args, "nnodes", 1)  # None: 1
        if validate_train and args.command == "train" and not args.init_from:
            validate(resolve(config, world), world)
    return ""


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_quoted_commands_parse(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # config paths are quoted relative to the repository
    commands = _shell_commands(page)
    if page == README:
        names = [argv[1] for argv in commands if argv[0] == "colonnade"]
        assert names == ["prepare", "train", "train", "train", "convert", "generate",
                         "prepare", "train", "plot"]  # the nine-command workflow
    bad = [f"{' '.join(argv)}: {why}" for argv in commands
           if (why := _check_command(argv, validate_train=page == README))]
    assert bad == []


def test_readme_dry_run_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """The README's dry run, as quoted, in a folder holding the configs and a tiny prepared
    data/mine (the workflow's first command prepares it from the user's files)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "mine.txt").write_text(" ".join(["the model trains on text"] * 200))
    assert main(["prepare", "--data.input=mine.txt", "--data.prepared_dir=data/mine",
                 "--model.vocab_size=300"]) == 0
    capsys.readouterr()
    dry = next(argv for argv in _shell_commands(README) if "--dry-run" in argv)
    assert main(dry[1:]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing was started, written or prepared" in out, out
    assert "layout: tp2-dp2 on 4 rank(s)" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "data", "mine.txt"]


MATRIX_START = "<!-- support matrix: generated by tests/test_docs.py (support_matrix) -->"
MATRIX_END = "<!-- end of support matrix -->"


def support_matrix() -> str:
    """The README's support matrix: the short table of :mod:`colonnade.fuzz.matrix` (the
    docs page's generator, from the validator's rules)."""
    from colonnade.fuzz.matrix import README_FEATURES, table

    return table(README_FEATURES)


def test_readme_support_matrix_is_the_validators() -> None:
    text = README.read_text(encoding="utf-8")
    table = text.split(MATRIX_START, 1)[1].split(MATRIX_END, 1)[0].strip()
    expected = support_matrix()
    assert table == expected, f"the README's support matrix should read:\n{expected}"
    assert "✗" in expected and "✓" in expected  # it can fail both ways


FAMILIES_START = "<!-- model families: each arch and HF class is checked by tests/test_docs.py -->"
FAMILIES_END = "<!-- end of model families -->"


def test_readme_model_families_name_every_arch_class_and_preset() -> None:
    """The README's model-family table names every ``model.arch``, every Hugging Face class
    Colonnade reads and writes, and only presets that exist in configs/."""
    from colonnade.checkpoint.hf_moe import ALL_FORMATS
    from colonnade.config.choices import ARCHS

    table = README.read_text(encoding="utf-8").split(FAMILIES_START, 1)[1]
    table = table.split(FAMILIES_END, 1)[0]
    rows = [r.split("|")[1:-1] for r in table.strip().splitlines()[2:]]
    archs = {cell.strip().strip("`") for r in rows for cell in r[1].split(",")}
    assert archs == set(ARCHS), f"table archs {sorted(archs)} != ARCHS {sorted(ARCHS)}"
    classes = set(re.findall(r"`(\w+(?:For\w+|LMHeadModel))`", " ".join(r[2] for r in rows)))
    assert classes == {f.hf_class for f in ALL_FORMATS.values()}, sorted(classes)
    presets = {p.strip() for r in rows for p in r[3].split(",")}
    missing = sorted(p for p in presets if not (REPO / "configs" / f"{p}.toml").is_file())
    assert not missing, f"presets named in the README but not in configs/: {missing}"
