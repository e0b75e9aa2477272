"""vllm: see :mod:`policyworker.integrations.vllm.backend` (its public names resolve here lazily,
so importing a sibling module does not import the transport)."""


def __getattr__(name: str):
    import importlib
    import importlib.util

    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a sibling module (``from . import x``)
        return importlib.import_module(f"{__name__}.{name}")
    module = importlib.import_module("policyworker.integrations.vllm.backend")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
