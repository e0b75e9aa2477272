"""Integrations with other projects: vLLM (weight-transfer backends), Hugging Face (configs), PEFT (LoRA).

Nothing here is imported by ``import policyworker``: each module imports its project
lazily, so policyworker works without vLLM or transformers installed.
"""
