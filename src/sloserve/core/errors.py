"""Errors shared by every layer. The CLI turns ``ConfigError`` into one line and exit code 2."""


class SloserveError(Exception):
    """Base class of sloserve's own errors."""


class ConfigError(SloserveError, ValueError):
    """Bad user input: a file, field, value or limit that cannot be used. The message names it."""


class UnknownNameError(ConfigError, KeyError):
    """A name that is not in a registry; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str] | tuple[str, ...]) -> None:
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; valid: {', '.join(self.valid)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def yaml_error_message(exc: Exception) -> str:
    """A PyYAML parse error on one line, "line L, column C: what it found" (PyYAML's own text spans
    several lines, with an excerpt of the document)."""
    problem = getattr(exc, "problem", None)
    if not problem:
        return " ".join(str(exc).split())
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}{context + ': ' if context else ''}{problem}"
