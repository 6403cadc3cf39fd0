"""The ``sloserve`` command group: sloserve's own errors become one line on stderr and exit code 2."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import click

from sloserve.core.errors import SloserveError


def fail(message: str) -> None:
    """``message`` as one line on stderr (a library's text in it may span several), then exit code 2."""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    click.echo(f"error: {one_line}", err=True)
    sys.exit(2)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr ("warning: ..."), not Python's file:line form."""
    click.echo(f"warning: {message}", err=True)


class Command(click.Command):
    """Turns sloserve's own errors into one line on stderr and exit code 2, and warnings into one
    line on stderr each."""

    def invoke(self, ctx: click.Context) -> Any:
        warnings.showwarning = _show_warning
        try:
            return super().invoke(ctx)
        except (SloserveError, FileNotFoundError) as exc:
            fail(str(exc))


class Group(click.Group):
    command_class = Command


@click.group(cls=Group)
@click.version_option(package_name="sloserve")
def main() -> None:
    """SLO-aware LLM serving schedulers: simulate them on real traces."""
