"""The ``attn-di`` command, run as a subprocess as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--batch", "2", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-size", "64"]


def attn_di(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m attn_di ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "attn_di", *args], capture_output=True, text=True, timeout=300
    )


def test_list_json_describes_every_member() -> None:
    """list --json: one record per member with path, source and whether it imports."""
    result = attn_di("list", "--json")
    assert result.returncode == 0, result.stderr
    records = {record["name"]: record for record in json.loads(result.stdout)["members"]}
    assert records["CPU_ATTN"]["imports"] is True
    assert records["CPU_ATTN"]["source"] == "default"
    assert records["CPU_ATTN"]["path"] == "attn_di.backends.cpu_attn.CPUAttentionBackend"
    assert records["FLASH_ATTN"]["imports"] is False
    assert "module not found" in records["FLASH_ATTN"]["error"]
    assert records["CPU_ATTN"]["plugin"] is None


def test_list_shows_plugins_and_their_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """list names the distribution behind each plugin registration and each failed plugin."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny,broken")
    result = attn_di("list", "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    payload = json.loads(result.stdout)
    records = {record["name"]: record for record in payload["members"]}
    assert records["TINY_ATTN"]["source"] == "plugin"
    assert records["TINY_ATTN"]["plugin"] == "tiny from attn-di-test-plugin"
    assert records["TINY_ATTN"]["runtime_member"] is True
    plugins = {plugin["name"]: plugin for plugin in payload["plugins"]}
    assert plugins["tiny"]["status"] == "loaded"
    assert plugins["tiny"]["distribution"] == "attn-di-test-plugin"
    assert plugins["tiny"]["members"] == ["TINY_ATTN"]
    assert plugins["broken"]["status"] == "failed"
    assert "fails on purpose" in plugins["broken"]["error"]
    assert records["FLASH_ATTN"]["source"] == "default"  # the failed plugin's work was undone
    table = attn_di("list")
    assert "tiny from attn-di-test-plugin" in table.stdout
    assert "failed" in table.stdout


def test_list_table_on_a_pipe() -> None:
    """list without --json prints a plain table when stdout is not a terminal."""
    result = attn_di("list")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["member", "path", "source", "imports"]
    assert any(line.startswith("CPU_ATTN ") and " yes" in line for line in lines)


def test_select_json() -> None:
    """select --json: the chosen backend, its origin and the rejected candidates."""
    result = attn_di(
        "select", "--head-size", "128", "--dtype", "bfloat16", "--device", "cpu", "--json"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["backend"] == "CPU_ATTN"
    assert payload["origin"] == "auto"
    assert payload["config"]["dtype"] == "bfloat16"
    assert payload["rejected"] == {}


def test_select_reports_rejections_and_fails_without_a_backend() -> None:
    """select --mla on the CPU: exit 1 with every candidate and its reason, no traceback."""
    result = attn_di("select", "--head-size", "128", "--dtype", "bf16", "--mla", "--device", "cpu")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("attn-di: error: no valid attention backend")
    assert "CPU_ATTN: MLA not supported" in result.stderr
    assert "hint:" in result.stderr


def test_select_forced_backend_on_gpu_device() -> None:
    """A forced backend is validated for the given device: CPU_ATTN refuses cuda:9.0."""
    result = attn_di(
        "select", "--head-size", "128", "--dtype", "bf16", "--device", "cuda:9.0",
        "--backend", "cpu_attn", "--json",
    )  # fmt: skip
    assert result.returncode == 1
    assert "compute capability not supported" in result.stderr


def test_run_all_json_checks_every_cpu_backend() -> None:
    """run --backend all: each CPU backend passes the float64 check; the rest are skipped."""
    result = attn_di("run", "--backend", "all", *SMALL, "--iters", "1", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    names = [r["backend"] for r in payload["results"]]
    assert names == ["CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"]
    for record in payload["results"]:
        assert record["passed"] is True
        assert record["max_abs_error"] <= record["tolerance"]
        assert record["median_ms"] > 0
        assert record["tokens_per_s"] > 0
    assert "NO_ATTENTION" in payload["skipped"]
    assert "FLASH_ATTN" in payload["skipped"]


def test_run_mixed_prefill_and_decode_table() -> None:
    """run with --prefill and bf16: a table with a pass for the selected backend."""
    result = attn_di("run", *SMALL, "--prefill", "16", "--dtype", "bfloat16", "--iters", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("mixed (16-token prefills + decode)")
    assert any(
        line.startswith("CPU_ATTN ") and " pass " in line for line in result.stdout.splitlines()
    )


def test_run_exits_non_zero_when_a_check_fails(tmp_path: pytest.TempPathFactory) -> None:
    """A registered backend computing wrong results makes run exit 1 with FAIL."""
    code = (
        "import sys, attn_di\n"
        "from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl\n"
        "class WrongImpl(CPUAttentionImpl):\n"
        "    def forward(self, *args, **kwargs):\n"
        "        return super().forward(*args, **kwargs) + 1.0\n"
        "class Wrong(CPUAttentionBackend):\n"
        "    @staticmethod\n"
        "    def get_impl_cls():\n"
        "        return WrongImpl\n"
        "attn_di.register_backend('CPU_ATTN', Wrong)\n"
        "from attn_di.cli import main\n"
        f"sys.exit(main(['run', *{SMALL!r}, '--iters', '1']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert "FAIL" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--backend", "FLASH_ATN"], "unknown attention backend 'FLASH_ATN'"),
        (["run", "--heads", "30", "--kv-heads", "8"], "--kv-heads: 8 does not divide --heads 30"),
        (["run", "--batch", "0"], "--batch: must be positive, got 0"),
        (["run", "--context", "-5"], "--context: must be >= 0, got -5"),
        (["run", "--dtype", "float33"], "dtype: unknown dtype 'float33'"),
        (["run", "--dtype", "float64"], "float64 is not run here"),
        (["select", "--head-size", "0", "--dtype", "bf16"],
         "head_size: must be a positive int, got 0"),
        (["select", "--head-size", "64", "--dtype", "bf16", "--device", "tpu"],
         "unknown device 'tpu'"),
        (["select", "--head-size", "64", "--dtype", "bf16", "--backend", "nope"],
         "unknown attention backend 'nope'"),
        (["run", "--batch", "100000", "--context", "1000000"], "this batch needs about"),
        (["run", "--block-size", "10000000"], "this batch needs about"),
        (["run", "--backend", "NO_ATTENTION"], "NO_ATTENTION is attention-free"),
        (["run", "--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
        (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_a_hint(args: list[str], message: str) -> None:
    """Bad names, shapes and dtypes: exit 2, one error line and a hint, never a traceback."""
    result = attn_di(*args)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    first, *rest = result.stderr.splitlines()
    assert first.startswith("attn-di: error: ")
    assert message in first
    assert any(line.startswith("hint: ") for line in rest)


def test_list_reports_unknown_allowlisted_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name in ATTN_DI_PLUGINS that no installed plugin has is reported, not ignored."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "nosuch")
    result = attn_di("list", "--json")
    assert json.loads(result.stdout)["missing_plugins"] == ["nosuch"]
    table = attn_di("list")
    assert "ATTN_DI_PLUGINS names 'nosuch', but no installed plugin has that name" in table.stdout


def test_console_script_is_installed() -> None:
    """The attn-di console script exists and shows the subcommands."""
    executable = shutil.which("attn-di", path=str(Path(sys.executable).parent))
    assert executable is not None
    result = subprocess.run([executable, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.startswith("usage: attn-di")
    for command in ("list", "select", "run"):
        assert f"    {command} " in result.stdout


def test_list_shows_cpu_attn_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """list names CPU_ATTN's decode path: the compiled kernel, or pure torch when switched off."""
    import warnings

    from attn_di.backends import _cpu_kernel

    with warnings.catch_warnings():  # where the kernel is unavailable, the status says why
        warnings.simplefilter("ignore")
        expected = _cpu_kernel.kernel_status().describe()
    assert json.loads(attn_di("list", "--json").stdout)["cpu_attn_decode"] == expected
    monkeypatch.setenv("ATTN_DI_CPU_KERNEL", "0")
    table = attn_di("list")
    assert "CPU_ATTN decode: pure torch: switched off (ATTN_DI_CPU_KERNEL=0)" in table.stdout
