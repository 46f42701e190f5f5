"""attn_di's pytest plugin (pytest11 entry point), exercised by running pytest via pytester."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import attn_di

HEADER = """
import collections
import pytest
from attn_di import AttentionBackendEnum, BackendContainer, OverrideBackendFixture, get_container

TRITON = AttentionBackendEnum.TRITON_ATTN
"""


def _test_module(body: str) -> str:
    return HEADER + textwrap.dedent(body)


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Run pytest in-process, without plugins this project does not need there (faster)."""
    return pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:cacheprovider", *args)


def test_plugin_is_registered_through_its_entry_point(request: pytest.FixtureRequest) -> None:
    """pytest loads the plugin by the pytest11 entry point named attn_di."""
    assert request.config.pluginmanager.get_plugin("attn_di") is sys.modules["_attn_di_pytest"]


def test_container_fixture_is_fresh_and_clean(pytester: pytest.Pytester) -> None:
    """attn_di_container is the default container, new for each test, without registrations."""
    pytester.makepyfile(
        _test_module(
            """
        seen = []

        @pytest.mark.parametrize("run", [1, 2])
        def test_fresh(attn_di_container: BackendContainer, run: int) -> None:
            assert get_container() is attn_di_container
            assert attn_di_container not in seen
            seen.append(attn_di_container)
            assert not TRITON.is_overridden()
            from attn_di import register_backend
            register_backend(TRITON, "collections.OrderedDict")
            register_backend(f"PLUGIN_TEST_{run}", "collections.Counter")
        """
        )
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2)


