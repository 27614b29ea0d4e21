"""Names -> classes of one kind of plugin: environments, graders, and whatever kind comes next.

Each class carries its own `name`. A second class under a taken name is refused (two plugins must
not silently replace each other), and an unknown name is an error that lists the known ones.

Every registry is also findable by its kind (`registered_names`): that is how the config schemas,
which sit below the plugin packages and import none of them, check a configured name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Generic, Protocol, TypeVar


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


class Registry(Generic[T]):
    """The classes of one `kind` (e.g. "environment"), by name; `unknown` is raised for a missing name."""

    def __init__(self, kind: str, unknown: type[LookupError] | type[ValueError], classes: Iterable[type[T]]) -> None:
        if kind in _REGISTRIES:
            raise ValueError(f"a registry of {kind}s already exists: register {kind}s in that one")
        self.kind = kind
        self.unknown = unknown
        self._classes: dict[str, type[T]] = {}
        for cls in classes:
            self.register(cls)
        _REGISTRIES[kind] = self

    def register(self, cls: type[T]) -> type[T]:
        """Make `cls` reachable by its `name` (usable as a class decorator)."""
        existing = self._classes.get(cls.name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{self.kind} name {cls.name!r} is already taken by {existing.__qualname__}")
        self._classes[cls.name] = cls
        return cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            raise self.unknown(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))
