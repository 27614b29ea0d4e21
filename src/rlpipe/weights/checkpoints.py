"""Published checkpoints in the object store.

    runs/<run>/objects/sha256-<digest>/<file>       content-addressed files (weights, config, tokenizer)
    runs/<run>/versions/v000003/manifest.json       which files make up version 3, with their digests
    runs/<run>/train-state/step-000012/             weights + optimizer state after step 12 (trainer recovery
                                                    only): a torch.distributed.checkpoint directory, a file
                                                    per rank and `.metadata`, written last
    runs/<run>/train-state/step-000012.pt           the same, as runs stored it before (one torch.save file)

The weights' sha256 is also the `policy_versions.sha256` of the version, so a sync can refuse a
checkpoint whose bytes are not the ones the trainer published, before it pauses any server. The
manifest is written last: a version is durable once its manifest is in the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.schemas.tables import PolicyVersion
from rlpipe.storage.digest import sha256_file
from rlpipe.storage.object_store import ObjectStore, content_key


@dataclass(frozen=True)
class StoredFile:
    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    run_id: str
    version: int
    trained_steps: int
    files: dict[str, StoredFile]

    @property
    def weights(self) -> StoredFile:
        return self.files[WEIGHTS_FILE]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        return cls(raw["run_id"], raw["version"], raw["trained_steps"],
                   {name: StoredFile(**f) for name, f in raw["files"].items()})


def objects_prefix(run_id: str) -> str:
    """Where the run's content-addressed files live."""
    return f"runs/{run_id}/objects"


def manifest_key(run_id: str, version: int) -> str:
    return f"runs/{run_id}/versions/v{version:06d}/manifest.json"


TRAIN_STATE_INDEX = ".metadata"
"""The index torch.distributed.checkpoint writes beside the ranks' files; uploaded last, it marks a
stored recovery state whole."""


def train_state_key(run_id: str, step: int) -> str:
    """The recovery state of runs that stored it as one torch.save file (read, never written now)."""
    return f"runs/{run_id}/train-state/step-{step:06d}.pt"


def train_state_prefix(run_id: str, step: int) -> str:
    return f"runs/{run_id}/train-state/step-{step:06d}/"


def stored_train_states(store: ObjectStore, run_id: str) -> set[int]:
    """The steps after which the run's recovery state is whole in the store."""
    prefix = f"runs/{run_id}/train-state/step-"
    steps = set()
    for info in store.list(prefix):
        rest = info.key[len(prefix):]
        if rest.endswith(".pt") or rest.endswith("/" + TRAIN_STATE_INDEX):
            steps.add(int(rest.split("/")[0].removesuffix(".pt")))
    return steps


def upload_train_state(store: ObjectStore, run_id: str, step: int, directory: Path) -> None:
    """The ranks' files, then the index (the mark of a whole state)."""
    prefix = train_state_prefix(run_id, step)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != TRAIN_STATE_INDEX)
    for path in [*files, directory / TRAIN_STATE_INDEX]:
        store.put_file(prefix + path.name, path)


def download_train_state(store: ObjectStore, run_id: str, step: int, directory: Path) -> bool:
    """Fetch the recovery state of `step` into `directory`, each file checked against the sha256
    recorded at its upload; False when the run stored it as one file (`train_state_key`)."""
    prefix = train_state_prefix(run_id, step)
    keys = [info.key for info in store.list(prefix)]
    if prefix + TRAIN_STATE_INDEX not in keys:
        return False
    directory.mkdir(parents=True, exist_ok=True)
    for key in keys:
        store.get_file(key, directory / key[len(prefix):])
    return True


def delete_train_state(store: ObjectStore, run_id: str, step: int) -> int:
    """Delete the recovery state of `step` (the index first: a half-deleted state is not listed);
    returns the bytes freed."""
    if store.exists(legacy := train_state_key(run_id, step)):
        size = store.head(legacy).size
        store.delete(legacy)
        return size
    prefix = train_state_prefix(run_id, step)
    found = sorted(store.list(prefix), key=lambda info: not info.key.endswith(TRAIN_STATE_INDEX))
    for info in found:
        store.delete(info.key)
    return sum(info.size for info in found)


