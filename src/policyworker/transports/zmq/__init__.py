"""zmq: see :mod:`policyworker.transports.zmq.transport` (its public names resolve here lazily,
so importing a sibling module does not import the transport)."""


def __getattr__(name: str):
    import importlib
    import importlib.util

    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a sibling module (``from . import x``)
        return importlib.import_module(f"{__name__}.{name}")
    module = importlib.import_module("policyworker.transports.zmq.transport")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
