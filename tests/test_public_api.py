"""The public surface: __all__ must not drift, and everything in it must exist."""

import policyworker

EXPECTED = {
    # workers and the one refit road
    "AbstractPolicyWorker", "TorchPolicyWorker", "RolloutWorker", "WeightLedger",
    # the transport contract, the built-ins, the test double and the conformance suite
    "Transport", "TransportContext", "RefitReport", "NcclReshardTransport", "ZmqIpcTransport",
    "SglangIpcTransport", "InMemoryTransport", "check_transport", "TransportInfo", "list_transports",
    "load_transport",
    # errors
    "PolicyWorkerError", "ConfigError", "PlanError", "PlanMismatch", "TransportError", "TransportLoadError",
    "PeerLost", "RefitAborted", "RefitTimeout", "ProtocolError", "AccessDenied", "TornWeights",
    "RefitInProgress", "CheckpointError", "WorkerClosed", "ProcessFailed",
    # plans, models, engines, control
    "Parallelism", "ReshardPlan", "build_plan", "ModelConfig", "PRESETS", "get_preset",
    "ControlClient", "SglangHttpEngine", "InProcessSglangEngine", "__version__",
}


def test_all_matches_the_expected_surface():
    assert set(policyworker.__all__) == EXPECTED
    assert len(policyworker.__all__) == len(set(policyworker.__all__)), "duplicates in __all__"


def test_every_exported_name_exists_and_is_public():
    for name in policyworker.__all__:
        obj = getattr(policyworker, name)
        if name != "__version__":
            module = getattr(obj, "__module__", "policyworker")
            assert module.startswith("policyworker"), (name, module)


def test_import_loads_no_transport():
    import subprocess
    import sys

    code = ("import sys, policyworker; "
            "print(sorted(m for m in sys.modules if m.startswith('policyworker.transports.') and "
            "not m.endswith(('.base',))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_transport_load_error_is_a_packaging_error_not_a_refit_failure():
    assert not issubclass(policyworker.TransportLoadError, policyworker.TransportError)
    assert issubclass(policyworker.ProcessFailed, policyworker.PolicyWorkerError)


def test_no_public_attribute_left_out_of_all():
    public = {n for n in vars(policyworker) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(policyworker, n)).__name__ == "module"}
    assert public - modules <= set(policyworker.__all__), public - modules - set(policyworker.__all__)
