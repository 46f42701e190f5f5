"""On/off environment switches: one parser, the same spellings for every switch, junk refused.

``ATTN_DI_FLEX_COMPILE`` was on only for exactly ``"1"`` (``"true"`` silently off), and
``ATTN_DI_AUTO_PROPAGATE`` / ``ATTN_DI_VLLM_BRIDGE`` read ``"disable"``, ``"nope"`` and
``"0 "`` as on; ``ATTN_DI_CPU_KERNEL`` alone refused junk. Each switch is read here where
attn_di reads it (the vLLM bridge's in tests/vllm/test_plugin.py).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_di._env import Switch
from attn_di.backends import _cpu_kernel
from attn_di.backends.flex_attention import COMPILE_ENV_VAR, FlexAttentionImpl
from attn_di.exceptions import EnvSwitchError, InvalidInputError

ROOT = Path(__file__).resolve().parents[1]
ON = ["1", "true", "TRUE", "Yes", "on", " on ", "1\n"]
OFF = ["0", "false", "False", "NO", "off", "0 ", "\tOFF"]
JUNK = ["disable", "nope", "2", "enabled", "tru", "0 1", "-1", "yes please"]

SWITCH = Switch("ATTN_DI_TEST_SWITCH", default=True, on="do it", off="do not")


@pytest.mark.parametrize("value", ON)
def test_on_spellings_are_on(value: str) -> None:
    """1/true/yes/on in any case, spaces around them ignored."""
    assert Switch("X", default=False, on="a", off="b").read({"X": value}) is True


@pytest.mark.parametrize("value", OFF)
def test_off_spellings_are_off(value: str) -> None:
    """0/false/no/off in any case, spaces around them ignored ("0 " was on)."""
    assert SWITCH.read({SWITCH.name: value}) is False


@pytest.mark.parametrize(
    "environ", [{}, {"ATTN_DI_TEST_SWITCH": ""}, {"ATTN_DI_TEST_SWITCH": "  "}]
)
def test_unset_or_empty_is_the_default(environ: dict[str, str]) -> None:
    """An unset or empty variable leaves the switch at its default."""
    assert SWITCH.read(environ) is True
    assert Switch("ATTN_DI_TEST_SWITCH", default=False, on="a", off="b").read(environ) is False


@pytest.mark.parametrize("value", JUNK)
def test_anything_else_is_refused_by_name_listing_the_spellings(value: str) -> None:
    """A value that is neither on nor off is an EnvSwitchError (an InvalidInputError and a
    ValueError) naming the variable and the value, listing every accepted spelling."""
    with pytest.raises(EnvSwitchError) as info:
        SWITCH.read({SWITCH.name: value})

    error = info.value
    assert isinstance(error, InvalidInputError)
    assert isinstance(error, ValueError)
    assert (error.variable, error.argument, error.value) == (SWITCH.name, SWITCH.name, value)
    assert str(error) == (
        f"ATTN_DI_TEST_SWITCH: is {value!r}, not one of 1, true, yes, on (do it) or "
        "0, false, no, off (do not); any case, spaces around it ignored\n"
        "Hint: set ATTN_DI_TEST_SWITCH=1 (do it) or 0 (do not), or unset it for the default"
    )


@pytest.fixture(name="fresh_kernel_state")
def _fresh_kernel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's kernel status for one test (restored afterwards)."""
    monkeypatch.setattr(_cpu_kernel, "_STATUS", None)


