"""The documentation as tested code: README.md and every page under docs/.

Every ```` ```python ```` block runs as written (pytest-markdown-docs, with the runners of
tests/docs_plugin.py); a block that does not run is marked ``notest`` and introduced as a
sketch; blocks marked ``vllm`` run in the vLLM suite instead. The site builds with
``mkdocs build --strict`` and its API reference names every public name of attn_di.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SITE_ENV = "ATTN_DI_DOCS_SITE"
"""scripts/check.sh builds the site once (strict) and names it here, so the tests read it
instead of building it again; unset, the tests build their own."""


def _python_fences(page: Path) -> list[tuple[list[str], str]]:
    """``(info words, text before the block)`` of every Python fence of ``page``."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    found = []
    for index, token in enumerate(tokens):
        words = token.info.split()
        if token.type == "fence" and words[:1] == ["python"]:
            before = " ".join(t.content for t in tokens[max(0, index - 4) : index])
            found.append((words, before))
    return found


def _relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_python_block_of_every_page_runs() -> None:
    """pytest --markdown-docs runs each ```python block of README.md and docs/ (scripts and
    test modules included); the ``vllm`` ones are skipped, every other one passes."""
    pages = [page for page in PAGES if _python_fences(page)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--markdown-docs", "-p", "tests.docs_plugin",
         "-p", "no:cacheprovider", "-q", *map(_relative, pages)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr
    fences = [words for page in pages for words, _ in _python_fences(page)]
    runnable = [words for words in fences if "notest" not in words]
    vllm = [words for words in runnable if "vllm" in words]
    assert len(runnable) - len(vllm) >= 25
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{len(runnable) - len(vllm)} passed\b", summary), summary
    if vllm:
        assert re.search(rf"\b{len(vllm)} skipped\b", summary), summary


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_blocks_that_do_not_run_are_marked_as_sketches(page: Path) -> None:
    """A ```python notest block is introduced as a sketch in the text right before it."""
    for words, before in _python_fences(page):
        if "notest" in words:
            assert "sketch" in before.lower(), before


def test_the_readme_is_a_front_page() -> None:
    """README.md: at most ~200 lines, its first code block the two set-up commands, links to
    LICENSE, CHANGELOG.md, CONTRIBUTING.md and the docs, each of which exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 210
    tokens = MarkdownIt("commonmark").parse(text)
    first = next(token for token in tokens if token.type == "fence")
    commands = [line.split("#")[0].strip() for line in first.content.splitlines()]
    assert commands == ["bash scripts/main.sh", "bash scripts/check.sh"]
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    for name in ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md"):
        assert name in local
    assert any(link.startswith("docs/") for link in local)
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_readme_prose_is_written_for_any_user() -> None:
    """No page speaks of "these machines" or "the dev machine"."""
    for page in PAGES:
        text = page.read_text().lower()
        for phrase in ("these machines", "dev machine", "this machine's defaults"):
            assert phrase not in text, f"{_relative(page)}: {phrase!r}"


# -- the site ---------------------------------------------------------------------------


@pytest.fixture(scope="module", name="site")
def _site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: the one scripts/check.sh built, or one built now with --strict."""
    given = os.environ.get(SITE_ENV)
    if given:
        return Path(given)
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return site


def _source(module: str) -> Path:
    path = SRC.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _all(module: str) -> list[str]:
    """``module.__all__``, read from the source (nothing imported: vLLM need not be here).
    A package without ``__all__`` whose ``__init__`` defines nothing (only its docstring) has
    no public names of its own: ``[]``."""
    body = ast.parse(_source(module).read_text()).body
    for node in body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    docstring_only = all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
    )
    assert _source(module).name == "__init__.py", f"{module} has no __all__"
    assert docstring_only, f"{module} defines names but has no __all__"
    return []


def _public_modules() -> list[str]:
    """Every public module of attn_di, at any depth: each ``.py`` file and package under
    ``src/attn_di`` none of whose path components starts with ``_`` (``__init__.py`` stands
    for its package); found on disk, nothing imported."""
    found = []
    for path in (SRC / "attn_di").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))
    return sorted(found)


PUBLIC_MODULES = _public_modules()


def test_the_public_modules_are_found() -> None:
    """The walk reaches every depth: the backends, both integrations and the vLLM
    integration's backends subpackage; private modules (``_adapter``) are left out."""
    assert {
        "attn_di",
        "attn_di.cli",
        "attn_di.backends.cpu_attn",
        "attn_di.backends.torch_sdpa",
        "attn_di.backends.flex_attention",
        "attn_di.backends.no_attention",
        "attn_di.integrations.transformers",
        "attn_di.integrations.vllm",
        "attn_di.integrations.vllm.backends",
    } <= set(PUBLIC_MODULES)
    assert not [module for module in PUBLIC_MODULES if "._" in module]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_on_the_api_reference(site: Path, module: str) -> None:
    """Each name of each public module's ``__all__`` (every public module, at any depth) has
    its entry (an anchor named by its full path) on the API reference pages."""
    html = "\n".join(page.read_text() for page in (site / "reference").rglob("*.html"))
    anchors = set(re.findall(r'id="([\w.]+)"', html))
    missing = [name for name in _all(module) if f"{module}.{name}" not in anchors]
    assert missing == []


