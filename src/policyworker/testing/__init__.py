"""Test doubles and the transport conformance suite (httpx's MockTransport, trio's checks).

* :class:`InMemoryTransport` / :class:`MemoryHub` — the in-process test double
  (registered as transport ``memory``);
* :func:`check_transport` — the conformance suite every transport runs on itself;
* :mod:`.toy_model` — a small causal LM with Hugging Face names (``build_model``);
* :mod:`.faults` — fault injection for the drill and the tests;
* :mod:`.fixtures` — pytest fixtures shared by our suite and plugins' suites (imports pytest).
"""

from .conformance import ConformanceReport, TransportPair, check_transport
from .memory import InMemoryTransport, MemoryHub, MemorySetup, memory_pair_factory

__all__ = ["ConformanceReport", "InMemoryTransport", "MemoryHub", "MemorySetup", "TransportPair",
           "check_transport", "memory_pair_factory"]
