"""localmesh writes each service's environment from that service's own settings class: every
variable a process gets is one of its settings and parses back to the object localmesh built;
a misspelt name is refused, or fails the parse-back, instead of being ignored."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from supervisor.datatypes import dict_of_key_value_pairs
from supervisor.options import ServerOptions, expand

from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.localmesh.configs import supervisor_environment
from tokenmesh.localmesh.environment import build, checked, environment
from tokenmesh.localmesh.layout import Tools
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]

# Meshes that between them set every variable localmesh writes.
MESHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "secured, traced, picker, consul": (
        {
            "tls": True,
            "mtls": True,
            "keys_file": "keys.json",
            "otlp_endpoint": "127.0.0.1:4317",
            "worker_routing": "picker",
        },
        {"consul": "/opt/consul/consul"},
    ),
    "one worker beside the mesh's core, no prometheus": (
        {"workers": 1, "picker_feed": True, "worker_dtype": "float32"},
        {"prometheus": None, "cores": 2},
    ),
}


def parsed_back(settings: BaseSettings, env: dict[str, str], monkeypatch: Any) -> BaseSettings:
    """settings' class built by the service's own rules from exactly env."""
    with monkeypatch.context() as patch:
        for name in os.environ:
            if name.startswith("TOKENMESH_") or name == "CONSUL_HTTP_ADDR":
                patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return type(settings)()


def round_trip_differences(
    settings: BaseSettings, env: dict[str, str], monkeypatch: Any
) -> dict[str, Any]:
    """The settings set on settings (but None, which no variable gives) that env does not set to
    the same value: equal objects are not enough, a variable the class does not read leaves a
    value that may equal the default."""
    parsed = parsed_back(settings, env, monkeypatch).model_dump(exclude_unset=True)
    return {
        name: value
        for name, value in settings.model_dump(exclude_unset=True, exclude_none=True).items()
        if parsed.get(name, "<unset>") != value
    }


def local_mesh(tmp_path: Path, mesh: str) -> LocalMesh:
    settings, tools = MESHES[mesh]
    return LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, **{"workers": 2, **settings}),
        ROOT,
        dataclasses.replace(
            Tools.on_this_machine(), **{"prometheus": "/usr/bin/prometheus", **tools}
        ),
    )


@pytest.mark.parametrize("mesh", MESHES)
def test_every_variable_a_service_gets_is_its_setting_and_parses_back(
    tmp_path: Path, mesh: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = [p for p in local_mesh(tmp_path, mesh).programs if p.service is not None]
    assert {p.service for p in services} == {"controlplane", "worker", "reranker", "gateway"}
    for program in services:
        assert program.settings is not None
        # Written from the settings object alone: no variable typed by hand.
        assert program.env == environment(program.settings)
        assert round_trip_differences(program.settings, program.env, monkeypatch) == {}
        assert parsed_back(program.settings, program.env, monkeypatch) == program.settings


@pytest.mark.parametrize("mesh", MESHES)
def test_supervisord_hands_each_process_the_environment_localmesh_wrote(
    tmp_path: Path, mesh: str
) -> None:
    local = local_mesh(tmp_path, mesh)
    local.log_dir.mkdir(parents=True)
    config = tmp_path / "supervisord.conf"
    config.write_text(local.supervisord_config())
    options = ServerOptions()
    options.configfile = str(config)
    options.process_config(do_usage=False)
    passed = {
        process.name: process.environment or {}
        for group in options.process_group_configs
        for process in group.process_configs
    }
    assert passed == {program.name: program.env for program in local.programs}


def test_a_misspelt_setting_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="WorkerSettings has no setting modle"):
        build(WorkerSettings, port=1, modle="models/tiny-llama")
    with pytest.raises(ValueError, match=r"GatewaySettings has no setting picker\.feed_adress"):
        build(GatewaySettings, picker={"feed_adress": "127.0.0.1:1"})
    with pytest.raises(ValueError, match="MeshSettings has no setting edge_prot"):
        checked(MeshSettings, {"edge_port": 1, "edge_prot": 2})


def test_a_variable_the_service_does_not_read_fails_the_round_trip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = build(ControlPlaneSettings, source="static", static_file=Path("/e.yaml"))
    env = environment(settings)
    assert env == {
        "TOKENMESH_CONTROLPLANE_SOURCE": "static",
        "TOKENMESH_CONTROLPLANE_STATIC_FILE": "/e.yaml",
    }
    # "static" is also the default: only the set fields tell the misspelt name apart.
    misspelt = {
        "TOKENMESH_CONTROLPLANE_SORCE": "static",
        "TOKENMESH_CONTROLPLANE_STATIC_FILE": "/e.yaml",
    }
    assert parsed_back(settings, misspelt, monkeypatch) == settings
    assert round_trip_differences(settings, misspelt, monkeypatch) == {"source": "static"}


def test_localmesh_decides_alone_what_it_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shell's TOKENMESH_WORKER_* reach a worker as supervisord passes them down, but do
    not become lines of its config."""
    monkeypatch.setenv("TOKENMESH_WORKER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1")
    settings = build(WorkerSettings, port=1)
    assert settings.max_num_seqs is None
    assert environment(settings) == {"TOKENMESH_WORKER_PORT": "1"}


