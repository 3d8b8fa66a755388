"""Reading settings from the environment: one reader per kind of value, each of which refuses a
value it cannot use with ImproperlyConfigured naming the variable, what it must be and the fix
(manage.py and the server print that one line and exit: telemachus/startup.py), and records what it
read, so `manage.py telemachus_check` can print every setting in force and where it came from.

Only telemachus/settings.py calls the readers (they run once, at import); everything else reads
Django's settings. What they record: `environment_read()`, in the order the settings read them."""

import difflib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
RATE = re.compile(r"[1-9][0-9]*/(s|sec|second|m|min|minute|h|hour|d|day)")
# An environment variable this close to a setting's name (difflib's ratio, names upper-cased) is
# taken for a misspelling of it: DATABSE_URL, DATABASE_URI, ALLOWED_HOST, SECRETKEY, database_url
# all are; DATABASE_POOL_SIZE (0.67), DATABASE_PREPARE (0.71) or DB_URL (0.67) are not.
MISSPELLING_RATIO = 0.85
# sysexits.h's EX_CONFIG: a configuration error. systemd units may list it in
# RestartPreventExitStatus=, so a process that cannot start as configured is not restarted forever.
EX_CONFIG = 78


@dataclass(frozen=True)
class EnvironmentSetting:
    """One variable as the settings read it: `shown` is its value as it may be printed (a secret
    as "(secret set)", a URL without its password), `source` "environment" or "default"."""

    name: str
    shown: str
    source: str


_read: dict[str, EnvironmentSetting] = {}


