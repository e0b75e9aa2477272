"""Integrations with other projects: vLLM (a weight-transfer backend), Hugging Face (configs).

Nothing here is imported by ``import policyworker``: each module imports its project
lazily, so policyworker works without vLLM or transformers installed.
"""
