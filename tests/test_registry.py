import importlib.metadata as md
import subprocess
import sys
import types

import pytest

from policyworker import ConfigError, TransportLoadError
from policyworker.registry import TransportRegistry
from policyworker.registry import DISABLE_AUTOLOAD_ENV
from policyworker.transports.base import Transport


class _Dist:
    def __init__(self, name):
        self.metadata = {"Name": name}


def _ep(name, value, dist):
    ep = md.EntryPoint(name=name, value=value, group="policyworker.transports")
    return ep._for(_Dist(dist)) if hasattr(ep, "_for") else ep


@pytest.fixture
def fake_plugins(monkeypatch):
    good = types.ModuleType("pw_fake_good")

    class Good(Transport):
        name = "good"

    good.Good = Good
    wrong = types.ModuleType("pw_fake_wrong")
    wrong.NotATransport = object
    monkeypatch.setitem(sys.modules, "pw_fake_good", good)
    monkeypatch.setitem(sys.modules, "pw_fake_wrong", wrong)
    return Good


def test_listing_imports_nothing():
    reg = TransportRegistry([_ep("lazy", "pw_never_imported_mod:T", "lazy-dist")])
    infos = reg.list()
    assert [(i.name, i.distribution, i.target, i.loaded) for i in infos] == [
        ("lazy", "lazy-dist", "pw_never_imported_mod:T", False)
    ]
    assert "pw_never_imported_mod" not in sys.modules


def test_load_good_plugin(fake_plugins):
    reg = TransportRegistry([_ep("good", "pw_fake_good:Good", "good-dist")])
    assert reg.load("good") is fake_plugins
    assert reg.list()[0].loaded is True


def test_broken_plugin_names_entry_point_and_distribution():
    reg = TransportRegistry([_ep("broken", "pw_missing_module_xyz:T", "broken-dist")])
    with pytest.raises(TransportLoadError) as info:
        reg.load("broken")
    assert info.value.entry_point == "broken" and info.value.distribution == "broken-dist"
    assert "broken-dist" in str(info.value) and "broken" in str(info.value)


def test_not_a_transport_and_wrong_name(fake_plugins):
    reg = TransportRegistry([
        _ep("wrong", "pw_fake_wrong:NotATransport", "w-dist"),
        _ep("misnamed", "pw_fake_good:Good", "m-dist"),
    ])
    with pytest.raises(TransportLoadError, match="not a Transport"):
        reg.load("wrong")
    with pytest.raises(TransportLoadError, match="says its name is 'good'"):
        reg.load("misnamed")


def test_duplicate_name_is_an_error():
    reg = TransportRegistry([_ep("dup", "a_mod:T", "dist-a"), _ep("dup", "b_mod:T", "dist-b")])
    with pytest.raises(TransportLoadError, match="registered twice") as info:
        reg.list()
    assert info.value.distribution == "dist-b"


def test_unknown_transport_is_a_config_error():
    reg = TransportRegistry([_ep("good", "pw_fake_good:Good", "good-dist")])
    with pytest.raises(ConfigError, match="registered: good"):
        reg.load("nope")


def test_env_var_disables_third_party_autoload(monkeypatch):
    eps = [_ep("own", "policyworker.testing:InMemoryTransport", "policyworker"),
           _ep("third", "pw_missing_module_xyz:T", "third-dist")]
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    assert TransportRegistry(eps).names() == ["own"]
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV)
    assert TransportRegistry(eps).names() == ["own", "third"]


def test_builtins_are_registered_through_our_own_entry_points():
    reg = TransportRegistry()
    infos = {i.name: i for i in reg.list()}
    assert infos["memory"].distribution == "policyworker"
    from policyworker.testing import InMemoryTransport

    assert reg.load("memory") is InMemoryTransport


def test_cli_lists_transports():
    out = subprocess.run([sys.executable, "-m", "policyworker.cli", "transports", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["memory"]["distribution"] == "policyworker" and rows["memory"]["loaded"] is False


def test_every_builtin_transport_loads():
    reg = TransportRegistry()
    names = {i.name for i in reg.list() if i.distribution == "policyworker"}
    assert names >= {"memory", "nccl_reshard", "zmq", "sglang_ipc"}
    for name in names:
        cls = reg.load(name)
        assert issubclass(cls, Transport) and cls.name == name
