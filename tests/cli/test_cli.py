"""The ``attn-di`` command, run as a subprocess as a user would."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--batch", "2", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-size", "64"]


def attn_di(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m attn_di ARGS`` (with ``env`` added to the environment), capturing output."""
    return subprocess.run(
        [sys.executable, "-m", "attn_di", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def error_and_hint(result: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The ``attn-di: error:`` line and the ``hint:`` line of a failed command."""
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    errors = [line for line in lines if line.startswith("attn-di: error: ")]
    hints = [line for line in lines if line.startswith("hint: ")]
    assert len(errors) == 1, result.stderr
    assert len(hints) == 1, result.stderr
    return errors[0].removeprefix("attn-di: error: "), hints[0].removeprefix("hint: ")


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


@pytest.mark.usefixtures("test_plugin")
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
    assert "plugin (tiny)" in table.stdout
    assert "tiny    attn-di-test-plugin 0.1.0  loaded  TINY_ATTN" in table.stdout
    assert "failed" in table.stdout
    assert "plugin (tiny from attn-di-test-plugin)" in attn_di("list", "--wide").stdout


def test_list_table_on_a_pipe() -> None:
    """list without --json prints a plain table when stdout is not a terminal."""
    result = attn_di("list")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["member", "path", "source", "imports"]
    assert any(line.startswith("CPU_ATTN ") and " yes" in line for line in lines)


def test_list_fits_100_columns_and_wide_shows_everything() -> None:
    """list's table fits 100 columns (paths wrapped at dots, vLLM's package shortened, reasons
    in a few words); --wide prints each member on one line with its whole path and error."""
    narrow = attn_di("list").stdout.splitlines()
    assert max(map(len, narrow)) <= 100
    assert (
        "(vllm... = vllm.v1.attention.backends.; whole paths and errors: attn-di list --wide)"
        in (narrow)
    )
    flash = next(line for line in narrow if line.startswith("FLASH_ATTN "))
    assert flash.split() == [
        "FLASH_ATTN", "vllm...flash_attn.FlashAttentionBackend", "default", "no", "needs", "vllm"
    ]  # fmt: skip
    wide = attn_di("list", "--wide").stdout.splitlines()
    flash = next(line for line in wide if line.startswith("FLASH_ATTN "))
    assert "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend" in flash
    assert flash.endswith("module not found (No module named 'vllm')")
    assert max(map(len, wide)) > 100


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


@pytest.mark.parametrize(
    ("extra", "env", "path"),
    [
        ([], {}, "compiled decode and prefill kernels ("),
        ([], {"ATTN_DI_CPU_KERNEL": "0"}, "pure torch: switched off (ATTN_DI_CPU_KERNEL=0)"),
        (["--prefill", "17"], {}, "compiled decode and prefill kernels ("),
    ],
    ids=["decode", "switched-off", "prefill"],
)
def test_run_says_which_cpu_attn_path_ran(extra: list[str], env: dict[str, str], path: str) -> None:
    """run names CPU_ATTN's path (kernel or pure torch and why) in --json and under the table;
    a prefill takes the compiled kernels too."""
    from attn_di.backends import _cpu_kernel

    if path.startswith("compiled") and shutil.which(_cpu_kernel._compiler()) is None:
        pytest.skip("no C++ compiler: CPU_ATTN's kernel is not built")
    args = ["run", "--backend", "all", *SMALL, *extra, "--iters", "1"]

    as_json, table = attn_di(*args, "--json", **env), attn_di(*args, **env)

    assert as_json.returncode == 0, as_json.stderr
    results = {r["backend"]: r for r in json.loads(as_json.stdout)["results"]}
    assert results["CPU_ATTN"]["decode_path"].startswith(path)
    assert all("decode_path" not in r for name, r in results.items() if name != "CPU_ATTN")
    ran = [line for line in table.stdout.splitlines() if line.startswith("CPU_ATTN ran: ")]
    assert ran == [f"CPU_ATTN ran: {results['CPU_ATTN']['decode_path']}"]


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
        (["run", "--backend", "FLASH_ATN"], "Unknown attention backend: 'FLASH_ATN'"),
        (["run", "--heads", "30", "--kv-heads", "8"], "--kv-heads: 8 does not divide --heads 30"),
        (["run", "--batch", "0"], "--batch: must be positive, got 0"),
        (["run", "--context", "-5"], "--context: must be >= 0, got -5"),
        (["run", "--dtype", "float33"], "dtype: unknown dtype 'float33'"),
        (["run", "--dtype", "bfloat"], "--dtype: unknown dtype 'bfloat'"),
        (["select", "--head-size", "0", "--dtype", "bf16"],
         "head_size: must be a positive int, got 0"),
        (["select", "--head-size", "64", "--dtype", "bf16", "--device", "tpu"],
         "unknown device 'tpu'"),
        (["select", "--head-size", "64", "--dtype", "bf16", "--backend", "nope"],
         "Unknown attention backend: 'nope'"),
        (["run", "--batch", "100000", "--context", "1000000"], "this batch needs about"),
        (["run", "--block-size", "10000000"], "this batch needs about"),
        (["run", "--backend", "NO_ATTENTION"], "NO_ATTENTION is attention-free"),
        (["run", "--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
        (["bogus"], "unknown command 'bogus' (choose from list, select, run, conform)"),
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


def test_version() -> None:
    """--version prints the installed distribution's version."""
    from importlib.metadata import version

    result = attn_di("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"attn-di {version('attn-di')}"


def test_help_shows_the_defaults() -> None:
    """run --help shows each option's default, the values the run uses."""
    result = attn_di("run", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for fragment in (
        "sequences in the batch (default: 8)",
        "cached tokens per sequence (default: 2048)",
        "query heads (default: 32)",
        "float32, bfloat16 or float16 (default: float32)",
    ):
        assert fragment in text


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["run", "--batsh", "3"], "did you mean --batch? see `attn-di run --help`"),
        (["select", "--head-size", "64", "--dtype", "bf16", "--bogus"],
         "see `attn-di select --help`"),
        (["list", "--jsn"], "did you mean --json? see `attn-di list --help`"),
        (["run", "--batch", "abc"], "see `attn-di run --help`"),
    ],
)  # fmt: skip
def test_a_bad_option_points_to_its_subcommands_help(args: list[str], hint: str) -> None:
    """An unknown or malformed option of a subcommand names that subcommand's help."""
    result = attn_di(*args)
    assert result.returncode == 2
    assert error_and_hint(result)[1] == hint


@pytest.mark.parametrize(
    ("args", "error", "hint"),
    [
        (["--registr", "X=mod:Cls"], "unrecognized arguments: --registr",
         "did you mean --register? see `attn-di --help`"),
        (["--registr", "X=mod:Cls", "run"], "unrecognized arguments: --registr",
         "did you mean --register? see `attn-di run --help`"),
        (["run", "--registr", "X=mod:Cls"], "unrecognized arguments: --registr X=mod:Cls",
         "did you mean --register? see `attn-di run --help`"),
        (["--imprt", "my_pkg", "list"], "unrecognized arguments: --imprt",
         "did you mean --import? see `attn-di list --help`"),
        (["run", "--versin"], "unrecognized arguments: --versin",
         "did you mean --version (before `run`)? see `attn-di --help`"),
        (["--bogus"], "unrecognized arguments: --bogus", "see `attn-di --help`"),
        (["--head-siz", "64", "select"], "unrecognized arguments: --head-siz",
         "did you mean --head-size (after `select`)? see `attn-di select --help`"),
        (["nosuchcmd", "--registr", "x"],
         "unknown command 'nosuchcmd' (choose from list, select, run, conform)",
         "see `attn-di --help`"),
    ],
)  # fmt: skip
def test_a_global_option_typo_suggests_the_option(args: list[str], error: str, hint: str) -> None:
    """A typo of --register, --import or --version, before or after the command, is named
    and the closest option among attn-di's own and the command's is suggested; a command's
    option typed before it is told to go after it; an unknown command is the error reported."""
    result = attn_di(*args)
    assert result.returncode == 2
    assert error_and_hint(result) == (error, hint)


def test_a_missing_option_value_is_not_taken_for_a_typo() -> None:
    """--import followed by an option keeps argparse's own message (the value is missing)."""
    result = attn_di("--import", "-x", "list")
    assert result.returncode == 2
    assert error_and_hint(result)[0] == "argument --import: expected one argument"


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["run", "--batch", "0"], "e.g. --batch 8"),
        (["run", "--heads", "0"], "e.g. --heads 32"),
        (["run", "--iters", "-1"], "e.g. --iters 5"),
        (["run", "--heads", "30"], "GQA needs heads to be a multiple of kv-heads, "
         "e.g. --heads 32 --kv-heads 8"),
        (["run", "--dtype", "bfloat"], "did you mean 'bfloat16'?"),
        (["run", "--dtype", "fp3"], "did you mean 'float32'?"),
        (["run", "--threads", "0"], "e.g. --threads 1"),
    ],
)  # fmt: skip
def test_hints_quote_the_real_defaults(args: list[str], hint: str) -> None:
    """Hint examples are the defaults of `attn-di run` (and --dtype bfloat suggests bfloat16)."""
    result = attn_di(*args)
    assert result.returncode == 2
    assert error_and_hint(result)[1] == hint


