"""The vLLM recipe of docs/vllm.md, failures included, end to end on one CPU host.

An offline ``LLM`` with the ``"policyworker"`` backend, two trainer processes (tp=2
over a tiny Qwen3 built locally), refits driven by a controller that catches
policyworker's own error types (``typed_errors``). At ``--kill-at`` trainer 1 dies
mid-refit (SIGKILL after its 3rd wait): the controller catches ``PeerLost``, starts a
replacement trainer, has every trainer and the engine join fresh groups, and refits
the same version again. After every committed refit vLLM's greedy tokens are compared
with Hugging Face transformers' on the same weights.

    python examples/vllm_recovery.py --refits 3 --kill-at 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile

import torch

CONFIG = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2)
HOST, N_TRAIN, N_GEN = "127.0.0.1", 2, 1
PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]


def weights_of_step(version: int):
    """The stand-in for training: version ``v``'s weights are the model initialised under seed ``v``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(version)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **CONFIG), torch_dtype=torch.float32).eval()


# -- trainer.py: one process per training rank ---------------------------------------------
async def trainer(rank, n_train, n_gen, model_dir, commands, replies):
    from transformers import AutoModelForCausalLM
    from policyworker import TorchPolicyWorker
    from policyworker.errors import PolicyWorkerError
    from policyworker.integrations.vllm.plan import prepare_vllm_refit

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    w = TorchPolicyWorker(model, rank=rank, world_size=n_train, timeout_s=60)

    async def connect(cmd):  # fresh ports every time: the old groups may still hold theirs
        w.refit_version = cmd["version"]  # a replacement trainer takes the survivors' version
        world = n_train + n_gen
        await w.init_collective(cmd["host"], cmd["update_port"], world, train_world_size=n_train)
        await w.init_nccl_reshard_comm_group([cmd["host"]], [cmd["stage_port"]], 1, 0, world, rank)
        # reads vLLM's needs, publishes the plan, attaches nccl_reshard (setup = the engine's reshard_options)
        await prepare_vllm_refit(w, f"tp={n_train}", n_gen, bucket_bytes=64 << 10)

    loop = asyncio.get_running_loop()
    while (cmd := await loop.run_in_executor(None, commands.get)) != "stop":  # your RPC
        try:
            if cmd["cmd"] == "connect":
                await connect(cmd)
            elif cmd["cmd"] == "refit":
                train_step(model, cmd["version"], cmd.get("die_after_waits"))
                await w.refit("nccl_reshard", refit_timeout_s=60)  # sends w.refit_version + 1
            replies.put({"rank": rank, "ok": True})
        except PolicyWorkerError as exc:
            replies.put({"rank": rank, "ok": False, "error": type(exc).__name__})
    await w.shutdown()


def train_step(model, version, die_after_waits=None):
    with torch.no_grad():
        for p, q in zip(model.parameters(), weights_of_step(version).parameters()):
            p.copy_(q)
    if die_after_waits:  # the example's fault: this trainer dies in the middle of the refit
        from policyworker.testing.faults import die_after_waits as die

        die(die_after_waits)


def trainer_process(rank, model_dir, commands, replies):
    torch.set_num_threads(1)
    asyncio.run(trainer(rank, N_TRAIN, N_GEN, model_dir, commands, replies))


# -- controller.py ----------------------------------------------------------------------
class Trainers:
    """The controller's handle on the trainer processes (here: local processes and queues)."""

    def __init__(self, model_dir):
        self.ctx, self.model_dir = mp.get_context("spawn"), model_dir
        self.replies = self.ctx.Queue()
        self.procs, self.commands = {}, {}
        for rank in range(N_TRAIN):
            self.start(rank)

    def start(self, rank):
        self.commands[rank] = self.ctx.Queue()
        self.procs[rank] = self.ctx.Process(target=trainer_process, daemon=True,
                                            args=(rank, self.model_dir, self.commands[rank], self.replies))
        self.procs[rank].start()

    def tell(self, cmd, ranks=None):
        for rank in ranks if ranks is not None else self.procs:
            self.commands[rank].put(cmd)

    def answers(self, n, timeout_s=120.0):
        return [self.replies.get(timeout=timeout_s) for _ in range(n)]

    def close(self):
        for rank, p in self.procs.items():
            if p.is_alive():
                self.commands[rank].put("stop")
            p.join(30)
            if p.is_alive():
                p.kill()


