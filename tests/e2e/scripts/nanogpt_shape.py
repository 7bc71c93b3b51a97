"""A character-level GPT trained the way nanoGPT's ``train.py`` trains one (written for
these tests, in its shape).

The loop most LLM pre-training code is copied from: configuration as module
globals overridden by ``--key=value`` arguments, a ``while True`` loop at
module level over globals (``iter_num``, ``best_val_loss``, the prefetched
batch ``X, Y``), batches drawn by ``get_batch()`` from torch's global
generator (no DataLoader), ``get_lr(iter_num)`` setting the learning rate by
hand, gradient accumulation with ``require_backward_grad_sync``, autocast and
a ``GradScaler``, an evaluation every ``eval_interval`` iterations on the
master process and its own ``ckpt.pt`` written there. Its configurator reads a
config file as nanoGPT's does (``with open(config_file) as f: print(f.read())``,
then ``exec(open(config_file).read())``), and the vocabulary size comes from
the data set's ``meta.pkl`` (``with open(meta_path, 'rb') as f:``): both leave a
closed file ``f`` among the module's globals. The data set and the config file
are made here, from a fixed seed, as a ``uint16`` memmap like nanoGPT's
prepared ``train.bin`` and a file like its ``config/train_shakespeare_char.py``.
It knows nothing of jitckpt.

    torchrun --nnodes 2 ... nanogpt_shape.py [config/train_chars.py] --max_iters=30
"""

import math
import os
import pickle
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -- configuration (nanoGPT's names) -------------------------------------------------------
out_dir = "out"
eval_interval = 10
log_interval = 1
eval_iters = 4
always_save_checkpoint = True
dataset = "chars"
gradient_accumulation_steps = 4
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
bias = False
learning_rate = 6e-3
max_iters = 30
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 5
lr_decay_iters = 30
min_lr = 6e-4
backend = "gloo"
device = "cpu"
dtype = "float16"
# -- the configurator: a config file, then --key=value overrides of a global of its type -----
config_keys = [
    k
    for k, v in globals().items()
    if not k.startswith("_") and isinstance(v, (int, float, bool, str))
]
config_file = os.path.join("config", "train_chars.py")
if not os.path.exists(config_file):  # the repository's config file, written here once
    os.makedirs("config", exist_ok=True)
    with open(f"{config_file}.tmp-{os.getpid()}", "w") as f:
        f.write("# a tiny character-level model\neval_interval = 10\nmax_iters = 30\n")
    os.replace(f"{config_file}.tmp-{os.getpid()}", config_file)
for arg in sys.argv[1:]:
    if "=" not in arg:
        config_file = arg
print(f"Overriding config with {config_file}:")
with open(config_file) as f:
    print(f.read())
exec(open(config_file).read())  # noqa: SIM115 (nanoGPT's configurator, as written)
for arg in sys.argv[1:]:
    if "=" not in arg:
        continue
    key, value = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    kind = type(globals()[key])
    globals()[key] = (value.lower() == "true") if kind is bool else kind(value)
config = {k: globals()[k] for k in config_keys}


# -- the model -------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        drop = dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# -- distributed set-up ------------------------------------------------------------------
ddp = int(os.environ.get("RANK", "-1")) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = (
    nullcontext()
    if dtype == "float32"
    else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
)

# -- the data: a memmap of uint16 tokens, made once from a fixed seed -------------------
data_dir = os.path.join("data", dataset)
meta_path = os.path.join(data_dir, "meta.pkl")
if not os.path.exists(meta_path):
    os.makedirs(data_dir, exist_ok=True)
    tokens = np.random.RandomState(7).randint(0, 65, size=6000).astype(np.uint16)
    for split, part in (("train", tokens[:5000]), ("val", tokens[5000:])):
        partial = os.path.join(data_dir, f"{split}.bin.tmp-{os.getpid()}")
        part.tofile(partial)
        os.replace(partial, os.path.join(data_dir, f"{split}.bin"))
    with open(f"{meta_path}.tmp-{os.getpid()}", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    os.replace(f"{meta_path}.tmp-{os.getpid()}", meta_path)
meta_vocab_size = None
if os.path.exists(meta_path):
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    meta_vocab_size = meta["vocab_size"]
    print(f"found vocab_size = {meta_vocab_size} (inside {meta_path})")
vocab_size = meta_vocab_size if meta_vocab_size is not None else 50304


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(
    n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size
)
model = GPT(vocab_size).to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if ddp:
    model = DDP(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# -- training ----------------------------------------------------------------------------
X, Y = get_batch("train")
t0 = time.time()
local_iter_num = 0
raw_model = model.module if ddp else model
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "model_args": model_args,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "config": config,
                }
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
    iter_num += 1
    local_iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