def test_unknown_backend_is_refused_before_torch_is_imported() -> None:
    """--backend typo: the error names --backend, suggests the name, points to attn-di list."""
    code = (
        "import sys\n"
        "from attn_di.cli import main\n"
        "code = main(['run', '--backend', 'FLASH_ATN'])\n"
        "print('torch' in sys.modules, code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.stdout.split() == ["False", "2"]
    error, hint = error_and_hint(result)
    assert error.startswith("--backend: Unknown attention backend: 'FLASH_ATN'")
    assert hint == "did you mean 'FLASH_ATTN'? `attn-di list` shows every backend"


@pytest.mark.parametrize("command", [["run"], ["select", "--head-size", "64", "--dtype", "bf16"]])
def test_an_unknown_name_in_attn_di_backend_names_the_variable(command: list[str]) -> None:
    """ATTN_DI_BACKEND=cpu_atn: the error and the hint name the variable and suggest CPU_ATTN."""
    result = attn_di(*command, ATTN_DI_BACKEND="cpu_atn")
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.startswith("ATTN_DI_BACKEND='cpu_atn': Unknown attention backend: 'cpu_atn'")
    assert hint == "did you mean ATTN_DI_BACKEND=CPU_ATTN? `attn-di list` shows every backend"
    far = attn_di(*command, ATTN_DI_BACKEND="nope")
    assert error_and_hint(far)[1] == (
        "unset ATTN_DI_BACKEND (or set it to auto) to let attn_di choose; "
        "`attn-di list` shows every backend"
    )


@pytest.mark.parametrize("value", ["all", "ALL"])
@pytest.mark.parametrize("command", [["run"], ["select", "--head-size", "64", "--dtype", "bf16"]])
def test_all_in_attn_di_backend_says_where_all_is_accepted(command: list[str], value: str) -> None:
    """ATTN_DI_BACKEND=all: no far-fetched suggestion; the hint says only `attn-di run
    --backend all` takes it, and the error lists the member names."""
    result = attn_di(*command, ATTN_DI_BACKEND=value)
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.startswith(f"ATTN_DI_BACKEND={value!r}: Unknown attention backend: {value!r}.")
    assert "Valid options are: FLASH_ATTN, " in error
    assert "CPU_ATTN" in error
    assert hint == (
        "`all` is accepted only by `attn-di run --backend all`, not by ATTN_DI_BACKEND: "
        "set it to one backend name or unset it; `attn-di list` shows every backend"
    )
    assert "PALLAS?" not in result.stderr


def test_backend_all_outside_run_says_where_all_is_accepted() -> None:
    """select --backend all: the hint names `attn-di run --backend all`, no suggestion."""
    result = attn_di("select", "--head-size", "64", "--dtype", "bf16", "--backend", "all")
    assert result.returncode == 2
    assert error_and_hint(result)[1] == (
        "`all` is accepted only by `attn-di run --backend all`; `attn-di list` shows every backend"
    )


@pytest.mark.parametrize("typo", ["alll", "al"])
def test_a_typo_of_all_is_answered_with_all(typo: str) -> None:
    """A near miss of `all`: `run` suggests it and lists it among the valid options; any other
    command says only `run` takes it (never PALLAS)."""
    result = attn_di("run", "--backend", typo)
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.endswith("CPU_ATTN, CUSTOM, auto, all")
    assert hint.startswith("did you mean 'all' (every backend, one after another)?")
    result = attn_di("select", "--head-size", "64", "--dtype", "bf16", "--backend", typo)
    assert result.returncode == 2
    assert error_and_hint(result)[1] == (
        "did you mean all? `all` is accepted only by `attn-di run --backend all`; "
        "`attn-di list` shows every backend"
    )
    assert "PALLAS?" not in result.stderr


def test_a_backend_refused_from_attn_di_backend_says_so() -> None:
    """ATTN_DI_BACKEND=FLASH_ATTN on this CPU: the refusal and its hint name the variable."""
    result = attn_di("run", "--iters", "1", ATTN_DI_BACKEND="FLASH_ATTN")
    assert result.returncode == 1
    error, hint = error_and_hint(result)
    assert error.startswith("attention backend FLASH_ATTN (from ATTN_DI_BACKEND) cannot run")
    assert hint.startswith("ATTN_DI_BACKEND=FLASH_ATTN asked for it: unset ATTN_DI_BACKEND")
    assert "--backend auto" not in hint  # --backend auto does not override the variable


def test_a_refused_backend_option_hints_at_auto_or_at_vllm() -> None:
    """--backend FLASH_ATTN on this CPU: exit 1; the hint says how to set vLLM up where vLLM
    is missing (the class cannot even be imported), else it is about --backend auto."""
    result = attn_di("run", "--backend", "FLASH_ATTN")
    assert result.returncode == 1
    error, hint = error_and_hint(result)
    assert error.startswith("attention backend FLASH_ATTN (from --backend) cannot run")
    if importlib.util.find_spec("vllm") is None:
        assert hint.startswith("vLLM is not installed here: set it up with")
        assert "bash scripts/setup-vllm.sh" in hint
    else:
        assert hint.startswith("use --backend auto to let attn_di choose")


@pytest.mark.parametrize(
    ("args", "label", "part"),
    [
        (["--batch", "100000000", "--context", "100000000"], "--batch and --context",
         "the KV cache (--batch 100000000, --context 100000000)"),
        (["--batch", "1", "--context", "100000000"], "--context",
         "the KV cache (--context 100000000)"),
        (["--block-size", "10000000"], "--block-size", "the KV cache (--block-size 10000000)"),
        (["--batch", "1", "--context", "100000", "--prefill", "100000", "--heads", "64",
          "--kv-heads", "1"], "--prefill and --context and --heads", "the attention scores"),
    ],
)  # fmt: skip
def test_memory_refusal_is_instant_and_names_its_cause(
    args: list[str], label: str, part: str
) -> None:
    """Absurd sizes are refused from the sizes alone (no torch), labelled by the inputs at fault."""
    code = (
        "import sys\n"
        "from attn_di.cli import main\n"
        f"code = main(['run', *{args!r}])\n"
        "print('torch' in sys.modules, code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["False", "2"]
    error, hint = error_and_hint(result)
    assert error.startswith(f"{label}: this batch needs about ")
    assert f" GB of it for {part}" in error
    assert hint.startswith("lower ")


def test_memory_estimate_is_linear_in_context_for_decode() -> None:
    """Decode: doubling --context doubles the estimate (no quadratic term), and 8k tokens fit."""
    from argparse import Namespace

    from attn_di.cli._main import RUN_DEFAULTS
    from attn_di.cli._run import estimate_memory

    def total(context: int) -> int:
        args = Namespace(**{**RUN_DEFAULTS, "batch": 1, "context": context})
        return estimate_memory(args, 4).total

    assert total(2 * 2**20) / total(2**20) == pytest.approx(2, rel=1e-3)
    assert total(8192) < 2e9  # batch 1, 8k tokens of decode: once estimated at ~18 GB


def test_float64_is_refused_like_everywhere_else() -> None:
    """run --dtype float64 is refused by selection, as the example engine's --dtype float64 is."""
    result = attn_di("run", "--dtype", "float64")
    assert result.returncode == 1
    error, _ = error_and_hint(result)
    assert "dtype='float64'" in error
    assert "CPU_ATTN: dtype not supported" in result.stderr
    example = Path(__file__).parents[2] / "examples" / "tiny_llm" / "generate.py"
    generated = subprocess.run(
        [sys.executable, str(example), "--dtype", "float64", "--tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 2
    assert "Traceback" not in generated.stderr
    assert "dtype='float64'" in generated.stderr
    assert "CPU_ATTN: dtype not supported" in generated.stderr


def test_threads_and_load_average_are_reported() -> None:
    """run --threads 1 runs with one torch thread and reports it with the load average; a
    caller that chose its threads gets no busy-machine warning."""
    result = attn_di("run", *SMALL, "--iters", "1", "--threads", "1", "--json")
    assert result.returncode == 0, result.stderr
    machine = json.loads(result.stdout)["machine"]
    assert machine["threads"] == 1
    assert machine["load_average"] == pytest.approx(os.getloadavg()[0], abs=5)
    assert machine["cpus"] == os.cpu_count()
    table = attn_di("run", *SMALL, "--iters", "1", "--threads", "1")
    assert "timed with 1 torch thread(s) on " in table.stdout
    assert "load average " in table.stdout
    assert "attn-di: warning" not in table.stderr  # threads chosen: no advice about them


def test_a_closed_pipe_ends_quietly() -> None:
    """`attn-di list | head -1`: the reader is gone; exit 0, nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "attn_di", "list"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0
    assert result.stderr == ""


@pytest.mark.parametrize("value", ["{", "[1]", '{"CUSTOM": 3}'])
def test_malformed_registrations_variable_is_one_line(value: str) -> None:
    """A malformed ATTN_DI_REGISTRATIONS: one error line and a hint, exit 2 (console script too)."""
    result = attn_di("list", ATTN_DI_REGISTRATIONS=value)
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.startswith("cannot apply the registrations inherited in ATTN_DI_REGISTRATIONS")
    assert "ATTN_DI_REGISTRATIONS is written by" in hint
    script = shutil.which("attn-di", path=str(Path(sys.executable).parent))
    assert script is not None
    by_script = subprocess.run(
        [script, "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ATTN_DI_REGISTRATIONS": value},
    )
    assert by_script.returncode == 2
    assert error_and_hint(by_script) == (error, hint)


REGISTRATIONS = ["--register", "MY_ATTN=attn_di.backends.cpu_attn:CPUAttentionBackend"]


@pytest.mark.parametrize(
    "args",
    [
        [*REGISTRATIONS, "run", "--backend", "MY_ATTN", *SMALL, "--iters", "1", "--json"],
        ["run", *REGISTRATIONS, "--backend", "my_attn", *SMALL, "--iters", "1", "--json"],
    ],
)
def test_register_before_or_after_the_subcommand(args: list[str]) -> None:
    """--register NAME=PATH adds a member for one invocation; run uses it by name."""
    result = attn_di(*args)
    assert result.returncode == 0, result.stderr
    (record,) = json.loads(result.stdout)["results"]
    assert record["backend"] == "MY_ATTN"
    assert record["passed"] is True


def test_register_is_repeatable_and_shown_by_list() -> None:
    """Two --register options: list shows the new runtime member and the registered CUSTOM."""
    result = attn_di(
        *REGISTRATIONS, "list", "--register", "CUSTOM=collections:OrderedDict", "--json"
    )
    assert result.returncode == 0, result.stderr
    records = {r["name"]: r for r in json.loads(result.stdout)["members"]}
    assert records["MY_ATTN"]["path"] == "attn_di.backends.cpu_attn:CPUAttentionBackend"
    assert records["MY_ATTN"]["runtime_member"] is True
    assert records["MY_ATTN"]["imports"] is True
    assert records["CUSTOM"]["path"] == "collections:OrderedDict"
    assert records["CUSTOM"]["source"] == "registered"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("MY_ATTN", "--register: expected NAME=pkg.module:Class, got 'MY_ATTN'"),
        ("MY_ATTN=not a path", "--register: MY_ATTN=not a path: "),
        ("wire=a.b:C", "--register: wire=a.b:C: Invalid or reserved backend name"),
    ],
)
def test_a_bad_register_is_one_line(spec: str, message: str) -> None:
    """A malformed --register spec, path or reserved name: one error line, exit 2."""
    result = attn_di("--register", spec, "list")
    assert result.returncode == 2
    error, _ = error_and_hint(result)
    assert error.startswith(message)


def test_import_runs_the_modules_registrations(tmp_path: Path) -> None:
    """--import MODULE (found from the current directory) applies its @register_backend."""
    tmp_path.joinpath("my_backends.py").write_text(
        "from attn_di import register_backend\n"
        "from attn_di.backends.cpu_attn import CPUAttentionBackend\n\n"
        "@register_backend('IMPORTED_ATTN')\n"
        "class ImportedBackend(CPUAttentionBackend):\n"
        "    pass\n"
    )
    script = shutil.which("attn-di", path=str(Path(sys.executable).parent))
    assert script is not None
    result = subprocess.run(
        [script, "run", "--import", "my_backends", "--backend", "IMPORTED_ATTN", *SMALL,
         "--iters", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["backend"] == "IMPORTED_ATTN"
    missing = attn_di("--import", "no_such_module_here", "list")
    assert missing.returncode == 2
    assert error_and_hint(missing)[0] == (
        "--import: cannot import 'no_such_module_here': No module named 'no_such_module_here'"
    )


def test_example_engine_takes_threads_and_reports_the_load() -> None:
    """generate.py --threads 1: one torch thread, reported next to the per-token latency."""
    example = Path(__file__).parents[2] / "examples" / "tiny_llm" / "generate.py"
    result = subprocess.run(
        [sys.executable, str(example), "--tokens", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    timing = result.stdout.splitlines()[-1]
    assert timing.startswith("prefill ")
    assert "1 torch thread(s), load average " in timing
    refused = subprocess.run(
        [sys.executable, str(example), "--threads", "0"], capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert "--threads must be at least 1" in refused.stderr


def test_list_shows_cpu_attn_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """list names CPU_ATTN's path: its compiled decode and prefill kernels, or pure torch when
    switched off."""
    import warnings

    from attn_di.backends import _cpu_kernel

    with warnings.catch_warnings():  # where the kernel is unavailable, the status says why
        warnings.simplefilter("ignore")
        expected = _cpu_kernel.kernel_status().describe()
    assert json.loads(attn_di("list", "--json").stdout)["cpu_attn_decode"] == expected
    monkeypatch.setenv("ATTN_DI_CPU_KERNEL", "0")
    table = attn_di("list")
    assert "CPU_ATTN runs: pure torch: switched off (ATTN_DI_CPU_KERNEL=0)" in table.stdout


def test_threads_has_an_upper_bound() -> None:
    """--threads far past the machine's CPUs is refused (torch itself can crash on it)."""
    result = attn_di("run", "--threads", "100000", "--batch", "1", "--context", "16")
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.startswith("--threads: must be at most ")
    assert hint == f"e.g. --threads {os.cpu_count()}"


def test_register_finds_modules_in_the_current_directory(tmp_path: Path) -> None:
    """--register NAME=pkg.mod:Class finds pkg in the current directory, as --import does;
    mamba:NAME registers a Mamba backend."""
    tmp_path.joinpath("my_local_backends.py").write_text("class Local:\n    pass\n")
    script = shutil.which("attn-di", path=str(Path(sys.executable).parent))
    assert script is not None
    result = subprocess.run(
        [script, "--register", "LOCAL_ATTN=my_local_backends:Local",
         "--register", "mamba:LOCAL_SSM=my_local_backends:Local", "list", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    attention = {record["name"]: record for record in listing["members"]}
    mamba = {record["name"]: record for record in listing["mamba_members"]}
    assert attention["LOCAL_ATTN"]["imports"] is True
    assert mamba["LOCAL_SSM"]["imports"] is True
    assert "LOCAL_SSM" not in attention


def test_attention_free_backend_from_the_environment_names_the_variable() -> None:
    """ATTN_DI_BACKEND=no_attention: the refusal names the variable, not --backend."""
    result = attn_di("run", ATTN_DI_BACKEND="no_attention")
    assert result.returncode == 2
    error, hint = error_and_hint(result)
    assert error.startswith("ATTN_DI_BACKEND='no_attention': NO_ATTENTION is attention-free")
    assert (
        hint
        == "unset ATTN_DI_BACKEND or set it to a computing backend, e.g. ATTN_DI_BACKEND=CPU_ATTN"
    )


def test_an_unwritable_output_is_one_line() -> None:
    """list > /dev/full (no space left): one error line and exit 1, never a traceback."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "attn_di", "list"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0] == (
        "attn-di: error: cannot write the output: No space left on device"
    )


def test_an_unregistered_custom_hints_at_register() -> None:
    """run --backend CUSTOM with nothing registered: the hint gives the --register route."""
    result = attn_di("run", "--backend", "custom")
    assert result.returncode == 1
    _, hint = error_and_hint(result)
    assert hint == (
        "register a class for it in this run: --register CUSTOM=pkg.module:Class "
        "(or --import a module that registers it)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--import", "../evil", "list"], "--import: '../evil' is not a module name"),
        (["--import", "", "list"], "--import: an empty name is not a module name"),
        (["list", "--import", ".hidden"], "--import: '.hidden' is not a module name"),
        (["--import", "a b", "list"], "--import: 'a b' is not a module name"),
        (["run", "--seed", "99999999999999999999999"], "--seed: must be in [0, 2**64 - 1]"),
        (["run", "--seed", "-1"], "--seed: must be in [0, 2**64 - 1]"),
        (["run", "--iters", "99999999999999999999"], "--iters: must be at most 10,000"),
    ],
)
def test_every_bad_argument_is_one_line(args: list[str], message: str) -> None:
    """Module names that are paths or empty, seeds outside torch's range, absurd iteration
    counts: one ``attn-di: error:`` line and a hint, exit 2, never a traceback."""
    result = attn_di(*args)
    assert result.returncode == 2, result.stderr
    error, _ = error_and_hint(result)
    assert error.startswith(message), error


def test_a_path_given_to_import_hints_at_the_module_name() -> None:
    """``--import ../pkg/mod.py`` hints at ``--import mod``."""
    result = attn_di("--import", "../pkg/my_mod.py", "list")
    assert error_and_hint(result)[1].endswith("pass --import my_mod")


@pytest.mark.parametrize(
    ("source", "reason"),
    [("raise RuntimeError('boom')", "RuntimeError: boom"), ("raise SystemExit(0)", "SystemExit")],
)
def test_a_module_that_fails_at_import_is_one_line(
    tmp_path: Path, source: str, reason: str
) -> None:
    """--import of a module raising (SystemExit(0) too) at import: one line, exit 2."""
    (tmp_path / "failing_at_import.py").write_text(source + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "attn_di", "--import", "failing_at_import", "list"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    error = error_and_hint(result)[0]
    assert error.startswith(f"--import: importing 'failing_at_import' raised {reason}"), error


def test_a_backend_module_that_exits_at_import_is_listed_as_not_importing(tmp_path: Path) -> None:
    """A registered backend whose module raises SystemExit(0) at import: ``attn-di list``
    shows every member and that one as not importing, and exits 0 with its output."""
    (tmp_path / "exits_at_import.py").write_text("raise SystemExit(0)\n")
    result = subprocess.run(
        [sys.executable, "-m", "attn_di", "--register", "EXITING=exits_at_import:Backend",
         "list", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = {record["name"]: record for record in json.loads(result.stdout)["members"]}
    assert records["EXITING"]["imports"] is False
    assert "SystemExit" in records["EXITING"]["error"]
    assert records["CPU_ATTN"]["imports"] is True
