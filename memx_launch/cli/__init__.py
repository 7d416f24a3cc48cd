"""The ``memx`` command: ``plan``, ``estimate``, ``export`` (plan_commands.py), ``profile``, ``evaluate``
and ``cluster detect`` (measure_commands.py), the parser and error handling (main.py)."""

from memx_launch.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
