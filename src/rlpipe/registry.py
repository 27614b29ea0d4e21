"""Names -> classes of one kind of plugin: environments, graders, and whatever kind comes next.

Each class carries its own `name`. A second class under a taken name is refused (two plugins must
not silently replace each other), and an unknown name is an error that lists the known ones.

Every registry is also findable by its kind (`registered_names`, `names_used`): that is how the config
schemas, which sit below the plugin packages and import none of them, check a configured name and what
the plugin it names relies on (an environment's rubric names graders).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
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


def names_used(kind: str, name: str, used_kind: str) -> tuple[str, ...] | None:
    """The `used_kind` names (e.g. graders) that the `kind` class `name` (e.g. an environment) uses, or
    None while that class is not registered in this process."""
    registry = _REGISTRIES.get(kind)
    if registry is None or name not in registry._classes:
        return None
    return tuple(registry.uses(registry._classes[name]).get(used_kind, ()))


def _uses_nothing(cls: type[Any]) -> Mapping[str, Collection[str]]:
    return {}


def _no_check(cls: type[Any]) -> None:
    pass


class Registry(Generic[T]):
    """The classes of one `kind` (e.g. "environment"), by name; `unknown` is raised for a missing name.

    `check` refuses a class that lacks what its kind needs (raising TypeError that says what), at
    registration rather than when a worker first uses it. `uses` gives the names of other kinds a class
    relies on (an environment's rubric: graders); those are checked when a run config is validated, not
    at registration, since a plugin may be registered before the ones it uses.
    """

    def __init__(self, kind: str, unknown: type[LookupError] | type[ValueError], classes: Iterable[type[T]],
                 check: Callable[[type[T]], None] = _no_check,
                 uses: Callable[[type[T]], Mapping[str, Collection[str]]] = _uses_nothing) -> None:
        if kind in _REGISTRIES:
            raise ValueError(f"a registry of {kind}s already exists: register {kind}s in that one")
        self.kind = kind
        self.unknown = unknown
        self.check = check
        self.uses = uses
        self._classes: dict[str, type[T]] = {}
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
        try:
            return self._classes[name]
        except KeyError:
            raise self.unknown(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))
