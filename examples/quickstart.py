"""The whole loop in one process: a trainer refits a rollout after every step.

Run: python examples/quickstart.py   (CPU; the `files` transport, a temporary directory)
"""
import asyncio
import tempfile

import torch

from policyworker import RolloutWorker, TorchPolicyWorker


async def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    trainer = TorchPolicyWorker(model, rank=0)
    rollout = RolloutWorker(params={n: torch.empty_like(p) for n, p in model.state_dict().items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as directory:
        await asyncio.gather(trainer.attach_transport("files", directory=directory),
                             rollout.attach_transport("files", directory=directory))
        for step in range(1, 4):
            loss = model(torch.randn(32, 64)).square().mean()   # your training step
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sent, got = await asyncio.gather(trainer.refit("files", refit_timeout_s=30),
                                             rollout.refit("files", refit_timeout_s=30))
            weights = rollout.weights()                          # committed bytes only
            exact = all(torch.equal(weights[n], p) for n, p in model.state_dict().items())
            print(f"step {step}: v{got.version}, {got.bytes} bytes, bit-exact={exact}")
            assert exact
        await asyncio.gather(trainer.shutdown(), rollout.shutdown())


if __name__ == "__main__":
    asyncio.run(main())
