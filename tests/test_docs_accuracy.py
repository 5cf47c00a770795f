"""The docs name what the code has: errors, parameters, defaults, fields, tests and variables.

``test_docs_snippets.py`` runs the examples; this module checks the reference parts a user looks
things up in, so that renaming a parameter, changing a default, adding an error class or moving
a test without touching the docs fails here instead of misleading a reader.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import batchweave as bw
import batchweave.testing
import batchweave.torch
from batchweave._format import SliceEntry, TgbFooter
from batchweave._history import SAMPLE_IDS_KEY
from batchweave._manifest._models import Manifest
from batchweave._watermarks import Watermark
from batchweave.cli._app import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REVIEWED = [p for p in sorted(DOCS.glob("*.md")) if p.name != "benchmarks.md"] + [
    ROOT / "README.md"
]
"""The hand-written reference docs (``benchmarks.md`` is a results log, checked elsewhere)."""

_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _doc(name: str) -> str:
    return (DOCS / name).read_text()


def _blocks(text: str) -> list[str]:
    """Paragraphs and tables: runs of non-blank lines."""
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


# ------------------------------------------------------------------------------------------------
# errors


def _public_errors() -> list[str]:
    return [
        name
        for name in bw.__all__
        if isinstance(getattr(bw, name), type) and issubclass(getattr(bw, name), BaseException)
    ]


def test_every_public_error_is_explained_in_troubleshooting() -> None:
    text = _doc("troubleshooting.md")
    tree = text.split("```")[1]
    errors = _public_errors()
    assert len(errors) >= 20
    assert "`batchweave.BatchWeaveError`" in text.split("```")[0]  # the root: in the introduction
    for name in errors:
        assert re.search(rf"\b{name}\b", tree), f"{name} is missing from troubleshooting's tree"
        if name != "BatchWeaveError":
            assert f"**`{name}`**" in text, f"troubleshooting.md has no entry **`{name}`**"


def test_troubleshooting_names_only_real_errors() -> None:
    named = set(re.findall(r"^\*\*`(\w+)`\*\*", _doc("troubleshooting.md"), re.M))
    assert named <= set(_public_errors()), named - set(_public_errors())


# ------------------------------------------------------------------------------------------------
# parameters, fields and defaults


def _keyword_parameters(target: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The parameters a caller passes by name: keyword-only ones and those with a default."""
    return {
        name: p
        for name, p in inspect.signature(target).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not p.empty)
    }


_DOCUMENTED_IN: list[tuple[Callable[..., Any], str, frozenset[str]]] = [
    (bw.Producer, "producer.md", frozenset()),
    (bw.Consumer, "consumer.md", frozenset()),
    (batchweave.torch.WeaveDataset, "consumer.md", frozenset()),
    (bw.Watermarks, "lifecycle.md", frozenset()),
    # ``log`` injects a private ManifestLog (tests share one between clients).
    (bw.Reclaimer, "lifecycle.md", frozenset({"log"})),
    (bw.checkpoint_hook, "lifecycle.md", frozenset()),
    (bw.DacPolicy, "dac.md", frozenset()),
    (bw.S3Store, "store.md", frozenset()),
    (bw.open_store, "store.md", frozenset()),
]


@pytest.mark.parametrize(
    ("target", "doc", "internal"),
    _DOCUMENTED_IN,
    ids=[f"{t.__name__}-{d}" for t, d, _ in _DOCUMENTED_IN],
)
def test_every_keyword_argument_is_documented(
    target: Callable[..., Any], doc: str, internal: frozenset[str]
) -> None:
    text = _doc(doc)
    parameters = _keyword_parameters(target)
    assert parameters
    missing = [
        name
        for name in parameters
        if name not in internal and f"`{name}" not in text and f"{name}=" not in text
    ]
    assert not missing, f"docs/{doc} does not mention {target.__name__}({', '.join(missing)}=)"


