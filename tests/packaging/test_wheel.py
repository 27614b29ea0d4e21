"""The built wheel works on its own: installed into a fresh virtual environment (its dependencies
borrowed from the project's, so nothing is downloaded), run from a folder that has its own `envs/`,
`rl/` and `rlpipe/` packages, it finds every module and file of its own and none of the folder's."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    build = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(REPO)],
                cwd=dist)
    # setuptools builds a folder it finds but was not told about, with a warning: name it in pyproject.toml
    assert "absent from the `packages` configuration" not in build.stderr, build.stderr[-3000:]
    (built,) = dist.glob("rlpipe-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding only the wheel (plus a path to the project's dependencies)."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(root / "venv")], cwd=root)
    python = root / "venv" / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], cwd=root)
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root)
                .stdout.strip())
    # dependencies from the project's venv: a plain path entry, so its editable rlpipe (a .pth file
    # there) is never read and `rlpipe` can only come from the wheel
    (site / "project-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


@pytest.fixture
def stranger(tmp_path: Path) -> Path:
    """A user's project folder whose own packages carry rlpipe's generic names, and an `rlpipe`."""
    for name in ("envs", "rl", "schemas", "rlpipe"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the folder\\'s own {name} was imported')\n")
    return tmp_path


def test_the_wheel_holds_one_root_package_and_its_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"rlpipe"}
    for data in ("py.typed", "configs/demo.toml", "migrations/script.py.mako", "migrations/versions",
                 "infra/prometheus.yml", "infra/grafana/rlpipe-dashboard.json", "workflows/training_run.py",
                 "cli/main.py"):
        assert any(name.startswith(f"rlpipe/{data}") for name in names), data


def test_every_package_in_the_tree_is_in_the_wheel(wheel: Path) -> None:
    """A package folder added without its line in pyproject.toml would be missing from installs."""
    mapped = {"workflows", "activities", "workers", "schemas", "migrations", "infra", "configs"}
    in_tree = {f"rlpipe/{init.parent.relative_to(REPO / 'src' / 'rlpipe').as_posix()}"
               for init in (REPO / "src" / "rlpipe").rglob("__init__.py")}
    in_tree |= {f"rlpipe/{init.parent.relative_to(REPO).as_posix()}" for folder in mapped
                for init in (REPO / folder).rglob("__init__.py")}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name.rsplit("/", 1)[0] for name in archive.namelist() if name.endswith("/__init__.py")}
    assert {name.removesuffix("/.") for name in in_tree} == in_wheel


def test_the_installed_command_runs_from_a_strangers_folder(installed: Path, stranger: Path) -> None:
    done = run([str(installed.parent / "rlpipe"), "--help"], cwd=stranger)
    assert "stack" in done.stdout and "run" in done.stdout


def test_the_shipped_demo_config_validates(installed: Path, stranger: Path) -> None:
    script = ("from rlpipe.configs import shipped_config; from rlpipe.schemas.config import load_run_config;"
              "path = shipped_config('demo.toml'); print(path); print(load_run_config(path).name)")
    lines = run([str(installed), "-P", "-c", script], cwd=stranger).stdout.split()
    assert "site-packages" in lines[0] and lines[1] == "demo"


def test_the_migration_environment_renders(installed: Path, stranger: Path) -> None:
    script = ("from alembic import command; from rlpipe.migrations import alembic_config;"
              "command.upgrade(alembic_config('postgresql+psycopg://user@db.invalid/rlpipe'), 'head', sql=True)")
    sql = run([str(installed), "-P", "-c", script], cwd=stranger).stdout
    assert "CREATE TABLE runs" in sql and "create view v_trajectory_lineage" in sql


def test_a_worker_command_is_not_shadowed_by_the_callers_folder(stranger: Path) -> None:
    from rlpipe.workers.launcher import worker_specs

    for spec in worker_specs(["0"]):  # the exact command lines `rlpipe workers up` starts
        assert "-P" in spec.argv  # the caller's folder is not put on sys.path
        done = run([*spec.argv, "--help"], cwd=stranger)
        assert "usage: rlpipe worker" in done.stdout
