"""Integrations with other projects: vLLM (weight-transfer backends), SGLang (the engine adapter), PEFT (LoRA), Ray.

Nothing here is imported by ``import policyworker``: each module imports its project
lazily, so policyworker works without vLLM or transformers installed.
"""
