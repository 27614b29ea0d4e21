"""Inference servers are named: INFERENCE_URLS entries are `NAME=URL`, or a bare URL named by its position."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.infra.settings import SettingsError, load_settings, named_urls


def test_bare_urls_are_named_by_position_and_named_entries_by_their_name() -> None:
    assert named_urls(["http://a:8000/", "gpu-b=https://b:8000", "http://c:8000/v?x=1"]) == {
        "0": "http://a:8000", "gpu-b": "https://b:8000", "2": "http://c:8000/v?x=1"}


@pytest.mark.parametrize(("entries", "words"), [
    (["bad name=http://a:1"], "inference server name 'bad name'"),
    (["a=a:8000"], "inference server 'a': 'a:8000' is not an http(s) URL"),
    (["a=http://x:1", "a=http://y:1"], "inference server name 'a' is given twice"),
    (["http://x:1", "0=http://y:1"], "inference server name '0' is given twice"),
])
def test_a_bad_entry_is_refused_naming_it(entries: list[str], words: str) -> None:
    with pytest.raises(ValueError, match="inference server") as caught:
        named_urls(entries)
    assert words in str(caught.value)


def test_settings_refuse_a_bad_inference_urls_entry(tmp_path: Path) -> None:
    env = {"RLPIPE_HOME": str(tmp_path), "INFERENCE_URLS": "gpu-a=http://a:8000,gpu a=http://b:8000"}
    with pytest.raises(SettingsError, match="external_inference_urls.*inference server name 'gpu a'"):
        load_settings(config_file=tmp_path / "absent.toml", env=env)
    env["INFERENCE_URLS"] = "gpu-a=http://a:8000,http://b:8000"
    servers = load_settings(config_file=tmp_path / "absent.toml", env=env).inference_servers_by_name()
    assert servers == {"gpu-a": "http://a:8000", "1": "http://b:8000"}