def test_the_file_build_opens_from_the_file_system(tmp_path: Path) -> None:
    """scripts/docs.sh's build (ATTN_DI_DOCS_OFFLINE=true): every local link of every page
    names a file that exists (``page.html``, never a folder a file:// URL would list), and the
    search index is inlined for use without a server."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    assert "ATTN_DI_DOCS_OFFLINE=true" in (ROOT / "scripts" / "docs.sh").read_text()
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "ATTN_DI_DOCS_OFFLINE": "true"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pages = sorted(set(site.rglob("*.html")) - {site / "404.html"})  # 404: for servers only
    assert len(pages) > 20
    broken = []
    for page in pages:
        for link in re.findall(r'href="([^"#?]+)[^"]*"', page.read_text()):
            if "://" in link or link.startswith(("mailto:", "data:")):
                continue
            target = (page.parent / link).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert broken == []
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = ")


def test_the_cli_reference_is_the_generated_help(site: Path) -> None:
    """The CLI page holds each command's --help, generated at build time."""
    page = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("attn-di", "attn-di list", "attn-di select", "attn-di run"):
        assert f"{command} --help" in page
    assert "usage: attn-di run" in page
    assert "--wide" in page


# -- the conformance tutorial's runs ---------------------------------------------------------

CONFORMANCE_TUTORIAL = ROOT / "docs" / "tutorials" / "conformance.md"
_SUMMARY = re.compile(r"^(?P<counts>NAIVE_ATTN: .*) in [\d.]+ s: (?P<verdict>.*)$", re.M)


def _fences(page: Path, language: str) -> list[tuple[list[str], str]]:
    """``(info words, code)`` of every ``language`` fence of ``page``, in order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [(t.info.split(), t.content) for t in tokens
            if t.type == "fence" and t.info.split()[:1] == [language]]  # fmt: skip


def _file_block(page: Path, name: str) -> str:
    (code,) = [code for words, code in _fences(page, "python") if f"file:{name}" in words]
    return code


def _run_command(line: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run a page's ``attn-di ...`` or ``pytest ...`` line in ``folder``, with this
    checkout's attn_di and the interpreter that runs the tests."""
    program, *args = shlex.split(line)
    commands = {
        "attn-di": [sys.executable, "-m", "attn_di"],
        "pytest": [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
    }
    command = commands[program]
    env = {name: value for name, value in os.environ.items() if not name.startswith("ATTN_DI_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [*command, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )


def _assert_summary_on_page(output: str, page: str) -> None:
    """The run's last line, its time aside, is on the page."""
    match = _SUMMARY.search(output)
    assert match, output
    shown = re.escape(match["counts"]) + r" in [\d.]+ s: " + re.escape(match["verdict"])
    assert re.search(shown, page), match[0]


def test_the_conformance_tutorial_shows_what_the_kit_prints(tmp_path: Path) -> None:
    """The conformance tutorial's commands, run as a reader runs them: on the first
    tutorial's backend they fail its padded and malformed-input cells, on the fixed one they
    conform, on the page's deliberate bug they fail the gqa2/4/8 cells and the printed re-run
    command re-runs one cell alone; each run's counts and verdict are the page's, as are the
    re-run lines the page shows and the pytest option's numbers."""
    page = CONFORMANCE_TUTORIAL.read_text()
    lines = [line for _, code in _fences(CONFORMANCE_TUTORIAL, "bash")
             for line in code.splitlines() if line.strip()]  # fmt: skip
    first, again, one_cell, option = lines
    assert first == again == "attn-di conform my_attention:NaiveBackend"
    fixed = _file_block(CONFORMANCE_TUTORIAL, "my_attention.py")
    (diff,) = [code for _, code in _fences(CONFORMANCE_TUTORIAL, "diff")]
    removed = "".join(line[1:] + "\n" for line in diff.splitlines() if line.startswith("-"))
    added = "".join(line[1:] + "\n" for line in diff.splitlines() if line.startswith("+"))
    assert fixed.count(removed) == 1
    backends = {
        "original": _file_block(ROOT / "docs" / "tutorials" / "your-own-backend.md",
                                "my_attention.py"),
        "fixed": fixed,
        "buggy": fixed.replace(removed, added),
    }  # fmt: skip
    outputs = []
    for name, source in backends.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "my_attention.py").write_text(source)
        result = _run_command(first, tmp_path / name)
        assert result.returncode == (0 if name == "fixed" else 1), result.stdout + result.stderr
        _assert_summary_on_page(result.stdout, page)
        failing = re.findall(r"^FAIL\w* (\S+):", result.stdout, re.M)
        if name == "original":
            assert failing
            assert all("padded" in cell or "-bad_" in cell for cell in failing), failing
        elif name == "buggy":
            assert failing
            assert all(re.search(r"-gqa[248]-", cell) for cell in failing), failing
        outputs.append(result.stdout)
    for rerun in re.findall(r"^  rerun: .*$", page, re.M):
        assert any(rerun in output for output in outputs), rerun
    cell = re.search(r"--case (\S+)", one_cell)
    assert cell
    assert f"  rerun: {one_cell}" in outputs[2]
    result = _run_command(one_cell, tmp_path / "buggy")
    assert result.returncode == 1
    assert re.findall(r"^FAIL\w* (\S+):", result.stdout, re.M) == [cell[1]]
    result = _run_command(option, tmp_path / "fixed")
    assert result.returncode == 0, result.stdout + result.stderr
    counts = re.search(r"(\d+) passed, (\d+) skipped", result.stdout)
    assert counts, result.stdout
    assert f"runs {counts[1]} tests and skips {counts[2]}" in page