def environment_read() -> tuple[EnvironmentSetting, ...]:
    """Every variable the settings read, in the order they read them."""
    return tuple(_read.values())


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or empty (an empty value means "the default" for
    every setting, as `VAR= command` is how a shell unsets one for a command)."""
    raw = os.environ.get(name)
    return None if raw is None or raw.strip() == "" else raw.strip()


def _record(name: str, raw: str | None, default: object, *, secret: bool = False, url: bool = False) -> None:
    if raw is None:
        shown = "(not set)" if default in (None, "", []) else _display(default)
    elif secret:
        shown = "(secret set)"
    else:
        shown = url_without_password(raw) if url else raw
    _read[name] = EnvironmentSetting(name=name, shown=shown, source="environment" if raw is not None else "default")


def _display(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _refuse(name: str, raw: str, must: str, default: object) -> ImproperlyConfigured:
    fallback = "unset it" if default in (None, "", []) else f"unset it for the default ({_display(default)})"
    return ImproperlyConfigured(f"{name} must be {must}, got {raw!r}: set it to one, or {fallback}")


def env_str(name: str, default: str = "", *, secret: bool = False, url: bool = False) -> str:
    """Text as given. `secret`: never printed; `url`: printed without its password."""
    raw = _raw(name)
    _record(name, raw, default, secret=secret, url=url)
    return default if raw is None else raw


def env_bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    _record(name, raw, default)
    if raw is None:
        return default
    if raw.lower() in TRUE:
        return True
    if raw.lower() in FALSE:
        return False
    raise _refuse(name, raw, "a boolean (1 or 0, true or false, on or off)", default)


def env_int(name: str, default: int, *, minimum: int | None = None, unit: str = "") -> int:
    raw = _raw(name)
    _record(name, raw, default)
    if raw is None:
        return default
    what = f"a whole number{f' of {unit}' if unit else ''}{f', at least {minimum}' if minimum is not None else ''}"
    try:
        value = int(raw)
    except ValueError:
        raise _refuse(name, raw, what, default) from None
    if minimum is not None and value < minimum:
        raise _refuse(name, raw, what, default)
    return value


def env_float(name: str, default: float, *, minimum: float | None = None, unit: str = "") -> float:
    raw = _raw(name)
    _record(name, raw, default)
    if raw is None:
        return default
    what = f"a number{f' of {unit}' if unit else ''}{f', at least {_display(minimum)}' if minimum is not None else ''}"
    try:
        value = float(raw)
    except ValueError:
        raise _refuse(name, raw, what, default) from None
    if value != value or value in (float("inf"), float("-inf")) or (minimum is not None and value < minimum):
        raise _refuse(name, raw, what, default)
    return value


def env_list(name: str, default: list[str], *, secret: bool = False) -> list[str]:
    """Comma-separated; blanks dropped."""
    raw = _raw(name)
    _record(name, raw, default, secret=secret)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_counts(name: str) -> dict[str, int]:
    """`key=N,key=N` as a mapping to positive integers."""
    counts = {}
    for entry in env_list(name, []):
        key, sep, raw = entry.rpartition("=")
        if not sep or not key.strip() or not raw.strip().isdigit() or int(raw) < 1:
            raise ImproperlyConfigured(
                f"{name} entries must be name=N with N a positive whole number, got {entry!r}: fix it, or unset it"
            )
        counts[key.strip()] = int(raw)
    return counts


def env_rate(name: str, default: str) -> str:
    """A request rate, "N/s", "N/min", "N/hour" or "N/day"; set but empty turns it off."""
    raw = os.environ.get(name)
    value = default if raw is None else raw.strip()
    _read[name] = EnvironmentSetting(
        name=name, shown=value or "(off)", source="default" if raw is None else "environment"
    )
    if value and not RATE.fullmatch(value):
        raise _refuse(name, value, "N/s, N/min, N/hour or N/day (or empty: off)", default)
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = _raw(name)
    _record(name, raw, default)
    if raw is None:
        return default
    for choice in choices:
        if raw.lower() == choice.lower():
            return choice
    raise _refuse(name, raw, f"one of {', '.join(choices)}", default)


def env_note(name: str, default: str = "") -> None:
    """Record a variable read by something other than the settings (prometheus_client, bin/run),
    so the check prints it and a misspelling of it is caught."""
    _record(name, _raw(name), default)


def url_without_password(url: str) -> str:
    """The URL as it may be printed or logged: anything between `user:` and the last `@` replaced
    by ***. Not urllib's parse: a value that is not a valid URL (a missing "//", a port that is not
    a number) is what gets printed in an error, and must lose its password all the same. A URL
    with an `@` after the host (in its query) loses more than its password, never less."""
    head, at, host = url.rpartition("@")
    if not at:
        return url
    scheme, slashes, userinfo = head.rpartition("//")
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{slashes}{user}:***@{host}" if colon else url


def environment_misspellings(meant: str) -> list[str]:
    """Variables set in the environment that look like a misspelling of `meant` (which is unset):
    close to it, and not a name the settings read themselves."""
    if _raw(meant) is not None:
        return []
    return [
        name
        for name in sorted(os.environ)
        if name != meant
        and name not in _read
        and _raw(name) is not None
        and difflib.SequenceMatcher(None, name.upper(), meant).ratio() >= MISSPELLING_RATIO
    ]


def environment_misspelled() -> list[str]:
    """One line per variable set in the environment that looks like a misspelling of a setting the
    settings read and that is not set: `DATABSE_URL is set, DATABASE_URL is not: a misspelling?`."""
    lines = []
    for setting in environment_read():
        if setting.source == "default":
            for name in environment_misspellings(setting.name):
                lines.append(f"{name} is set but {setting.name} is not: a misspelling of {setting.name}?")
    return lines


@contextmanager
def configuration_errors_reported(program: str) -> Iterator[None]:
    """Inside: an ImproperlyConfigured (from the settings, or a start-up check) becomes one line on
    stderr, `<program>: configuration error: <message>`, and exit status EX_CONFIG, instead of a
    traceback. (Django's manage.py buries it under a `KeyError: '<command>'` raised first, while
    looking up a command of an app it could not load the settings for.) Needs no settings: manage.py
    and telemachus/serve.py enter it before Django is set up."""
    try:
        yield
    except ImproperlyConfigured as exc:
        sys.stdout.flush()
        print(f"{program}: configuration error: {one_line(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(EX_CONFIG) from None


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
