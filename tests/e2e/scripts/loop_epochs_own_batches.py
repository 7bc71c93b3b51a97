"""A word-level LSTM trained the way pytorch/examples' ``word_language_model/main.py``
trains one (written for these tests, in its shape).

No DataLoader: ``train()`` walks a batchified tensor in ``bptt`` slices,
``for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt))``,
carrying the LSTM's hidden state from batch to batch. It is called once per
epoch by a module-level loop that evaluates, keeps ``best_val_loss`` and
divides the module global ``lr`` by 4 when the validation loss stops
improving. The corpus is made here from a fixed seed. It knows nothing of
jitckpt.

    python loop_epochs_own_batches.py --epochs 4 --save out.pt
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=2.0)
parser.add_argument("--bptt", type=int, default=7)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--save", default="out.pt")
args = parser.parse_args()

torch.manual_seed(1111)
ntokens = 40
corpus = torch.randint(0, ntokens, (900,), generator=torch.Generator().manual_seed(5))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


train_data = batchify(corpus[:700], args.batch_size)
val_data = batchify(corpus[700:], 2)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        return F.log_softmax(self.decoder(self.drop(output)), dim=-1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid))


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


model = RNNModel(ntokens, 16, 24)
criterion = nn.NLLLoss()
lr = args.lr
optimizer = torch.optim.SGD(model.parameters(), lr=lr)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(2)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output.view(-1, ntokens), targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        optimizer.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        total_loss += loss.item()
        print(
            f"| epoch {epoch:3d} | batch {batch:3d} | lr {lr:.4f} | loss {loss.item():.6f}",
            flush=True,
        )
    elapsed = time.time() - start_time
    return total_loss, elapsed


best_val_loss = None
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch:3d} | valid loss {val_loss:.6f} | ppl {math.exp(val_loss):.2f}")
    if not best_val_loss or val_loss < best_val_loss * 0.995:
        best_val_loss = val_loss
    else:
        lr /= 4.0

torch.save(
    {"model": model.state_dict(), "lr": torch.tensor(lr), "best": torch.tensor(best_val_loss)},
    args.save,
)
print(f"training done: lr {lr}, best {best_val_loss:.6f}", flush=True)
