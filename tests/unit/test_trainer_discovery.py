"""Rollout replica discovery: ``dns:`` entries expand to one address per resolved IP."""

from __future__ import annotations

import re

import pytest

from services.common.config import ConfigError, load_config
from services.trainer.discovery import DiscoveryError, check_entry, resolve, system_resolver
from services.trainer.loop import RunConfig


def fake(table: dict[str, list[str]]):
    calls: list[str] = []

    def resolver(host: str) -> list[str]:
        calls.append(host)
        return table[host]

    resolver.calls = calls  # type: ignore[attr-defined]
    return resolver


def test_static_entries_are_kept_unchanged_and_never_resolved():
    r = fake({})
    assert resolve(["10.0.0.5:50051", "rollout-a:50051", "http://rollout-b:8000"], r) == [
        "10.0.0.5:50051",
        "rollout-a:50051",
        "http://rollout-b:8000",
    ]
    assert r.calls == []


def test_dns_entry_gives_one_target_per_replica_sorted_and_deduplicated():
    r = fake({"rollout": ["172.18.0.12", "172.18.0.3", "172.18.0.3", "172.18.0.7"]})
    assert resolve(["dns:rollout:50051"], r) == ["172.18.0.3:50051", "172.18.0.7:50051", "172.18.0.12:50051"]


def test_dns_url_entry_keeps_scheme_and_path():
    r = fake({"rollout": ["10.1.0.2", "10.1.0.1"]})
    assert resolve(["dns:http://rollout:8000/api"], r) == [
        "http://10.1.0.1:8000/api",
        "http://10.1.0.2:8000/api",
    ]


def test_each_call_resolves_again_so_scaling_is_followed():
    table = {"rollout": ["10.0.0.1"]}
    r = fake(table)
    assert resolve(["dns:rollout:50051"], r) == ["10.0.0.1:50051"]
    table["rollout"] = ["10.0.0.1", "10.0.0.2"]  # docker compose up --scale rollout=2
    assert resolve(["dns:rollout:50051"], r) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert r.calls == ["rollout", "rollout"]


def test_ipv6_addresses_are_bracketed_and_mixed_lists_keep_order_without_duplicates():
    r = fake({"gpu-node": ["fd00::2", "10.0.0.9"]})
    out = resolve(["10.0.0.9:50051", "dns:gpu-node:50051", "static:1"], r)
    assert out == ["10.0.0.9:50051", "[fd00::2]:50051", "static:1"]


@pytest.mark.parametrize("entry", ["dns:rollout", "dns:http://rollout", "dns::50051"])
def test_dns_entry_without_host_or_port_is_an_error_naming_it(entry):
    with pytest.raises(DiscoveryError, match="expected dns:HOST:PORT"):
        resolve([entry], fake({"rollout": ["10.0.0.1"]}))


def test_name_with_no_address_is_an_error_naming_the_entry():
    with pytest.raises(DiscoveryError, match="'dns:rollout:50051'.*no address"):
        resolve(["dns:rollout:50051"], fake({"rollout": []}))


def test_real_resolver_resolves_localhost_and_reports_unknown_names():
    assert "127.0.0.1" in system_resolver("localhost")
    assert "127.0.0.1:50051" in resolve(["dns:localhost:50051"])
    with pytest.raises(DiscoveryError, match="cannot resolve 'no-such-host.invalid'"):
        resolve(["dns:no-such-host.invalid:50051"])


@pytest.mark.parametrize(
    ("entry", "url"),
    [
        ("127.0.0.1:50051", False),
        ("dns:rollout:50051", False),
        ("[fd00::1]:50051", False),
        ("http://127.0.0.1:8000", True),
        ("http://rollout-a", True),
        ("dns:http://rollout:8000", True),
    ],
)
def test_well_formed_entries_pass_config_validation(entry, url):
    assert check_entry(entry, url=url) == entry
    field = "rollout_urls" if url else "rollout_targets"
    assert getattr(RunConfig(dataset="d.parquet", **{field: [entry]}), field) == [entry]


@pytest.mark.parametrize(
    ("field", "entry"),
    [
        ("rollout_targets", "rollout"),  # no port
        ("rollout_targets", "dns:rollout"),
        ("rollout_targets", "rollout:grpc"),  # port not a number
        ("rollout_targets", "http://rollout:50051"),  # gRPC targets are not URLs
        ("rollout_urls", "rollout:8000"),  # no scheme
        ("rollout_urls", "dns:rollout:8000"),
        ("rollout_urls", "dns:http://rollout"),  # dns: needs the port
        ("rollout_urls", "ftp://rollout:8000"),
    ],
)
def test_malformed_entries_are_rejected_at_config_load_naming_field_and_entry(field, entry):
    with pytest.raises(ConfigError, match=rf"{field}: .*'{re.escape(entry)}'"):
        load_config(RunConfig, values={"dataset": "d.parquet", field: [entry]})