def free_ports(count):
    """``count`` distinct ports free on the trainers' host now (this example runs on one
    host), drawn below the kernel's ephemeral range by policyworker's ``free_port``: a port
    the kernel picks (``bind(0)``) can be taken by any client socket before a trainer binds it."""
    from policyworker.runtime.procs import free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port(HOST)
        if port not in ports:
            ports.append(port)
    return ports


def connect(llm, trainers, version):
    """Every trainer and the engine join fresh groups: the first init and every recovery."""
    from policyworker.integrations.vllm.backend import typed_errors

    ports = dict(zip(("update_port", "stage_port"), free_ports(2)))
    trainers.tell({"cmd": "connect", "version": version, "host": HOST, **ports})
    init_info = {"host": HOST, "update_port": ports["update_port"], "stage_ports": [ports["stage_port"]],
                 "trainers_per_stage": [N_TRAIN], "timeout_s": 60, "refit_timeout_s": 60,
                 "reshard_options": {"bucket_bytes": 64 << 10}}
    with typed_errors():
        llm.init_weight_transfer_engine({"init_info": init_info})  # raises within 2 x timeout_s
    if not all(r["ok"] for r in trainers.answers(len(trainers.procs))):
        raise RuntimeError("a trainer failed to connect")


def refit(llm, trainers, version, die=None):
    """Trainers send ``version`` while vLLM receives it; raises policyworker's error types."""
    from policyworker.integrations.vllm.backend import typed_errors

    for rank in trainers.procs:
        extra = {"die_after_waits": 3} if rank == die else {}
        trainers.tell({"cmd": "refit", "version": version, **extra}, [rank])
    with typed_errors():
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(weight_version=str(version))
    llm.reset_prefix_cache()  # cached KV was computed with the old weights
    trainers.answers(len(trainers.procs))


def run(llm, trainers, refits, kill_at):
    from policyworker.errors import PeerLost

    connect(llm, trainers, 0)
    version = 0
    for step in range(1, refits + 1):
        try:
            refit(llm, trainers, version + 1, die=1 if step == kill_at else None)
        except PeerLost as exc:  # a trainer died: vLLM still serves `version`
            print(f"refit {version + 1}: PeerLost ({exc.rank=}); serving {llm.get_weight_version()!r}; recovering")
            trainers.answers(N_TRAIN - 1)          # the survivors' failures
            trainers.procs[1].join(30)
            trainers.start(1)                      # 1. a replacement trainer (same rank)
            connect(llm, trainers, version)        # 2.-3. fresh ports, every side re-joins
            refit(llm, trainers, version + 1)      # 4. the same version again
        version += 1
        check(llm, version)


def check(llm, version):
    from vllm import SamplingParams

    from policyworker.testing.vllm_world import greedy_tokens

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [list(o.outputs[0].token_ids)
           for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    want = greedy_tokens(weights_of_step(version), PROMPTS, 8)
    served = llm.get_weight_version()
    print(f"weight_version={served} vLLM tokens {'==' if got == want else '!='} HF tokens")
    if got != want or served != str(version):
        raise SystemExit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refits", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=2, help="refit during which trainer 1 dies (0: none)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    tmp = tempfile.mkdtemp(prefix="policyworker-recovery-")
    model_dir = os.path.join(tmp, "model")
    trainers = None
    try:
        weights_of_step(0).save_pretrained(model_dir, safe_serialization=True)
        trainers = Trainers(model_dir)
        llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                  max_num_seqs=4, seed=0, weight_transfer_config={"backend": "policyworker"})
        run(llm, trainers, args.refits, args.kill_at)
        return 0
    except queue.Empty:
        print("a trainer did not answer in time", file=sys.stderr)
        return 1
    finally:
        if trainers is not None:
            trainers.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
