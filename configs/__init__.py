"""Run configurations shipped with rlpipe (the demo's and the tiny test runs'), found through
importlib.resources so they load the same from a checkout and from an installed wheel."""

from importlib import resources
from pathlib import Path


def shipped_config(name: str) -> Path:
    """The path of a run config shipped with rlpipe, e.g. `shipped_config("demo.toml")`."""
    return Path(str(resources.files(__name__) / name))
