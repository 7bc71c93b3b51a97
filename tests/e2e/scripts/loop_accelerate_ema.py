"""An Accelerate loop with an EMA and a metrics tracker, both registered for checkpointing.

As Accelerate's docs show it: ``accelerator.register_for_checkpointing``
names what ``save_state``/``load_state`` must carry besides the prepared
objects. Written as a Kubeflow SDK training function
(``CustomTrainer(func=train_fn)``): its imports, classes and data inside it,
so that the SDK can ship its source alone (run as a script, it calls the
function itself). A small classifier with dropout on synthetic data, a
shuffled DataLoader, AdamW with a per-step schedule, an ``AveragedModel`` EMA
updated after each step, and ``StepMetrics``, a tracker with ``state_dict``.
The main process saves the model, the EMA and the tracker at the end. It
knows nothing about jitckpt.
"""


def train_fn(epochs: int = 3, batch_size: int = 8) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch import nn
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.utils.data import DataLoader, TensorDataset

    class StepMetrics:
        """The loss of every step and how many samples the run has seen."""

        def __init__(self) -> None:
            self.losses: list = []
            self.samples = 0

        def update(self, loss: float, batch: int) -> None:
            self.losses.append(loss)
            self.samples += batch

        def state_dict(self) -> dict:
            return {"losses": list(self.losses), "samples": self.samples}

        def load_state_dict(self, state: dict) -> None:
            self.losses = list(state["losses"])
            self.samples = state["samples"]

    accelerator = Accelerator(cpu=True)
    set_seed(42)
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(128, 20, generator=generator)
    dataset = TensorDataset(features, (features[:, :4].sum(dim=1) > 0).long())
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ema = AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    metrics = StepMetrics()
    accelerator.register_for_checkpointing(ema, metrics)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(epochs):
        model.train()
        for inputs, labels in loader:
            loss = loss_fn(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            ema.update_parameters(accelerator.unwrap_model(model))
            metrics.update(loss.item(), len(labels))
        accelerator.print(f"epoch {epoch} done, {metrics.samples} samples")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = {
            "model": accelerator.unwrap_model(model).state_dict(),
            "ema": ema.state_dict(),
            "metrics": metrics.state_dict(),
        }
        accelerator.save(final, "final.pt")
        print("training done; final.pt saved", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    train_fn()
