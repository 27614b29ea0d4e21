"""Published checkpoints in the object store.

    runs/<run>/objects/sha256-<digest>/<file>       content-addressed files (weights, config, tokenizer)
    runs/<run>/versions/v000003/manifest.json       which files make up version 3, with their digests
    runs/<run>/train-state/step-000012.pt           optimizer state after step 12 (trainer recovery only)

The weights' sha256 is also the `policy_versions.sha256` of the version, so a sync can refuse a
checkpoint whose bytes are not the ones the trainer published, before it pauses any server.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.storage.digest import sha256_file
from rlpipe.storage.object_store import ObjectStore


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


def manifest_key(run_id: str, version: int) -> str:
    return f"runs/{run_id}/versions/v{version:06d}/manifest.json"


def train_state_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/train-state/step-{step:06d}.pt"


def stored_train_states(store: ObjectStore, run_id: str) -> set[int]:
    """The steps after which the run's optimizer state is in the store (a put is whole or absent)."""
    prefix = f"runs/{run_id}/train-state/step-"
    return {int(info.key[len(prefix):-len(".pt")]) for info in store.list(prefix) if info.key.endswith(".pt")}


def upload_checkpoint(store: ObjectStore, run_id: str, version: int, trained_steps: int,
                      directory: Path) -> Manifest:
    """Upload every file of a checkpoint directory (identical files are stored once) and its
    manifest. Uploading the same checkpoint again changes nothing."""
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        info = store.put_content_addressed(f"runs/{run_id}/objects", path)
        files[path.name] = StoredFile(info.key, info.sha256 or "", info.size)
    if WEIGHTS_FILE not in files:
        raise FileNotFoundError(f"{directory} has no {WEIGHTS_FILE}")
    manifest = Manifest(run_id, version, trained_steps, files)
    store.put_bytes(manifest_key(run_id, version), manifest.to_json())
    return manifest


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
