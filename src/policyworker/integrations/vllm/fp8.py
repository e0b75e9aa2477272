"""Block-FP8 vLLM layers as refit targets (``quantization="fp8"``, ``weight_block_size=[B, B]``).

A vLLM engine serving a block-FP8 checkpoint (the Qwen3-*-FP8 / DeepSeek-V3 format)
holds, per linear layer under vLLM's ``Fp8LinearMethod``, two parameters as its loader
fills them: ``weight`` (``float8_e4m3fn``, this rank's rows of the fused members, like an
unquantized weight) and ``weight_scale_inv`` (float32, one row of block scales per ``B``
weight rows, members stacked in the same order, one column per ``B`` input columns).

The refit keeps the trainer in BF16 and quantizes where the bytes leave: a vLLM rank
publishes its weight boxes as usual plus which of them land as FP8 (:func:`fp8_fields`);
the trainers' plan then carries those boxes as block-FP8 targets
(:mod:`..layout.formats.block_fp8`: each copy is the box's fp8 bytes and its block
scales, quantized by the trainer's pack step), so each rank receives ~half the bytes of BF16. The scales are not trainer
parameters: each ``weight_scale_inv`` member is a *derived* target (:func:`fp8_targets`),
the block rows of its weight box, placed where vLLM's own scale loader puts them (checked
at init like every other box). The commit is vLLM's own ``process_weights_after_loading``
(on CPU: its AMX/AVX-512 kernel repacks the weight), run by the stage as for any layer.

Refused with a ``ConfigError`` naming the layer: other quantization methods, per-tensor
FP8, static activation scales, non-square blocks, and boxes that cut a block.
:func:`save_fp8_checkpoint` writes a BF16 model as such a checkpoint by the same rule
(what an engine starts from, and vLLM's own loader's input in the tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policyworker.errors import ConfigError
from policyworker.layout.formats.block_fp8 import SCALE_SUFFIX, Fp8Target
from policyworker.integrations.vllm.plan import Need

__all__ = ["block_fp8_size", "fp8_fields", "fp8_quant_config", "fp8_targets", "save_fp8_checkpoint"]


def fp8_quant_config(block: int = 128) -> dict[str, Any]:
    """The ``quantization_config`` of a block-FP8 checkpoint (vLLM's ``Fp8Config`` reads it)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def block_fp8_size(module: Any) -> int:
    """``B`` of a vLLM linear layer under block-FP8 ``Fp8LinearMethod``; ConfigError for any
    other quantized layer (the policyworker backend moves unquantized and block-FP8 only)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    method = getattr(module, "quant_method", None)
    prefix = getattr(module, "prefix", type(module).__name__)
    if not isinstance(method, Fp8LinearMethod):
        raise ConfigError(f"{prefix} is quantized ({type(method).__name__}); the policyworker backend moves "
                          "unquantized weights and block-FP8 (Fp8LinearMethod with weight_block_size) only",
                          param=prefix)
    block = getattr(method, "weight_block_size", None)
    if not block or len(block) != 2 or block[0] != block[1]:
        raise ConfigError(f"{prefix}: FP8 with weight_block_size={block!r}; the policyworker backend refits "
                          "square block-FP8 only (e.g. [128, 128]); per-tensor FP8 is not supported", param=prefix)
    if getattr(method, "act_q_static", False):
        raise ConfigError(f"{prefix}: FP8 with static activation scales is not supported", param=prefix)
    return int(block[0])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_targets(module: Any, pname: str, pairs: Sequence[tuple[Need, Any]]) -> list[tuple[Need, Any, bool, int]]:
    """``(need, shard, derived, block)`` of parameter ``pname`` of a block-FP8 vLLM layer.

    ``pairs``: the layer's boxes in weight coordinates (what an unquantized layer loads),
    one per fused member, with vLLM's shard id. ``weight``: those boxes, landing as fp8.
    ``weight_scale_inv``: each member's block rows and columns — a derived target, named
    as the checkpoint names it (``<member>.weight_scale_inv``), not sent by the trainers.
    """
    block = block_fp8_size(module)
    out: list[tuple[Need, Any, bool, int]] = []
    if pname == "weight":
        return [(need, shard, False, block) for need, shard in pairs]
    if pname != "weight" + SCALE_SUFFIX:
        raise ConfigError(f"{getattr(module, 'prefix', '?')}.{pname}: the policyworker backend refits block-FP8 "
                          "layers' weight and weight_scale_inv only", param=pname)
    for need, shard in pairs:
        if len(need.shape) != 2:
            raise ConfigError(f"{need.name}: a block-FP8 weight must be 2-D, got {list(need.shape)}", param=need.name)
        for d in (0, 1):
            for cut in (need.start[d], need.stop[d]):
                if cut % block and cut != need.shape[d]:
                    raise ConfigError(f"vLLM loads {need.name} {list(need.shape)} cut at {cut} on dim {d}, inside "
                                      f"a {block}-block", param=need.name)
        shape = tuple(_cdiv(s, block) for s in need.shape)
        start = tuple(a // block for a in need.start)
        stop = tuple(_cdiv(b, block) for b in need.stop)
        out.append((Need(need.name, shape, start, stop), shard, True, block))
    return out


def fp8_fields(targets: Iterable[Any]) -> dict[str, Any]:
    """The `Needs` fields saying which published boxes land as block-FP8: ``fp8_block`` and
    ``fp8`` (their checkpoint names). ConfigError if layers disagree on the block size."""
    blocks = {t.fp8_block for t in targets if t.fp8_block}
    if len(blocks) > 1:
        raise ConfigError(f"vLLM's FP8 layers use several block sizes {sorted(blocks)}; one is supported")
    names = sorted(t.need.name for t in targets if t.fp8_block and not t.derived)
    return {"fp8_block": blocks.pop() if blocks else 0, "fp8": names}


def save_fp8_checkpoint(model: Any, path: str, *, target: Fp8Target | None = None) -> list[str]:
    """Save Hugging Face ``model`` (BF16) to ``path`` as a block-FP8 checkpoint.

    Tensors ``target`` matches (default: the linear projections) are stored as
    ``float8_e4m3fn`` plus ``<name>_scale_inv`` by the reference quantizer (the rule the
    refit quantizes by, :mod:`..layout.formats.block_fp8_pack`); ``config.json`` gets the
    ``quantization_config`` vLLM reads. Returns the quantized names.
    """
    import json
    import os

    from safetensors.torch import load_file, save_file

    from policyworker.layout.formats.block_fp8_pack import quantize_reference

    target = target or Fp8Target()
    model.save_pretrained(path, safe_serialization=True)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ConfigError(f"save_fp8_checkpoint writes single-file checkpoints; {path} has {files}")
    file = os.path.join(path, files[0])
    state = load_file(file)
    out, quantized = {}, []
    for name, tensor in state.items():
        if target.targets(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_reference(tensor, target.block)
            quantized.append(name)
        else:
            out[name] = tensor
    save_file(out, file, metadata={"format": "pt"})
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config: Mapping[str, Any] = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "quantization_config": fp8_quant_config(target.block)}, f, indent=2)
    return quantized