def stored_versions(store: ObjectStore, run_id: str) -> set[int]:
    """The versions of the run whose manifest is in the store: the durable ones."""
    prefix = f"runs/{run_id}/versions/v"
    return {int(info.key[len(prefix):len(prefix) + 6]) for info in store.list(prefix)
            if info.key.endswith("/manifest.json")}


def recovery_base(versions: Iterable[PolicyVersion], durable: set[int], train_states: set[int],
                  step: int) -> PolicyVersion | None:
    """Where a restore to `step` starts: the newest of `versions` trained for at most `step` steps
    that is durable and whose recovery state is stored, or the base model (version 0, trained for
    0 steps, restored with a fresh optimizer). None when there is neither."""
    candidates = [v for v in versions if v.trained_steps <= step and v.version in durable
                  and (v.trained_steps == 0 or v.trained_steps in train_states)]
    return max(candidates, key=lambda v: v.version, default=None)


def describe_checkpoint(run_id: str, version: int, trained_steps: int, directory: Path,
                        known_sha256: Mapping[str, str] | None = None) -> Manifest:
    """The manifest of a checkpoint directory: every file hashed and given its content-addressed key.
    `known_sha256`: file name -> digest computed as the file was written (not read again)."""
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest = (known_sha256 or {}).get(path.name) or sha256_file(path)
        files[path.name] = StoredFile(content_key(objects_prefix(run_id), digest, path.name), digest,
                                      path.stat().st_size)
    if WEIGHTS_FILE not in files:
        raise FileNotFoundError(f"{directory} has no {WEIGHTS_FILE}")
    return Manifest(run_id, version, trained_steps, files)


def upload_described(store: ObjectStore, manifest: Manifest, directory: Path) -> None:
    """Upload the files `manifest` names from `directory` (a file already stored under its
    content-addressed key is not sent again), then the manifest. Uploading again changes nothing."""
    for name, stored in manifest.files.items():
        if not store.exists(stored.key):
            store.put_file(stored.key, directory / name, sha256=stored.sha256)
    store.put_bytes(manifest_key(manifest.run_id, manifest.version), manifest.to_json())


def upload_checkpoint(store: ObjectStore, run_id: str, version: int, trained_steps: int,
                      directory: Path) -> Manifest:
    """Describe and upload a checkpoint directory (identical files are stored once) and its manifest."""
    manifest = describe_checkpoint(run_id, version, trained_steps, directory)
    upload_described(store, manifest, directory)
    return manifest


def wait_for_manifest(store: ObjectStore, key: str, timeout_s: float, poll_s: float = 0.5) -> Manifest:
    """The manifest at `key`, waiting up to `timeout_s` for it to appear: the trainer uploads a
    version beside its next step, and a version may be synced before its upload ends."""
    deadline = time.monotonic() + timeout_s
    while not store.exists(key):
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"{key} is not in the object store after {timeout_s:.0f} s: the trainer "
                                    "has not finished uploading that version (or lost it; its next step re-uploads it)")
        time.sleep(poll_s)
    return load_manifest(store, key)


def load_manifest(store: ObjectStore, key: str) -> Manifest:
    return Manifest.from_json(store.get_bytes(key))


def local_version_dir(root: Path, run_id: str, version: int) -> Path:
    """Where a machine keeps version `version` of a run under `root`: the trainer publishes from
    here, and a sidecar that shares the trainer's filesystem reloads from here (no S3 round trip)."""
    return root / run_id / f"v{version:06d}"


def download_checkpoint(store: ObjectStore, manifest: Manifest, dest: Path) -> int:
    """Fetch the checkpoint's files into `dest`, each verified against its sha256 (a mismatch
    raises DigestMismatch and leaves no file). Files already present and verified are kept.
    Returns the bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for name, stored in manifest.files.items():
        target = dest / name
        if _intact(target, stored):
            continue
        store.get_file(stored.key, target, expected_sha256=stored.sha256)
        fetched += stored.size
    return fetched


def missing_or_altered(manifest: Manifest, directory: Path) -> list[str]:
    """Names of the manifest's files that `directory` lacks or holds with other bytes."""
    return [name for name, stored in manifest.files.items() if not _intact(directory / name, stored)]


def _intact(path: Path, stored: StoredFile) -> bool:
    return path.exists() and path.stat().st_size == stored.size and sha256_file(path) == stored.sha256
