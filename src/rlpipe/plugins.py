"""Where plugin classes come from besides rlpipe itself: import paths and installed packages' entry points.

A run config names a plugin in one of two ways, and every process (the command line and each worker)
finds it the same way, so nothing has to be registered by hand in each process:

- an import path, `"my_pkg.tasks:SpellingEnv"`: the module is imported and the attribute taken;
- an entry-point name, `"spelling"`: an installed package declares it in its pyproject.toml,
  ```toml
  [project.entry-points."rlpipe.environments"]
  spelling = "my_pkg.tasks:SpellingEnv"
  ```
  (graders: group `rlpipe.graders`). Declaring a name reads only the package's metadata; its
  module is imported when a run first uses the name, so a broken plugin fails only the runs using it.

Plain Python, no registry logic: `rlpipe.registry` decides what a loaded object must be.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from importlib import metadata

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
"""`package.module:attribute` (the attribute may be dotted, `module:Class.method`), as in entry points."""


class PluginLoadError(LookupError):
    """A plugin that is declared or named but cannot be loaded; the message says what failed."""


def is_import_path(name: str) -> bool:
    return IMPORT_PATH.match(name) is not None


def looks_like_import_path(name: str) -> bool:
    """A name meant as an import path (it has a ':'), well-formed or not: it is then not looked up by name."""
    return ":" in name


def load_import_path(path: str) -> object:
    """The object `path` ("package.module:attribute") names, or PluginLoadError with the import error."""
    if not is_import_path(path):
        raise PluginLoadError(f"{path!r} is not an import path: write it as 'package.module:Attribute'")
    module_name, _, attribute = path.partition(":")
    # a package installed after this process started is found only once the finders forget their listings
    importlib.invalidate_caches()
    try:
        found: object = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import is the reason
        raise PluginLoadError(f"cannot import {module_name!r} for {path!r}: {type(exc).__name__}: {exc}") from exc
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise PluginLoadError(f"module {module_name!r} has no attribute {attribute!r} (for {path!r})") from None
    return found


@dataclass(frozen=True)
class Declared:
    """One entry point of a group: its name, the import path it names, and the package declaring it."""

    name: str
    value: str
    package: str  # "name version", or "?" when the entry point has no distribution (a bare path entry)
    entry_point: metadata.EntryPoint


def declared(group: str) -> dict[str, list[Declared]]:
    """The entry points of `group` in the packages installed now, by name (a name two packages declare
    lists both). Reads package metadata only; nothing is imported. (The metadata finder reads a directory
    again when its mtime changes, so a package installed since the last call is seen.)"""
    found: dict[str, list[Declared]] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        package = f"{dist.name} {dist.version}" if dist is not None else "?"
        entries = found.setdefault(ep.name, [])
        if all(d.value != ep.value for d in entries):  # one package seen twice on sys.path counts once
            entries.append(Declared(ep.name, ep.value, package, ep))
    return found


def load_declared(group: str, entry: Declared) -> object:
    """What the entry point names, or PluginLoadError saying which package declared it and why it failed."""
    importlib.invalidate_caches()  # as in load_import_path
    try:
        return entry.entry_point.load()
    except Exception as exc:  # noqa: BLE001 - whatever the plugin raises on import is the reason
        raise PluginLoadError(f"entry point {entry.name!r} of package {entry.package} (group {group!r}, "
                              f"{entry.value}) cannot be loaded: {type(exc).__name__}: {exc}") from exc
