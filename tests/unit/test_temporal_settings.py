"""Temporal client settings read as Temporal's own tools read them: a config-file profile, the
TEMPORAL_* variables on top, and clear errors for settings that cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.infra.settings import SettingsError, load_settings
from rlpipe.infra.temporal_client import TemporalSettingsError, temporal_connection

PROFILES = """
[profile.default]
address = "temporal.internal:7233"
namespace = "research"

[profile.cloud]
address = "us-east-1.aws.api.temporal.io:7233"
namespace = "rl.a1b2c"
api_key = "key-from-the-file"
"""


def settings_env(tmp_path: Path, **env: str) -> dict[str, str]:
    config = tmp_path / "temporal.toml"
    config.write_text(PROFILES)
    return {"RLPIPE_HOME": str(tmp_path / "home"), "TEMPORAL_CONFIG_FILE": str(config), **env}


def test_a_profile_of_the_config_file_names_the_cluster(tmp_path: Path) -> None:
    env = settings_env(tmp_path, TEMPORAL_PROFILE="cloud")
    settings = load_settings(config_file=tmp_path / "absent.toml", env=env)
    assert settings.temporal_address == "us-east-1.aws.api.temporal.io:7233"
    assert settings.temporal_namespace == "rl.a1b2c"
    conn = temporal_connection(settings.temporal_address, settings.temporal_namespace, external=True, env=env)
    assert conn.api_key == "key-from-the-file" and conn.tls is True  # an API key brings TLS with the system's roots


def test_the_environment_wins_over_the_profile(tmp_path: Path) -> None:
    env = settings_env(tmp_path, TEMPORAL_ADDRESS="10.0.0.5:7233")
    settings = load_settings(config_file=tmp_path / "absent.toml", env=env)
    assert (settings.temporal_address, settings.temporal_namespace) == ("10.0.0.5:7233", "research")


def test_the_local_dev_server_is_reached_without_the_profiles_credentials() -> None:
    env = {"TEMPORAL_API_KEY": "a-key", "TEMPORAL_TLS": "true"}
    conn = temporal_connection("127.0.0.1:17233", "default", external=False, env=env)
    assert conn.api_key is None and conn.tls is False


def test_an_unknown_profile_is_a_settings_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="nope"):
        load_settings(config_file=tmp_path / "absent.toml", env=settings_env(tmp_path, TEMPORAL_PROFILE="nope"))


def test_a_client_certificate_without_its_key_is_refused_before_connecting(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("not read: the missing key is reported first")
    env = {"TEMPORAL_ADDRESS": "temporal.internal:7233", "TEMPORAL_TLS_CLIENT_CERT_PATH": str(cert)}
    with pytest.raises(TemporalSettingsError, match="TEMPORAL_TLS_CLIENT_KEY_PATH"):
        temporal_connection("temporal.internal:7233", "default", external=True, env=env)


def test_a_missing_certificate_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    env = {"TEMPORAL_ADDRESS": "temporal.internal:7233", "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(missing)}
    with pytest.raises(TemporalSettingsError, match=str(missing)):
        temporal_connection("temporal.internal:7233", "default", external=True, env=env)
