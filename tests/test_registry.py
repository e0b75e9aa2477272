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


def test_duplicate_third_party_name_fails_only_that_name(fake_plugins):
    reg = TransportRegistry([_ep("dup", "a_mod:T", "dist-a"), _ep("dup", "b_mod:T", "dist-b"),
                             _ep("good", "pw_fake_good:Good", "good-dist"),
                             _ep("memory", "policyworker.testing:InMemoryTransport", "policyworker")])
    assert reg.names() == ["dup", "good", "memory"]  # listing still works
    with pytest.raises(TransportLoadError, match="registered more than once") as info:
        reg.load("dup")
    assert "dist-a" in str(info.value) and "dist-b" in str(info.value)
    assert info.value.entry_point == "dup" and info.value.distribution == "dist-a, dist-b"
    assert reg.load("good") is fake_plugins  # other plugins and built-ins keep working
    from policyworker.testing import InMemoryTransport

    assert reg.load("memory") is InMemoryTransport
    rows = {i.name: i for i in reg.list()}
    assert "registered more than once" in rows["dup"].problem and rows["good"].problem is None
    assert rows["dup"].distribution == "dist-a, dist-b" and rows["dup"].target == "a_mod:T | b_mod:T"
    assert [p.entry_point for p in reg.problems()] == ["dup"]


def test_one_distribution_registering_a_name_twice_fails_that_name():
    reg = TransportRegistry([_ep("x", "a_mod:T", "dist-a"), _ep("x", "b_mod:T", "dist-a")])
    with pytest.raises(TransportLoadError, match="registered more than once") as info:
        reg.load("x")
    assert info.value.distribution == "dist-a" and "a_mod:T" in str(info.value) and "b_mod:T" in str(info.value)


def test_the_same_entry_point_seen_twice_is_one_claim(fake_plugins):
    reg = TransportRegistry([_ep("good", "pw_fake_good:Good", "good-dist"),
                             _ep("good", "pw_fake_good:Good", "good-dist")])
    assert reg.load("good") is fake_plugins and reg.problems() == []


def test_a_third_party_claim_on_a_builtin_name_is_ignored_and_reported():
    reg = TransportRegistry([_ep("memory", "pw_evil_mod:T", "evil-dist"),
                             _ep("memory", "policyworker.testing:InMemoryTransport", "policyworker")])
    from policyworker.testing import InMemoryTransport

    assert reg.load("memory") is InMemoryTransport
    assert "pw_evil_mod" not in sys.modules
    [problem] = reg.problems()
    assert problem.entry_point == "memory" and problem.distribution == "evil-dist"
    assert "built-in" in str(problem) and "evil-dist" in str(problem)
    assert reg.list()[0].distribution == "policyworker"


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


# -- installed-looking plugins: fake distributions on sys.path, in a subprocess -------------

_FAKE_MODULE = '''
from policyworker.transports.base import Transport


class Good2(Transport):
    name = "good2"
'''

_PROBE = r'''
import asyncio, json, sys
import torch
from policyworker import RolloutWorker, TorchPolicyWorker, TransportLoadError
from policyworker.models import get_preset
from policyworker.registry import default_registry
from policyworker.testing import MemoryHub
from policyworker.models.toy_model import build_model

reg = default_registry()
out = {"loaded": {}, "failed": {}}
for name in reg.names():
    try:
        cls = reg.load(name)
        out["loaded"][name] = cls.__module__
    except TransportLoadError as exc:
        out["failed"][name] = {"message": str(exc), "distribution": exc.distribution}
out["problems"] = [[p.entry_point, p.distribution] for p in reg.problems()]


async def refit_over_memory():
    model = build_model(get_preset("tiny"), seed=3)
    trainer = TorchPolicyWorker(model, device="cpu")
    rollout = RolloutWorker(params={k: torch.zeros_like(v.detach()) for k, v in model.named_parameters()},
                            device="cpu")
    hub = MemoryHub()
    try:
        await trainer.attach_transport("memory", hub=hub)
        await rollout.attach_transport("memory", hub=hub)
        await asyncio.gather(trainer.refit("memory"), rollout.refit("memory", refit_timeout_s=30))
        return all(torch.equal(rollout.weights()[k], v) for k, v in model.named_parameters())
    finally:
        await trainer.shutdown()
        await rollout.shutdown()

out["memory_refit_exact"] = asyncio.run(refit_over_memory())
print(json.dumps(out))
'''