def test_leaked_global_override_fails_the_test(pytester: pytest.Pytester) -> None:
    """An override layer left active errors the test at teardown, naming the member."""
    pytester.makepyfile(
        _test_module(
            """
        def test_leaks(attn_di_container: BackendContainer) -> None:
            attn_di_container.override(TRITON, collections.OrderedDict)

        def test_next_is_clean(attn_di_container: BackendContainer) -> None:
            assert not TRITON.is_overridden()
        """
        )
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks*"])
    output = result.stdout.str()
    assert "the test leaked override layers: global overrides of ['TRITON_ATTN']\n" in output
    assert "Hint: use `with container.override(...):`, call `.restore()`" in output


def test_leaked_local_override_fails_the_test(pytester: pytest.Pytester) -> None:
    """A context-local layer left active also errors the test, and is removed."""
    pytester.makepyfile(
        _test_module(
            """
        def test_leaks(attn_di_container: BackendContainer) -> None:
            attn_di_container.override({TRITON: "collections.Counter"}, local=True)

        def test_next_is_clean(attn_di_container: BackendContainer) -> None:
            assert not TRITON.is_overridden()
        """
        )
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    assert "leaked override layers: context-local overrides of ['TRITON_ATTN']" in (
        result.stdout.str()
    )


def test_override_backend_fixture_restores_after_the_test(pytester: pytest.Pytester) -> None:
    """override_backend's overrides hold for the test and are gone after it, without a leak."""
    pytester.makepyfile(
        _test_module(
            """
        def test_override(override_backend: OverrideBackendFixture) -> None:
            handle = override_backend(TRITON, collections.OrderedDict)
            override_backend({AttentionBackendEnum.CUSTOM: "collections.Counter"}, local=True)
            assert TRITON.get_class() is collections.OrderedDict
            assert AttentionBackendEnum.CUSTOM.get_class() is collections.Counter
            assert override_backend.container is get_container()
            assert handle.active

        def test_after() -> None:
            assert not TRITON.is_overridden()
            assert not AttentionBackendEnum.CUSTOM.is_overridden()
        """
        )
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2)


def test_marker_overrides_for_one_test_and_the_closest_wins(pytester: pytest.Pytester) -> None:
    """Module, class and function markers stack; the function's wins; all end with the test."""
    pytester.makepyfile(
        _test_module(
            """
        pytestmark = pytest.mark.attention_backend(TRITON, "collections.Counter")

        def test_module_marker() -> None:
            assert TRITON.get_class() is collections.Counter

        @pytest.mark.attention_backend({"TRITON_ATTN": collections.OrderedDict})
        class TestClass:
            def test_class_marker(self) -> None:
                assert TRITON.get_class() is collections.OrderedDict

            @pytest.mark.attention_backend("TRITON_ATTN", collections.defaultdict, local=True)
            @pytest.mark.attention_backend("CUSTOM", collections.deque)
            def test_function_marker(self, attn_di_container: BackendContainer) -> None:
                assert TRITON.get_class() is collections.defaultdict
                assert attn_di_container.source(TRITON) == "local override"
                assert AttentionBackendEnum.CUSTOM.get_class() is collections.deque
        """
        )
    )
    pytester.makepyfile(
        test_after="""
        from attn_di import AttentionBackendEnum

        def test_no_marker() -> None:
            assert not AttentionBackendEnum.TRITON_ATTN.is_overridden()
        """
    )
    result = _run(pytester, "--strict-markers")
    result.assert_outcomes(passed=4)


def test_marker_with_bad_arguments_errors_the_test(pytester: pytest.Pytester) -> None:
    """A marker naming an unknown member or lacking impl errors with the marker shown."""
    pytester.makepyfile(
        _test_module(
            """
        @pytest.mark.attention_backend("TRITON_ATN", collections.Counter)
        def test_unknown() -> None:
            pass

        @pytest.mark.attention_backend(TRITON)
        def test_no_impl() -> None:
            pass
        """
        )
    )
    result = _run(pytester)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "*@pytest.mark.attention_backend('TRITON_ATN', <class 'collections.Counter'>): *",
            "*did you mean 'TRITON_ATTN'*",
            "*@pytest.mark.attention_backend(<AttentionBackendEnum.TRITON_ATTN*",
        ]
    )


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    """``pytest --markers`` documents attention_backend (registered in pytest_configure)."""
    result = _run(pytester, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.attention_backend(member, impl, *, local=False):*"])


def test_fixture_type_is_exported() -> None:
    """OverrideBackendFixture is public, for annotations."""
    assert attn_di.OverrideBackendFixture.__module__ == "attn_di"
    assert "OverrideBackendFixture" in attn_di.__all__


def test_plugin_module_is_import_light() -> None:
    """Importing the plugin imports no torch, numpy, ray or backend module."""
    check = (
        "import sys, attn_di.pytest_plugin; "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'ray', 'vllm')"
        " or m.startswith('attn_di.backends')])"
    )
    output = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]"


@pytest.mark.parametrize("value", ["{not json", '{"CUSTOM": 3}', '{"bad name": "a.B"}'])
def test_a_malformed_inherited_variable_spares_suites_without_attn_di(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """The plugin loads in every pytest session: a malformed ATTN_DI_REGISTRATIONS fails only
    the tests that use attn_di's fixtures or marker, with attn_di's message, not start-up."""
    pytester.makepyfile(
        test_plain="def test_plain():\n    assert True\n",
        test_fixture="def test_fixture(attn_di_container):\n    pass\n",
        test_marker=(
            "import pytest\n\n"
            "@pytest.mark.attention_backend('CUSTOM', 'collections.Counter')\n"
            "def test_marker():\n    pass\n"
        ),
    )
    monkeypatch.setenv("ATTN_DI_REGISTRATIONS", value)
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_plain.py")
    plain.assert_outcomes(passed=1)
    assert plain.ret == 0
    used = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "test_fixture.py", "test_marker.py"
    )
    used.assert_outcomes(errors=2)
    used.stdout.fnmatch_lines(["*attn_di's pytest fixtures cannot start: *ATTN_DI_REGISTRATIONS*"])
    assert "Traceback" not in used.stdout.str()
