"""Errors memx reports to users: one line naming the field and the fix."""

from __future__ import annotations


class MemxError(Exception):
    """Base class of every error memx explains to the user (CLI exit code 2)."""

    exit_code = 2


class ConfigError(MemxError, ValueError):
    """A field of a model, cluster, training or plan input is wrong.

    The message always reads ``<field>: <what is wrong>; <how to fix it>``.
    """

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}" + (f"; {fix}" if fix else ""))


class NoFeasiblePlanError(MemxError):
    """Nothing in the search space fits in memory; carries the closest candidates."""

    exit_code = 3

    def __init__(self, message: str, closest: list | None = None):
        self.closest = closest or []
        super().__init__(message)