def _fake_dist(root, dist: str, entry_points: str) -> None:
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[policyworker.transports]\n" + entry_points)


@pytest.fixture
def broken_plugins_path(tmp_path):
    """A sys.path entry holding two fake third-party distributions: one claims the files
    plugin's name, a built-in's name, a module that does not exist, and one good transport;
    the other claims ``files`` too."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "pw_fake_plugin_mod.py").write_text(_FAKE_MODULE)
    _fake_dist(root, "pw-fake-dup", "files = pw_fake_plugin_mod:Good2\nmemory = pw_fake_plugin_mod:Good2\n"
                                    "broken = pw_fake_missing_module:T\ngood2 = pw_fake_plugin_mod:Good2\n")
    _fake_dist(root, "pw-fake-other", "files = pw_fake_plugin_mod:Good2\n")
    return root


def _env_with(path, **extra):
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


@pytest.mark.timeout(120)
def test_installed_broken_plugins_fail_only_their_names(broken_plugins_path):
    import json

    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100,
                         env=_env_with(broken_plugins_path))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    loaded, failed = res["loaded"], res["failed"]
    # Built-ins and the good third-party plugin keep working; memory is still the built-in.
    assert {"memory", "nccl_reshard", "zmq", "sglang_ipc", "good2"} <= set(loaded)
    assert loaded["memory"].startswith("policyworker.testing")
    assert set(failed) == {"files", "broken"}
    for dist in ("policyworker-files", "pw-fake-dup", "pw-fake-other"):
        assert dist in failed["files"]["message"] and dist in failed["files"]["distribution"]
    assert failed["broken"]["distribution"] == "pw-fake-dup" and "failed to import" in failed["broken"]["message"]
    assert ["memory", "pw-fake-dup"] in res["problems"] and "files" in [p[0] for p in res["problems"]]
    assert res["memory_refit_exact"] is True  # the road itself works with the broken plugins installed


@pytest.mark.timeout(120)
def test_cli_load_exits_nonzero_naming_broken_plugins(broken_plugins_path):
    import json

    out = subprocess.run([sys.executable, "-m", "policyworker.cli", "transports", "--load", "--json"],
                         capture_output=True, text=True, timeout=100, env=_env_with(broken_plugins_path))
    assert out.returncode == 1, (out.stdout, out.stderr)
    for needle in ("files:", "pw-fake-other", "broken:", "pw_fake_missing_module", "memory (pw-fake-dup)"):
        assert needle in out.stderr, (needle, out.stderr)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["memory"]["distribution"] == "policyworker" and rows["memory"]["loaded"] is True
    assert rows["good2"]["loaded"] is True and rows["files"]["loaded"] is False
    # The env var hides third-party plugins: only the built-ins are left, all loading.
    quiet = subprocess.run([sys.executable, "-m", "policyworker.cli", "transports", "--load", "--json"],
                           capture_output=True, text=True, timeout=100,
                           env=_env_with(broken_plugins_path, **{DISABLE_AUTOLOAD_ENV: "1"}))
    assert quiet.returncode == 0, quiet.stderr
    assert {r["distribution"] for r in json.loads(quiet.stdout)} == {"policyworker"}


@pytest.mark.timeout(120)
def test_cli_load_exits_zero_when_every_plugin_loads():
    out = subprocess.run([sys.executable, "-m", "policyworker.cli", "transports", "--load"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
