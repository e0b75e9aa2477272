"""Test doubles and the transport conformance suite (httpx's MockTransport, trio's checks).

* :class:`InMemoryTransport` / :class:`MemoryHub` — the in-process test double
  (registered as transport ``memory``);
* :func:`check_transport` — the conformance suite every transport runs on itself,
  through real workers; :class:`TransportPair` / :func:`plain_pair` build its pairs;
* :mod:`.fp8_check` — every FP8 kernel variant against the torch oracle;
  (the toy causal LM, ``build_model``, is :mod:`policyworker.models.toy_model`: the demo uses it);
* :mod:`.faults` — fault injection for the drill and the tests;
* :mod:`.fixtures` — pytest fixtures shared by our suite and plugins' suites (imports pytest).
"""

from policyworker.testing.conformance import ConformanceReport, check_transport
from policyworker.testing.memory import InMemoryTransport, MemoryHub, MemorySetup, memory_pair_factory
from policyworker.testing.pairs import TransportPair, plain_pair, tensor_module

__all__ = ["ConformanceReport", "InMemoryTransport", "MemoryHub", "MemorySetup", "TransportPair",
           "check_transport", "memory_pair_factory", "plain_pair", "tensor_module"]
