import pytest

from policyworker import errors
from policyworker.errors import (
    ConfigError, PeerLost, PolicyWorkerError, RefitAborted, RefitTimeout, TransportError,
    TransportLoadError, translate_comm_error,
)


def test_every_error_is_in_the_tree_and_documented():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, PolicyWorkerError)
        assert name in errors.__doc__, f"{name} missing from the drawn tree"


def test_config_error_is_a_value_error_and_carries_context():
    err = ConfigError("bad", rank=3, transport="zmq", param="w")
    assert isinstance(err, ValueError)
    assert (err.rank, err.transport, err.param) == (3, "zmq", "w")
    assert issubclass(RefitTimeout, RefitAborted) and issubclass(RefitAborted, TransportError)


def test_load_error_names_entry_point_and_distribution():
    err = TransportLoadError("x", entry_point="foo", distribution="foo-dist")
    assert (err.entry_point, err.distribution, err.transport) == ("foo", "foo-dist", "foo")


@pytest.mark.parametrize(
    "text, kind",
    [
        ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:123", PeerLost),
        ("Socket Timeout", RefitTimeout),
        ("something else broke", TransportError),
    ],
)
def test_translate_comm_error(text, kind):
    out = translate_comm_error(RuntimeError(text), rank=1, transport="nccl_reshard")
    assert type(out) is kind
    assert out.rank == 1 and out.transport == "nccl_reshard"
    assert isinstance(out.__cause__, RuntimeError)


def test_translate_passes_our_errors_through():
    err = PeerLost("gone")
    assert translate_comm_error(err) is err
