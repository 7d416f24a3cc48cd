"""Package names that load on first use (a module ``__getattr__``, PEP 562): importing one
module of a package does not import the rest (torch, xgboost, torch.distributed.pipelining
take seconds, which every memx-run process would pay)."""

from __future__ import annotations

import importlib


def lazy_attributes(package: str, exports: dict[str, str]):
    """The ``__getattr__`` of ``package`` that imports ``exports[name]`` (a module) on first use of ``name``."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
