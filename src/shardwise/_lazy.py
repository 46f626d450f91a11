"""Packages whose public names load on first use.

``import shardwise`` and ``import shardwise.train`` import no torch until a
name is used. The ``shardwise train`` command depends on that: it parses its
flags and starts its ranks' fork server first, so the server imports torch
while the command imports its own copy, instead of after it.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["make_lazy"]


class _LazyPackage(types.ModuleType):
    """A package whose names in ``_exports`` (name -> submodule) load on first access."""

    _exports: Mapping[str, str]

    def __getattr__(self, name: str) -> Any:  # only called for names not yet in the module's dict
        where = self.__dict__.get("_exports", {}).get(name)
        if where is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{where}"), name)
        self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing a submodule binds it on its package under its own name. Where
        # that name is also a public name (shardwise.fully_shard, the function, lives
        # in the submodule of the same name), the public name wins, as it did when the
        # package imported everything at once.
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_exports", {}):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(self.__dict__) | set(self._exports))


def make_lazy(package: str, exports: Mapping[str, str]) -> None:
    """Make the (already executing) package ``package`` load each name in
    ``exports`` from ``package + "." + exports[name]`` when first used."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    module.__dict__["_exports"] = dict(exports)
