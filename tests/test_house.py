"""The house as the docs describe it: short core modules, a short README, links that resolve."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash_mlx"
# train/ and bench/ stand beside the front ends; their long modules are recipes and reports
OUTSIDE_THE_CORE = ("train", "bench")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 290
DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]


def core_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in OUTSIDE_THE_CORE:
            yield path


def test_core_modules_and_classes_are_short():
    long_modules, long_classes = [], []
    for path in core_modules():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes.append(f"{path.relative_to(REPO)}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_modules, f"core modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_classes, f"classes over {MAX_CLASS_LINES} lines: {long_classes}"


def test_readme_and_architecture_stay_short():
    assert (REPO / "README.md").read_text().count("\n") <= 350
    assert (REPO / "ARCHITECTURE.md").read_text().count("\n") <= 200


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, f"links to nothing: {broken}"


def test_every_folder_of_the_package_is_in_architecture_md():
    text = (REPO / "ARCHITECTURE.md").read_text()
    folders = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")} - {"."}
    missing = [f for f in sorted(folders) if f"`{f}/`" not in text]
    assert not missing, f"folders ARCHITECTURE.md does not describe: {missing}"
