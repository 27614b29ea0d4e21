"""Names -> classes of one kind of plugin: environments, graders, and whatever kind comes next.

Each class carries its own `name`. A second class under a taken name is refused (two plugins must
not silently replace each other), and an unknown name is an error that lists the known ones.

Besides the classes registered in the process (rlpipe's own), a name may be an import path
(`"my_pkg.tasks:SpellingEnv"`) or an entry point that an installed package declares in the kind's
group (`rlpipe.environments`, `rlpipe.graders`; see `rlpipe.plugins`). Those are resolved on first use,
in whichever process uses them, so every worker finds a plugin the same way without registering it by
hand. A package installed after a process started is found too: a name it does not know makes it look
at the installed packages again before refusing.

Every registry is also findable by its kind (`registered_names`, `names_used`): that is how the config
schemas, which sit below the plugin packages and import none of them, check a configured name and what
the plugin it names relies on (an environment's rubric names graders).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from rlpipe.plugins import (
    Declared,
    PluginLoadError,
    declared,
    is_import_path,
    load_declared,
    load_import_path,
    looks_like_import_path,
)


class Named(Protocol):
    name: ClassVar[str]


T = TypeVar("T", bound=Named)

_REGISTRIES: dict[str, Registry[Any]] = {}
"""The registries built in this process, by kind."""


def registered_names(kind: str) -> tuple[str, ...] | None:
    """The names registered for `kind` ("environment", "grader"), or None while no registry of that
    kind is loaded in this process (its package, e.g. `rlpipe.envs.registry`, was never imported)."""
    registry = _REGISTRIES.get(kind)
    return None if registry is None else registry.names()


def names_used(kind: str, name: str, used_kind: str) -> tuple[str, ...] | None:
    """The `used_kind` names (e.g. graders) that the `kind` class `name` (e.g. an environment) uses, or
    None while that class is neither registered nor resolved in this process."""
    registry = _REGISTRIES.get(kind)
    cls = None if registry is None else registry._classes.get(name, registry._plugins.get(name))
    if registry is None or cls is None:
        return None
    return tuple(registry.uses(cls).get(used_kind, ()))


def unusable(kind: str, name: str) -> str | None:
    """Why `name` cannot be used as a `kind` in this process (the registry's message: the known names and
    the import error), or None when it can, or when no registry of that kind is loaded here.

    Inside a Temporal workflow (the workflow worker decodes run configs there) no plugin code is
    imported and no package metadata read: workflow code must not run a user's module, whose import may
    do anything, nor give a verdict that depends on what one worker has installed. An import path is
    then checked for its form only; the CLI checked every name before the start, and the run's first
    activities resolve them for real (`rollout.context`) and fail the run with the reason.
    """
    registry = _REGISTRIES.get(kind)
    if registry is None:
        return None
    try:
        registry.resolve(name, load=not _in_workflow())
    except (LookupError, ValueError, TypeError) as exc:
        return str(exc)
    return None


def _in_workflow() -> bool:
    # looked up rather than imported: this module sits below everything and imports no temporalio
    workflow = sys.modules.get("temporalio.workflow")
    return workflow is not None and bool(workflow.in_workflow())


@dataclass(frozen=True)
class Source:
    """Where a name available to a registry comes from, for `rlpipe envs list`."""

    name: str
    origin: str  # "built-in" (registered in the process), "entry point" or "import path" (resolved here)
    target: str  # module:qualname of the class, or the entry point's value
    package: str  # the declaring package for entry points, "rlpipe" or the module for the others


def _uses_nothing(cls: type[Any]) -> Mapping[str, Collection[str]]:
    return {}


def _no_check(cls: type[Any]) -> None:
    pass


def _must_be_class(kind: str, name: str, found: object) -> type[Any]:
    if not isinstance(found, type):
        raise TypeError(f"{kind} {name!r} names {found!r}, which is not a class: name the {kind} class")
    return found


class Registry(Generic[T]):
    """The classes of one `kind` (e.g. "environment"), by name; `unknown` is raised for a missing name.

    `check` refuses a class that lacks what its kind needs (raising TypeError that says what), at
    registration rather than when a worker first uses it. `uses` gives the names of other kinds a class
    relies on (an environment's rubric: graders); those are checked when a run config is validated, not
    at registration, since a plugin may be registered before the ones it uses.

    `group` is the entry-point group installed packages declare plugins of this kind in; `adapt` turns
    what a plugin name loads into a class of the kind (by default it must already be one; graders also
    take a reward function). Another kind of plugin (a `verifiers` environment, say) plugs in as an
    `adapt` that wraps it.
    """

    def __init__(self, kind: str, unknown: type[LookupError] | type[ValueError], classes: Iterable[type[T]],
                 check: Callable[[type[T]], None] = _no_check,
                 uses: Callable[[type[T]], Mapping[str, Collection[str]]] = _uses_nothing,
                 group: str | None = None, adapt: Callable[[str, str, object], type[T]] = _must_be_class) -> None:
        if kind in _REGISTRIES:
            raise ValueError(f"a registry of {kind}s already exists: register {kind}s in that one")
        self.kind = kind
        self.unknown = unknown
        self.check = check
        self.uses = uses
        self.group = group
        self.adapt = adapt
        self._classes: dict[str, type[T]] = {}
        self._plugins: dict[str, type[T]] = {}  # import paths and entry-point names resolved in this process
        self._declared: dict[str, list[Declared]] | None = None  # the group's entry points, read on first need
        for cls in classes:
            self.register(cls)
        _REGISTRIES[kind] = self

    def register(self, cls: type[T]) -> type[T]:
        """Make `cls` reachable by its `name` (usable as a class decorator)."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} class {cls.__qualname__} has no name: set the class attribute "
                            f"`name = \"...\"`, the name a run config selects it by")
        self.check(cls)
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{self.kind} name {name!r} is already taken by {existing.__qualname__}")
        self._classes[name] = cls
        return cls

    def get(self, name: str) -> type[T]:
        """The class `name` stands for: registered, or a plugin (resolved and checked on first use)."""
        cls = self.resolve(name, load=True)
        assert cls is not None
        return cls

    def resolve(self, name: str, load: bool) -> type[T] | None:
        """The class `name` stands for, or `self.unknown` saying why there is none. With `load` False
        nothing is imported or read (workflow code: no I/O, and the same verdict on every worker,
        whatever is installed there): an import path is only checked for its form, any other unknown
        name is left to the run's first activity, and None is returned for it."""
        cls = self._classes.get(name) or self._plugins.get(name)
        if cls is not None:
            return cls
        if looks_like_import_path(name):
            if not is_import_path(name):
                raise self.unknown(f"{self.kind} {name!r} is not an import path: write it as "
                                   f"'package.module:Class'{self._how_to_add()}")
            if not load:
                return None
            try:
                found = load_import_path(name)
            except PluginLoadError as exc:
                raise self.unknown(f"{self.kind} {name!r} cannot be loaded: {exc} "
                                   f"(known {self.kind}s: {', '.join(self.names())})") from exc
        else:
            if not load:
                return None
            entries = self.declarations().get(name) or self.declarations(again=True).get(name)
            if not entries:
                raise self.unknown(f"unknown {self.kind} {name!r}; known {self.kind}s: "
                                   f"{', '.join(self.names())}{self._how_to_add()}")
            if len(entries) > 1:
                raise self.unknown(f"{self.kind} {name!r} is declared by several packages "
                                   f"({'; '.join(f'{e.package}: {e.value}' for e in entries)}): uninstall all but "
                                   f"one, or name the class by its import path")
            try:
                found = load_declared(str(self.group), entries[0])
            except PluginLoadError as exc:
                raise self.unknown(str(exc)) from exc
        cls = self.adapt(self.kind, name, found)
        own = getattr(cls, "name", None)
        if not isinstance(own, str) or not own:
            raise TypeError(f"{self.kind} class {cls.__qualname__} (from {name!r}) has no name: set the class "
                            "attribute `name = \"...\"`")
        if not looks_like_import_path(name) and own != name:
            raise TypeError(f"entry point {name!r} loads {self.kind} class {cls.__qualname__}, whose name is "
                            f"{own!r}: give the entry point and the class the same name")
        self.check(cls)
        self._plugins[name] = cls
        return cls

    def declarations(self, again: bool = False) -> dict[str, list[Declared]]:
        """The installed packages' entry points of this kind, by name (read once, or `again`); none
        inside a workflow, which must not depend on what its worker has installed (see `unusable`)."""
        if self.group is None or _in_workflow():
            return {}
        if self._declared is None or again:
            self._declared = declared(self.group)
        return self._declared

    def names(self) -> tuple[str, ...]:
        """Registered names and the names installed packages declare (import paths are not listed)."""
        return tuple(sorted({*self._classes, *self.declarations()}))

    def sources(self) -> list[Source]:
        """Every name this registry can resolve now and where it comes from (entry points by the declaring
        package; a name declared twice is listed twice, and refused when used)."""
        found = [Source(name, "built-in", f"{cls.__module__}:{cls.__qualname__}",
                        "rlpipe" if cls.__module__.startswith("rlpipe.") else cls.__module__)
                 for name, cls in self._classes.items()]
        found += [Source(e.name, "entry point", e.value, e.package)
                  for entries in self.declarations(again=True).values() for e in entries]
        found += [Source(name, "import path", name, name.partition(":")[0])
                  for name in self._plugins if looks_like_import_path(name)]
        return sorted(found, key=lambda source: (source.name, source.origin))

    def _how_to_add(self) -> str:
        group = f", or install a package that declares it in entry-point group {self.group!r}" if self.group else ""
        return (f" (name your own by import path, 'package.module:Class'{group}; `rlpipe envs list` and "
                "`rlpipe graders list` show what is available)")
