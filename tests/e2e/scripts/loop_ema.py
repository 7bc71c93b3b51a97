"""DDP training bounded by its own step counter, with an EMA and books of its own, as a function.

Written as a Kubeflow SDK training function (``CustomTrainer(func=train_fn)``):
its imports, its model class and its data inside it, so that the SDK can ship
its source alone, which it writes to a new ``ephemeral_script.py`` at every
pod start and runs with torchrun (run as a script, it calls the function
itself). A small MLP with dropout on synthetic data (from a fixed seed),
compiled with ``torch.compile``, a DistributedSampler with ``set_epoch``, SGD
with momentum, and an ``AveragedModel`` EMA updated after every optimizer
step, which no optimizer holds. The loop is ``for step in range(max_steps)``
over ``next(it)``, a new iterator at each epoch's end, as LLM pre-training
loops are written, and it keeps books: a running mean of the loss, the best
loss and an early-stopping patience, a list of logged losses, the samples
seen. Rank 0 saves the model, its EMA and the books at the end. It knows
nothing about jitckpt.
"""


def train_fn(
    max_steps: int = 24,
    batch_size: int = 16,
    ema_decay: float = 0.9,
    # aot_eager: dynamo and AOTAutograd as torch.compile runs them, without the minutes of
    # C++ code generation inductor needs on a CPU.
    compile_backend: str = "aot_eager",
) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn, optim
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(16, 32)
            self.dropout = nn.Dropout(0.2)
            self.out = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.dropout(torch.relu(self.hidden(x))))

    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(256, 16, generator=generator)
    dataset = TensorDataset(features, (features[:, :3].sum(dim=1) > 0).long())
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    net = Net()
    model = torch.compile(nn.parallel.DistributedDataParallel(net), backend=compile_backend)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(ema_decay))
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    epoch = 0
    sampler.set_epoch(epoch)
    it = iter(loader)
    running = 0.0
    best = float("inf")
    patience = 0
    logged = []
    samples = 0
    for step in range(max_steps):
        try:
            inputs, labels = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            inputs, labels = next(it)
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        ema.update_parameters(net)
        samples += len(labels)
        running = 0.9 * running + 0.1 * loss.item()
        if running < best:
            best, patience = running, 0
        else:
            patience += 1
        if step % 4 == 0:
            logged.append((step, round(running, 6)))

    if dist.get_rank() == 0:
        torch.save(net.state_dict(), "model.pt")
        torch.save(ema.module.state_dict(), "ema.pt")
        books = {
            "step": step,
            "epoch": epoch,
            "running": running,
            "best": best,
            "patience": patience,
            "logged": logged,
            "samples": samples,
        }
        torch.save(books, "books.pt")
        print(f"training done at step {step}; model.pt, ema.pt and books.pt saved", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train_fn()
