"""A word-level LSTM updated by hand, as pytorch/examples' ``word_language_model/main.py``
does without ``--use-optimizer`` (written for these tests, in its shape).

No optimizer: after ``backward()`` and gradient clipping each parameter is moved by
``-lr * grad`` in a loop over ``model.parameters()``, and ``lr`` is divided by 4 when
the validation loss stops improving. The corpus is made here from a fixed seed. It
knows nothing of jitckpt.

    python loop_hand_sgd.py --epochs 3 --save out.pt
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--bptt", type=int, default=7)
parser.add_argument("--save", default="out.pt")
args = parser.parse_args()

torch.manual_seed(1111)
ntokens = 40
corpus = torch.randint(0, ntokens, (600,), generator=torch.Generator().manual_seed(5))
train_data = corpus[:500].view(4, -1).t().contiguous()
val_data = corpus[500:].view(2, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntokens, 16)
        self.rnn = nn.LSTM(16, 16)
        self.decoder = nn.Linear(16, ntokens)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden


def batches(source):
    for i in range(0, source.size(0) - 1, args.bptt):
        seq_len = min(args.bptt, len(source) - 1 - i)
        yield source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


model = RNNModel()
criterion = nn.NLLLoss()
lr, best_val_loss = args.lr, None
for epoch in range(1, args.epochs + 1):
    model.train()
    hidden = None
    for batch, (data, targets) in enumerate(batches(train_data)):
        if hidden is not None:
            hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        print(f"| epoch {epoch:3d} | batch {batch:3d} | lr {lr:.4f} | loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        val_loss = sum(
            criterion(model(data, None)[0].view(-1, ntokens), targets).item()
            for data, targets in batches(val_data)
        )
    if best_val_loss is None or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0
torch.save(model.state_dict(), args.save)
print(f"training done: lr {lr}", flush=True)
