"""The `tollgate` command: one module per command group."""

from api.cli import main

__all__ = ["main"]