class Limits(BaseModel):
    burst: int = 1
    names: list[str] = []


class Example(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EX_", env_nested_delimiter="__", extra="ignore")

    name: str = ""
    ratio: float = 0.5
    on: bool = False
    path: Path | None = None
    tags: tuple[str, ...] = ()
    targets: dict[str, str] = {}
    limits: Limits = Limits()
    token: str = Field(default="", validation_alias=AliasChoices("EX_SECRET_TOKEN", "token"))


class Flat(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLAT_", extra="ignore")

    limits: Limits = Limits()


def test_values_are_written_as_pydantic_settings_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    example = build(
        Example,
        name='a "quoted", 100% name',
        ratio=0.25,
        on=True,
        path=Path("/x/y"),
        tags=("a", "b"),
        targets={"worker": "w:1"},
        limits={"names": ["n"]},
        token="t",
    )
    assert environment(example) == {
        "EX_NAME": 'a "quoted", 100% name',
        "EX_RATIO": "0.25",
        "EX_ON": "true",
        "EX_PATH": "/x/y",
        "EX_TAGS": '["a", "b"]',
        "EX_TARGETS": '{"worker": "w:1"}',
        "EX_LIMITS__NAMES": '["n"]',
        "EX_SECRET_TOKEN": "t",
    }
    assert round_trip_differences(example, environment(example), monkeypatch) == {}
    assert parsed_back(example, environment(example), monkeypatch) == example
    # Without a nested delimiter a nested model is one JSON variable.
    flat = build(Flat, limits={"burst": 3})
    assert environment(flat) == {"FLAT_LIMITS": '{"burst": 3}'}
    assert parsed_back(flat, environment(flat), monkeypatch) == flat


def test_none_is_left_to_the_default_and_refused_where_the_default_differs() -> None:
    assert environment(build(Example, path=None)) == {}
    with pytest.raises(ValueError, match="EX_NAME: None has no environment form"):
        environment(Example.model_construct(_fields_set={"name"}, name=None))


def test_supervisord_reads_back_every_value_it_can_carry() -> None:
    env = {"A": '["x", "y"]', "B": "50%, done", "C": "", "D": "it's"}
    line = supervisor_environment(env)
    assert dict_of_key_value_pairs(expand(line, {}, "environment")) == env
    for value in ("both ' and \"", "two\nlines", '"quoted"', "a ;comment"):
        with pytest.raises(ValueError, match="supervisord cannot pass"):
            supervisor_environment({"A": value})