@pytest.mark.parametrize(
    ("fields", "doc"),
    [
        (bw.ProducerStats.__dataclass_fields__, "producer.md"),
        (bw.ConsumerStats.__dataclass_fields__, "consumer.md"),
        (bw.ReclaimProgress.__dataclass_fields__, "lifecycle.md"),
    ],
    ids=["ProducerStats", "ConsumerStats", "ReclaimProgress"],
)
def test_every_stats_field_is_documented(fields: dict[str, Any], doc: str) -> None:
    text = _doc(doc)
    missing = [name for name in fields if f"`{name}`" not in text]
    assert not missing, f"docs/{doc} does not name the field(s) {missing}"


class _Words:
    """A default described in words ("boto3 chain", "fresh random.Random")."""


_UNITS = {"": 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def _parse_default(cell: str) -> object:
    text = cell.replace("`", "").strip()
    if text == "None":
        return None
    if quoted := re.fullmatch(r'"([^"]*)"', text):
        return quoted[1]
    if number := re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*(s|KiB|MiB)?", text):
        return float(number[1]) * _UNITS[number[2] or ""]
    return _Words()


def _table_rows(text: str, header: str) -> Iterator[list[str]]:
    """The cells of every row of the tables whose header row starts with ``header``."""
    for block in _blocks(text):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith(header):
            for line in lines[2:]:
                yield [c.strip() for c in line.strip().strip("|").split("|")]


_DEFAULT_TABLES: list[tuple[Callable[..., Any], str, str, int]] = [
    (bw.Producer, "producer.md", "| parameter | default |", 11),
    (bw.Consumer, "consumer.md", "| parameter | default |", 10),
    (bw.DacPolicy, "dac.md", "| parameter | default |", 9),
    (bw.S3Store, "store.md", "| option | default |", 4),
]


@pytest.mark.parametrize(
    ("target", "doc", "header", "at_least"),
    _DEFAULT_TABLES,
    ids=[f"{t.__name__}-{d}" for t, d, _, _ in _DEFAULT_TABLES],
)
def test_documented_defaults_match_the_code(
    target: Callable[..., Any], doc: str, header: str, at_least: int
) -> None:
    """Every parameter a defaults table names exists and has the default the table gives.

    A default given in words ("boto3 chain") is accepted only where the code's default is
    ``None`` or a callable, which is what words describe.
    """
    parameters = inspect.signature(target).parameters
    checked = 0
    for cells in _table_rows(_doc(doc), header):
        # "`max_gap` (`G`)": the parenthesized symbol is the docs' notation, not a parameter
        names = _CODE_SPAN.findall(re.sub(r"\([^)]*\)", "", cells[0]))
        assert names, f"{doc}: row {cells[0]!r} names no parameter"
        pieces = [p.strip() for p in cells[1].split(",")] if len(names) > 1 else [cells[1]]
        if len(pieces) != len(names):
            pieces = [cells[1]] * len(names)
        for name, piece in zip(names, pieces, strict=True):
            assert name in parameters, f"{doc}: {target.__name__} has no parameter {name!r}"
            actual = parameters[name].default
            shown = _parse_default(piece)
            if isinstance(shown, _Words):
                assert actual is None or callable(actual), (
                    f"{doc}: {name} defaults to {actual!r}, the table says {piece!r}"
                )
                continue
            if isinstance(shown, float) and not isinstance(actual, bool):
                assert isinstance(actual, int | float), (name, actual, piece)
                assert math.isclose(shown, actual), (
                    f"{doc}: {name} defaults to {actual!r}, the table says {piece!r}"
                )
            else:
                assert shown == actual, (
                    f"{doc}: {name} defaults to {actual!r}, the table says {piece!r}"
                )
            checked += 1
    assert checked >= at_least, f"{doc}: only {checked} numeric or named defaults checked"


def _first_column_names(text: str, header: str) -> set[str]:
    return {n for cells in _table_rows(text, header) for n in _CODE_SPAN.findall(cells[0])}


@pytest.mark.parametrize(
    ("model", "doc", "header"),
    [
        (Manifest, "protocol.md", "| field | meaning |"),
        (Watermark, "lifecycle.md", "| field | meaning |"),
        (TgbFooter, "format.md", "| key              | type"),
        (SliceEntry, "format.md", "| key                   | meaning |"),
    ],
    ids=["manifest", "watermark", "footer", "slice-entry"],
)
def test_format_field_tables_list_exactly_the_persisted_fields(
    model: Any, doc: str, header: str
) -> None:
    documented = _first_column_names(_doc(doc), header)
    assert documented == set(model.model_fields), (
        f"{doc}: documented {sorted(documented)}, persisted {sorted(model.model_fields)}"
    )


# ------------------------------------------------------------------------------------------------
# names, tests and environment variables the docs point at


def _known_dotted_names() -> set[str]:
    """``batchweave.x`` strings that are not attributes: logger names and metadata keys."""
    loggers = {name for name in logging.Logger.manager.loggerDict if name.startswith("batchweave.")}
    return loggers | {SAMPLE_IDS_KEY}


_MODULES = {
    "bw": bw,
    "batchweave": bw,
    "batchweave.torch": batchweave.torch,
    "batchweave.testing": batchweave.testing,
}


def test_names_the_docs_use_exist() -> None:
    """``bw.X``, ``batchweave.X`` and ``PublicClass.attr`` name real things."""
    known = _known_dotted_names()
    classes = {
        name: obj
        for module in (bw, batchweave.torch, batchweave.testing)
        for name in getattr(module, "__all__", ())
        if isinstance(obj := getattr(module, name), type)
    }
    problems = []
    for doc in REVIEWED:
        text = doc.read_text()
        for m in re.finditer(r"\b(bw|batchweave(?:\.torch|\.testing)?)\.([A-Za-z_]\w*)", text):
            module, name = _MODULES[m[1]], m[2]
            dotted = f"{module.__name__}.{name}"
            if hasattr(module, name) or dotted in known or importlib.util.find_spec(dotted):
                continue
            problems.append(f"{doc.name}: {m[0]}")
        for m in re.finditer(r"\b([A-Z]\w+)\.([a-z_]\w*)", text):
            cls = classes.get(m[1])
            if cls is None or hasattr(cls, m[2]):
                continue
            fields = set(getattr(cls, "__dataclass_fields__", ())) | set(
                getattr(cls, "model_fields", ())
            )
            if m[2] in fields or f"self.{m[2]} " in inspect.getsource(cls):
                continue
            problems.append(f"{doc.name}: {m[0]}")
    assert not problems, problems


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:def|class) {name}\b|^{name} = ", path.read_text(), re.M) is not None


