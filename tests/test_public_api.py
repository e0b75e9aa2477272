"""The public surface: __all__ must not drift, and everything in it must exist."""

import policyworker

EXPECTED = {
    "AbstractPolicyWorker", "CommGroup", "ConfigError", "Deadline", "DeviceFacts", "PeerLost",
    "PlanError", "PlanMismatch", "PolicyWorkerError", "ProtocolError", "RefitAborted", "RefitReport",
    "RefitTimeout", "RefitWatchdog", "RolloutWorker", "TornWeights", "Transport", "TransportContext",
    "TransportError", "TransportInfo", "TransportLoadError", "TransportRegistry", "WorkerClosed",
    "WorkerCore", "__version__", "device_facts", "list_transports", "load_transport", "new_group",
    "private_runtime_dir", "process_watchdog", "CheckpointError", "TorchPolicyWorker", "Parallelism",
    "ReshardPlan", "build_plan", "ModelConfig", "PRESETS", "build_model", "get_preset",
    "AccessDenied", "ControlClient", "SglangHttpEngine", "InProcessSglangEngine",
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


def test_no_public_attribute_left_out_of_all():
    public = {n for n in vars(policyworker) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(policyworker, n)).__name__ == "module"}
    assert public - modules <= set(policyworker.__all__), public - modules - set(policyworker.__all__)