@pytest.mark.usefixtures("fresh_kernel_state")
@pytest.mark.parametrize("value", OFF)
def test_the_kernel_switch_takes_every_off_spelling(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTN_DI_CPU_KERNEL: each off spelling chooses the pure-torch path."""
    monkeypatch.setenv(_cpu_kernel.ENV_SWITCH, value)
    status = _cpu_kernel.kernel_status()
    assert not status.active
    assert status.reason == f"switched off (ATTN_DI_CPU_KERNEL={value.strip().lower()})"


@pytest.mark.usefixtures("fresh_kernel_state")
@pytest.mark.parametrize("value", JUNK)
def test_the_kernel_switch_refuses_junk(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTN_DI_CPU_KERNEL: junk is refused by the one parser."""
    monkeypatch.setenv(_cpu_kernel.ENV_SWITCH, value)
    with pytest.raises(EnvSwitchError, match=r"ATTN_DI_CPU_KERNEL: is .*use the compiled kernel"):
        _cpu_kernel.kernel_status()


@pytest.mark.parametrize(("value", "compiled"), [(v, True) for v in ON] + [(v, False) for v in OFF])
def test_the_flex_compile_switch_takes_every_spelling(
    value: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTN_DI_FLEX_COMPILE: on for every on spelling ("true", "yes", "on" were off)."""
    monkeypatch.setenv(COMPILE_ENV_VAR, value)
    assert FlexAttentionImpl(2, 64, 0.125).compiled is compiled


@pytest.mark.parametrize("value", JUNK)
def test_the_flex_compile_switch_refuses_junk(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTN_DI_FLEX_COMPILE: junk is refused when an impl is created (it was silently off)."""
    monkeypatch.setenv(COMPILE_ENV_VAR, value)
    with pytest.raises(EnvSwitchError, match=r"ATTN_DI_FLEX_COMPILE: is "):
        FlexAttentionImpl(2, 64, 0.125)


_AUTO_PROBE = (
    "import os, attn_di\n"
    "attn_di.register_backend(attn_di.AttentionBackendEnum.CUSTOM, 'collections.Counter')\n"
    "print('ATTN_DI_REGISTRATIONS' in os.environ)\n"
)


def _import_with(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATTN_DI_AUTO_PROPAGATE": value}
    env.pop("ATTN_DI_REGISTRATIONS", None)
    return subprocess.run(
        [sys.executable, "-c", _AUTO_PROBE], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_auto_propagation_switch_takes_every_spelling_at_import() -> None:
    """ATTN_DI_AUTO_PROPAGATE at ``import attn_di``: "0 " and "False" are off (both were on),
    "TRUE" is on."""
    answers = {value: _import_with(value) for value in ("0 ", "False", "TRUE")}
    assert {value: done.stdout.strip() for value, done in answers.items()} == {
        "0 ": "False",
        "False": "False",
        "TRUE": "True",
    }, {value: done.stderr for value, done in answers.items()}


@pytest.mark.parametrize("value", ["disable", "nope"])
def test_the_auto_propagation_switch_refuses_junk_at_import(value: str) -> None:
    """ATTN_DI_AUTO_PROPAGATE=disable (or nope) turned propagation on; now ``import attn_di``
    refuses it, naming the variable."""
    done = _import_with(value)
    assert done.returncode != 0
    assert f"EnvSwitchError: ATTN_DI_AUTO_PROPAGATE: is {value!r}, not one of" in done.stderr


def test_the_attn_di_command_reports_a_bad_switch_in_one_line() -> None:
    """``attn-di`` started with a junk ATTN_DI_AUTO_PROPAGATE: one error line, a hint, exit 2."""
    env = {**os.environ, "ATTN_DI_AUTO_PROPAGATE": "nope"}
    done = subprocess.run(
        [sys.executable, "-m", "attn_di", "list"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0].startswith("attn-di: error: ATTN_DI_AUTO_PROPAGATE: is 'nope', not one of")
    assert lines[1].startswith("hint: set ATTN_DI_AUTO_PROPAGATE=1 (propagate every registration)")


def _switches_in_src() -> dict[str, bool]:
    """``{variable: default}`` of every ``Switch(...)`` made in src (found in the source, so
    the vLLM bridge's, whose module needs vLLM, is found too)."""
    found: dict[str, bool] = {}
    for path in sorted((ROOT / "src" / "attn_di").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Switch"):
                continue
            name = node.args[0]
            variable = name.value if isinstance(name, ast.Constant) else constants[name.id]  # type: ignore[attr-defined]
            default = next(k.value for k in node.keywords if k.arg == "default")
            found[variable] = ast.literal_eval(default)
    return found


def test_every_switch_is_in_the_docs_table_with_its_default() -> None:
    """docs/guides/reliability.md lists every on/off switch once, with its default."""
    switches = _switches_in_src()
    assert set(switches) == {
        "ATTN_DI_CPU_KERNEL",
        "ATTN_DI_FLEX_COMPILE",
        "ATTN_DI_AUTO_PROPAGATE",
        "ATTN_DI_VLLM_BRIDGE",
    }
    page = (ROOT / "docs" / "guides" / "reliability.md").read_text()
    rows = dict(re.findall(r"^\| `(ATTN_DI_\w+)` \| (on|off) \|", page, re.MULTILINE))
    assert rows == {name: "on" if default else "off" for name, default in switches.items()}


def test_no_module_reads_a_switch_by_hand() -> None:
    """No source file compares an environment value with an on/off spelling itself."""
    pattern = re.compile(r"environ.*\.(strip|lower)\(\)|getenv\(|environ\.get\([^)]*\) == ")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