_TEST_FILE = re.compile(r"(?:(?:tests|batchweave/testing)/)?\b(test_\w+\.py|_store_tests\.py)")
_TEST_REF = re.compile(rf"{_TEST_FILE.pattern}(?:::(\w+))?(?:::(\w+))?|(?<![:\w])::(\w+)")


def _test_path(file: str) -> Path:
    folder = "batchweave/testing" if file == "_store_tests.py" else "tests"
    return ROOT / folder / file


def test_tests_the_docs_cite_exist() -> None:
    """Every cited test file exists, ``file.py::name`` is defined in that file, and a bare
    ``::name`` in one of the files its paragraph or table cites."""
    problems = []
    cited = 0
    for doc in REVIEWED:
        for block in _blocks(doc.read_text()):
            files: set[Path] = set()
            bare: list[str] = []
            for m in _TEST_REF.finditer(block):
                if m[4]:
                    bare.append(m[4])
                    continue
                path = _test_path(m[1])
                files.add(path)
                if not path.is_file():
                    problems.append(f"{doc.name}: no file {path.relative_to(ROOT)}")
                    continue
                for name in filter(None, (m[2], m[3])):
                    cited += 1
                    if not _defines(path, name):
                        problems.append(f"{doc.name}: {m[0]} is not defined in that file")
            for name in bare:
                cited += 1
                if not any(p.is_file() and _defines(p, name) for p in files):
                    problems.append(f"{doc.name}: ::{name} is in none of {sorted(files)}")
    assert cited >= 50
    assert not problems, problems


