"""TorchPolicyWorker: the trainer-side worker over a torch ``nn.Module`` causal LM.

The model's forward maps ``input_ids [B, S]`` (int64) to logits ``[B, S, V]``, or to
an object with a ``.logits`` tensor (what a Hugging Face ``AutoModelForCausalLM``
returns). Sequences are right-padded: sequence ``b`` is ``input_ids[b, :input_lengths[b]]``.

The worker owns three CPU copies of the weights, each allocated once:

* the *reference* weights (the weights at construction, or ``reference_state_dict``),
  swapped into the model's parameters for ``get_reference_policy_logprobs``;
* the *backup* of the live weights during that swap (allocated at the first call);
* the *snapshot* of an asynchronous checkpoint save (allocated at the first save).

They are pinned when CUDA is available (fast, asynchronous host/device copies) and
plain CPU memory otherwise; none of them costs device memory. ``finish_training``
drops the backup and the snapshot.

Everything that touches the weights runs on the refit executor thread, so swaps,
snapshots and refits never interleave. The trainer must not run the model on its
own thread while one of these calls is in flight: the parameters may be holding the
reference weights at that moment. (The reference policy's checks and log-prob math:
:mod:`~policyworker.workers.reference`.)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from policyworker.runtime._aio import run_in_executor
from policyworker.workers.checkpoint import AsyncCheckpointWriter, read_checkpoint
from policyworker.errors import CheckpointError, ConfigError, PolicyWorkerError
from policyworker.layout.experts import expert_local_views, expert_specs, expert_views, has_fused_experts
from policyworker.layout.local import is_dtensor, shard_views
from policyworker.workers.reference import (
    check_batch,
    check_micro_batch_size,
    check_values,
    cpu_copies,
    local_shard,
    reference_sources,
    token_logprobs,
)
from policyworker.workers.trainer import AbstractPolicyWorker

__all__ = ["TorchPolicyWorker"]


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text or text.endswith(os.sep):
        raise ConfigError(f"checkpoint path must name a file, got {path!r}")
    return os.path.abspath(text)


def _unique_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], dict[str, int]]:
    """Parameters once each (tied ones under their first name), and every name -> index."""
    unique = list(model.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(unique)}
    names = {name: index[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    return unique, names


def _check_sharding(unique: list[tuple[str, nn.Parameter]]) -> bool:
    """True for a DTensor (FSDP2 / TP) model; ConfigError for what the worker cannot serve."""
    sharded = [name for name, p in unique if is_dtensor(p)]
    if not sharded:
        return False
    plain = [name for name, p in unique if not is_dtensor(p)]
    if plain:
        raise ConfigError(f"the model mixes DTensor parameters ({sharded[0]!r}, ...) with plain ones ({plain[0]!r}, "
                          "...): shard every parameter (fully_shard the root module too)", param=plain[0])
    for name, p in unique:
        bad = [pl for pl in p.placements if pl.is_partial()]
        if bad:
            raise ConfigError(f"parameter {name!r} has a Partial placement ({bad[0]}): not a weight the worker "
                              "can copy or refit", param=name)
    return True


class TorchPolicyWorker(AbstractPolicyWorker):
    """Trainer-side worker over a causal LM ``model`` (see the module docstring).

    ``reference_state_dict``: the reference policy's weights by parameter name (tied
    names may appear once or under every alias; buffer names are accepted and
    ignored: only parameters are swapped). Values are cast to each parameter's dtype.
    Default: a copy of the model's weights now. ``micro_batch_size``: sequences per
    forward in ``get_reference_policy_logprobs``. ``core_kwargs`` go to
    ``WorkerCore`` (``device``, ``runtime_dir``, ``timeout_s``, ...).

    Refit (``nccl_reshard``): by default the model holds full tensors and this rank
    sends its training-layout shard of them (views, no copies). A trainer whose model
    is itself sharded passes ``refit_params`` (its local shards by name, or DTensors)
    and ``refit_source`` (a ModelConfig, ``{name: (shape, dtype)}``, or the DTensor
    state dict). A transport's setup (bucket_bytes, in_flight, checksum, ...) is given
    when it is attached (``attach_transport(name, **setup)``) and must match the
    rollouts'. Plan-less transports (and colocated one-source plans)
    move the model's named parameters themselves.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        rank: int = 0,
        world_size: int = 1,
        reference_state_dict: Mapping[str, torch.Tensor] | None = None,
        micro_batch_size: int = 8,
        refit_params: Mapping[str, torch.Tensor] | None = None,
        refit_source: Any = None,
        **core_kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
        unique, names = _unique_params(model)
        if not unique:
            raise ConfigError("model has no parameters")
        # Validate and copy before the core starts its executor thread: a bad argument
        # leaves nothing behind.
        self._pin = torch.cuda.is_available()
        self._sharded = _check_sharding(unique)
        self._fused_experts = has_fused_experts(name for name, _ in unique)
        sources = reference_sources(model, unique, names, reference_state_dict)
        self._reference = cpu_copies(sources, unique, self._pin)
        super().__init__(rank=rank, world_size=world_size, **core_kwargs)
        self.model = model
        self._params = unique
        self._refit_params = None if refit_params is None else dict(refit_params)
        self._refit_source = refit_source
        self._backup: list[torch.Tensor] | None = None
        self._checkpointer = AsyncCheckpointWriter(
            pin_memory=self._pin, thread_name=f"policyworker-ckpt-{self.rank}"
        )
        # Writes submitted and not yet finalized; the executor thread appends, the loop
        # takes them out.
        self._pending_saves: list[concurrent.futures.Future] = []
        self._saves_lock = threading.Lock()

    @classmethod
    def for_demo(cls, *, rank: int, world_size: int, timeout_s: float) -> TorchPolicyWorker:
        """A worker over ``policyworker.models``' "tiny" preset (seed 0 on every rank)."""
        from policyworker.models import get_preset
        from policyworker.models.toy_model import build_model

        return cls(build_model(get_preset("tiny"), seed=0), rank=rank, world_size=world_size, timeout_s=timeout_s)

    # -- what a refit moves -----------------------------------------------------------
    def _named_tensors(self) -> Mapping[str, torch.Tensor]:
        """The model's unique parameters by name: the live ``Parameter`` objects."""
        return {name: p for name, p in self._params}

    def _refit_model_source(self) -> Any:
        """The plan's source: ``refit_source``, else the model's DTensors (FSDP2: their placements
        are the layout), else its ModelConfig (or one read from its Hugging Face config), else its shapes."""
        if self._refit_source is not None:
            return self._refit_source
        if self._sharded:
            return dict(self._params)
        config = self._refit_gen_config()
        if config is not None:
            return config
        # Fused expert tensors (transformers >= 5) are planned as their per-expert members.
        return expert_specs({name: (tuple(p.shape), p.dtype) for name, p in self._params})

    def _refit_gen_config(self) -> Any:
        """The model's ModelConfig (its own, or read from its Hugging Face config), or None."""
        from policyworker.models import ModelConfig

        config = getattr(self.model, "config", None)
        if isinstance(config, ModelConfig):
            return config
        from policyworker.models.hf import is_hf_config

        if is_hf_config(config):  # a Hugging Face model: its heads decide how k/v split
            return ModelConfig.from_hf(config)
        return None

    def _refit_dtype(self) -> Any:
        dtypes = {p.dtype for _, p in self._params if p.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else torch.bfloat16

    def _plan_tensors(self, plan: Any) -> Mapping[str, torch.Tensor]:
        """``refit_params`` if given, else this rank's shard as views of the full model."""
        if self._refit_params is not None:
            return self._refit_params
        if self._sharded:  # DTensors: the core sends their local shards
            if self._fused_experts:  # plans name each expert: views of the fused shards
                return expert_local_views({n: local_shard(t) for n, t in self._params},
                                          plan.local_tensors("src", self.rank))
            return self._named_tensors()
        if self._fused_experts:  # plans name each expert: views of the fused tensors
            return shard_views(plan, 0 if plan.body.train_world_size == 1 else self.rank,
                               expert_views(self._named_tensors()))
        return super()._plan_tensors(plan)

    # -- reference policy ----------------------------------------------------------
    async def get_reference_policy_logprobs(
        self, *, data: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-token log-probs of ``data`` under the reference policy.

        ``data``: a mapping (dict, BatchedDataDict, ...) with ``input_ids [B, S]``
        (int64; int32 accepted) and ``input_lengths [B]`` (integers in ``[0, S]``).
        Token values at padded positions (``>= input_lengths[b]``) are ignored.

        Returns a plain ``dict`` ``{"reference_logprobs": float32 CPU tensor [B, S]}``:
        position ``i < input_lengths[b]`` holds ``log p(token_i | tokens_<i)``;
        position 0 and padded positions hold 0. Log-softmax runs in float32.

        Each micro-batch (``micro_batch_size`` overrides the configured size) is cut
        to its longest sequence, so the micro-batch size changes only the shapes of
        the matmuls: for float32 weights results agree across sizes within 1e-5
        absolute (differently blocked matmuls round differently; tested). bf16
        weights agree only to bf16 rounding of the logits (about 2e-3 measured on
        the "tiny" preset; it grows with depth and is not a contract).

        The reference weights are copied into the model's parameter storages (no
        re-allocation), the model runs in eval mode under ``torch.no_grad``, and the
        live weights and the training mode are restored exactly afterwards, also when
        the forward raises. Gradients (``.grad``) are not touched. Bad inputs raise
        ``ConfigError`` before any weight moves.
        """
        ids, lengths = check_batch(data)
        mbs = self.micro_batch_size if micro_batch_size is None else check_micro_batch_size(micro_batch_size)
        logprobs = await self._run(self._reference_logprobs, ids, lengths, mbs)
        return {"reference_logprobs": logprobs}

    def _reference_logprobs(self, ids: torch.Tensor, lengths: torch.Tensor, mbs: int) -> torch.Tensor:
        ids, lengths, valid = check_values(ids, lengths, getattr(getattr(self.model, "config", None), "vocab_size", None))
        batch, seq = ids.shape
        out = torch.zeros(batch, seq, dtype=torch.float32)
        if batch == 0 or seq < 2 or int(lengths.max()) < 2:
            return out  # no position has a token before it
        params = [local_shard(p) for _, p in self._params]  # FSDP2: swap each rank's shard
        if self._backup is None:
            self._backup = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self._pin) for p in params]
        # Per module: a trainer may keep parts (a frozen tower) in eval on purpose.
        modes = [(m, m.training) for m in self.model.modules()]
        device = params[0].device
        with torch.no_grad():
            for saved, p in zip(self._backup, params):
                saved.copy_(p, non_blocking=self._pin)
            try:
                # One stream orders these after the backup copies; nothing reads the
                # backup before the final synchronize.
                for p, ref in zip(params, self._reference):
                    p.copy_(ref, non_blocking=self._pin)
                self.model.eval()
                for start in range(0, batch, mbs):
                    stop = min(start + mbs, batch)
                    width = int(lengths[start:stop].max())
                    if width < 2:
                        continue
                    chunk = ids[start:stop, :width].to(device)
                    out[start:stop, 1:width] = token_logprobs(self.model, chunk).cpu()
            finally:
                for p, saved in zip(params, self._backup):
                    p.copy_(saved, non_blocking=self._pin)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                for module, mode in modes:
                    module.training = mode
        valid[:, 0] = False
        return out.masked_fill_(~valid, 0.0)

    # -- checkpoints ---------------------------------------------------------------
    async def save_checkpoint(self, path: Any) -> None:
        """Snapshot the current weights, then write them to ``path`` in the background.

        Returns once the snapshot is taken (on the refit executor, so it never sees
        reference weights mid-swap); the write runs on a separate writer thread. The
        file is ``policyworker.workers.checkpoint.FORMAT`` (the model's ``state_dict()``),
        written to a temp name and renamed atomically. A save first waits for the
        previous write (they share one snapshot buffer) and first raises the previous
        save's error if it failed and was not finalized: errors are never dropped.
        Call ``finalize_async_save`` to wait for the write and see its error.
        """
        target = _check_path(path)
        self._ensure_open()
        await self.finalize_async_save()
        await self._run(self._snapshot, target)

    def _snapshot(self, path: str) -> None:
        # FSDP2: each rank saves its own shards (a sharded checkpoint, one file per rank).
        state = {k: local_shard(v) for k, v in self.model.state_dict().items()}
        future = self._checkpointer.snapshot_and_submit(state, path)
        with self._saves_lock:
            self._pending_saves.append(future)

    async def finalize_async_save(self) -> None:
        """Wait for every submitted checkpoint write; raise the first failure.

        Raises ``CheckpointError`` (cause chained) if a write failed; its temp file is
        gone and no file was left at its path. Each failure is raised once.
        """
        with self._saves_lock:
            futures = list(self._pending_saves)
        if not futures:
            return
        # Waited on a helper thread: the loop stays free, and cancelling this wait
        # never cancels the write.
        await run_in_executor(None, concurrent.futures.wait, futures)
        with self._saves_lock:
            self._pending_saves = [f for f in self._pending_saves if f not in futures]
        for future in futures:
            exc = future.exception()
            if exc is None:
                continue
            if isinstance(exc, PolicyWorkerError):
                raise exc
            raise CheckpointError(f"checkpoint write failed: {type(exc).__name__}: {exc}", rank=self.rank) from exc

    async def load_checkpoint(self, path: Any) -> None:
        """Copy the weights stored at ``path`` into the model (the reference stays).

        Names, shapes and dtypes must match the model's ``state_dict()`` exactly, else
        ``CheckpointError`` and the model is unchanged. Finalize a save to the same
        path first.
        """
        source = _check_path(path)
        await self._run(self._load, source)

    def _load(self, path: str) -> None:
        stored = read_checkpoint(path)
        live = {k: local_shard(v) for k, v in self.model.state_dict().items()}
        if set(stored) != set(live):
            missing, extra = sorted(set(live) - set(stored)), sorted(set(stored) - set(live))
            raise CheckpointError(f"{path!r} does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}", path=path)
        for name, t in live.items():
            s = stored[name]
            if not isinstance(s, torch.Tensor) or s.shape != t.shape or s.dtype != t.dtype:
                raise CheckpointError(f"{path!r}: {name} does not match the model's {t.dtype} {tuple(t.shape)}", path=path)
        with torch.no_grad():
            for name, t in live.items():
                t.copy_(stored[name])

    # -- training chores -----------------------------------------------------------
    async def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Hand the memory of training back: finalize saves, drop grads and buffers.

        Waits for pending checkpoint writes (raising their error), then sets every
        parameter's ``.grad`` to None and frees the live-weight backup and the
        checkpoint snapshot (both reallocated on next use). The model and the
        reference weights stay. Arguments are accepted for NeMo RL's call signature
        and ignored.
        """
        await self.finalize_async_save()
        await self._run(self._release_training_memory)

    def _release_training_memory(self) -> None:
        for _, p in self._params:
            p.grad = None
        self._backup = None
        self._checkpointer.release_buffer()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def get_gpu_info(self) -> dict[str, Any]:
        """The core's device facts plus model facts (counts over unique parameters)."""
        info = super().get_gpu_info()
        params = [p for _, p in self._params]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        info.update(
            model_param_count=sum(p.numel() for p in params),
            model_param_bytes=sum(p.numel() * p.element_size() for p in params),
            model_dtype=dtypes[0] if len(dtypes) == 1 else "mixed",
            model_dtypes=dtypes,
            reference_weights_bytes=sum(t.numel() * t.element_size() for t in self._reference),
            reference_weights_pinned=self._pin,
            micro_batch_size=self.micro_batch_size,
        )
        return info

    async def shutdown(self) -> bool:
        """Close the worker; return only after pending checkpoint writes finished.

        The refit executor drains first, so every snapshot already started has
        submitted its write. If a write failed and was never finalized, its
        ``CheckpointError`` is raised after the worker is closed.
        """
        if self._closed:
            return True
        try:
            await super().shutdown()
        finally:
            try:
                await self.finalize_async_save()
            finally:
                self._checkpointer.close()
        return True

    def _close_resources(self) -> None:
        # The executor has drained: nothing reads these any more.
        self._backup = None
        self._reference = []