def test_environment_variables_match_the_code() -> None:
    pattern = re.compile(r"\bBATCHWEAVE_[A-Z_]+\b")
    source = "\n".join(p.read_text() for p in (ROOT / "batchweave").rglob("*.py"))
    docs = "\n".join(p.read_text() for p in REVIEWED)
    assert set(pattern.findall(docs)) == set(pattern.findall(source))


def test_the_docs_map_names_every_command() -> None:
    row = next(line for line in _doc("index.md").splitlines() if line.startswith("| [cli]"))
    for command in cli.commands:
        assert re.search(rf"\b{command}\b", row), f"index.md's cli row lacks {command}"


def test_the_code_map_names_every_module_and_nothing_else() -> None:
    text = _doc("index.md")
    section = text[text.index("## Map of the code") : text.index("## Errors")]
    named = set(_CODE_SPAN.findall(section))
    package = ROOT / "batchweave"
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if path.name in ("__init__.py", "__main__.py"):
            continue
        shown = f"{parts[0]}/" if len(parts) > 1 else parts[0]
        assert shown in named, f"docs/index.md's map of the code lacks {shown}"
        if len(parts) > 1 and parts[0] in ("_producer", "_consumer"):
            assert parts[1] in named, f"docs/index.md's map of the code lacks {parts[1]}"
    for name in named:
        if name.endswith(".py") and "/" not in name and name != "__init__.py":
            assert list(package.rglob(name)), f"docs/index.md maps {name}, which does not exist"


def test_the_conformance_suite_attributes_listed_are_its_own() -> None:
    from batchweave.testing import StoreTests

    text = _doc("store.md")
    listed = text.split("Class attributes:", 1)[1].split("\n\n", 1)[0]
    scalable = {
        name
        for name, value in vars(StoreTests).items()
        if not name.startswith("_") and isinstance(value, int) and not isinstance(value, bool)
    }
    assert set(_CODE_SPAN.findall(listed)) == scalable


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+\s+(.*?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_docs_resolve() -> None:
    """Every relative link names an existing file and, for a ``#anchor``, an existing heading."""
    broken = []
    links = 0
    for doc in REVIEWED:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            links += 1
            file, _, anchor = target.partition("#")
            path = doc.parent / file if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert links >= 30
    assert not broken, broken


def test_example_commands_the_docs_show_exist() -> None:
    """Every ``examples/NAME.py`` the docs name exists, with every ``--option`` shown after it."""
    examples = ROOT / "examples"
    problems = []
    cited = 0
    for doc in REVIEWED:
        for m in re.finditer(r"examples/(\w+\.py)([^`\n]*)", doc.read_text()):
            cited += 1
            script = examples / m[1]
            if not script.is_file():
                problems.append(f"{doc.name}: no {script.relative_to(ROOT)}")
                continue
            source = script.read_text()
            for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m[2]):
                if f'"{option}"' not in source:
                    problems.append(f"{doc.name}: {m[1]} has no option {option}")
    assert cited >= 5
    assert not problems, problems


def test_open_store_creates_a_file_directory_and_the_cli_does_not(tmp_path: Path) -> None:
    """quickstart.md: ``open_store`` makes a missing ``file://`` directory; the CLI refuses one."""
    from click.testing import CliRunner

    bw.open_store((tmp_path / "new").as_uri()).close()
    assert (tmp_path / "new").is_dir()
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "missing"), "ns"])
    assert result.exit_code == 2
    assert not (tmp_path / "missing").exists()
    assert "open_store` creates a missing `file://` directory" in _doc("quickstart.md")
