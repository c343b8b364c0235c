"""Train a small transformer on one long sequence split across processes (ring attention).

    mlx.launch -n 2 --backend ring --python "$(which python)" examples/long_context_ring.py
    mlx.launch -n 2 --backend ring --python "$(which python)" examples/long_context_ring.py --quick

Every rank holds 1/n of the sequence (`mlx_flash.distributed.shard_sequence`, zigzag layout) and
the model's activations for it; attention over the whole sequence runs through
`mlx_flash.distributed.ring_attention`, which passes K/V (and, backward, dK/dV) around the ranks.
The attention layers are `mlx_flash.nn.GroupedQueryAttention` with RoPE at each token's *global*
position (a zigzag shard is two runs of positions, so RoPE is applied per run). Parameters are
replicated; their gradients are summed over the ranks (`mx.distributed.all_sum`).

It then trains the same model from the same weights on the same tokens in ONE process holding the
whole sequence (plain `flash_attention`, rank 0 while the others wait) and prints, side by side,
the loss of each step, the median time per step and the peak memory of each rank. Text: the
Python documentation that ships with CPython (`pydoc_data.topics`), as bytes.

About the memory column: ring_attention evaluates the ring step by step inside the call, so under
nn.value_and_grad the layers before each attention are evaluated while MLX traces the gradient, and
MLX keeps their intermediate arrays until the step ends (a lazy single-process step frees those it
does not need). Measured on one process, 2 layers, dims 128, 1024 tokens: evaluating the attention
inputs inside the forward raises the step's peak from 71 to 109 MiB. At small sizes this outweighs
the attention memory the ring saves; per rank the attention itself stays within its O(N_local) bound
(tests/test_distributed.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

import mlx_flash.nn
from mlx_flash.distributed import ring_attention, segments, shard_sequence


class Attention(mlx_flash.nn.GroupedQueryAttention):
    """GroupedQueryAttention that, given a ring, attends over the whole sharded sequence.

    ring = None: the layer as it is (the whole sequence in this process).
    ring = (group, layout): x is this rank's shard; RoPE uses global positions.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_ring(None)

    def set_ring(self, ring):
        object.__setattr__(self, "_ring", ring)  # not a module member: no parameters in it

    def __call__(self, x, mask=None, cache=None):
        if self._ring is None:
            return super().__call__(x, mask=mask, cache=cache)
        group, layout = self._ring
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        runs = segments(layout, group.rank(), group.size(), L)  # (local start, global start, length)
        q = mx.concatenate([self.rope(q[:, :, a:a + n], offset=g) for a, g, n in runs], axis=2)
        k = mx.concatenate([self.rope(k[:, :, a:a + n], offset=g) for a, g, n in runs], axis=2)
        out = ring_attention(q, k, v, scale=self.scale, mask="causal" if self.causal else None,
                             window_size=self.window_size, softcap=self.softcap, group=group, layout=layout,
                             backend=self.backend)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, dims, heads, kv_heads, backend):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dims)
        self.attention = Attention(dims, heads, kv_heads, causal=True, rope=True, backend=backend)
        self.mlp_norm = nn.RMSNorm(dims)
        self.up = nn.Linear(dims, 4 * dims, bias=False)
        self.down = nn.Linear(4 * dims, dims, bias=False)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.down(nn.gelu(self.up(self.mlp_norm(x))))


class Model(nn.Module):
    def __init__(self, layers, dims, heads, kv_heads, backend, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dims)
        self.blocks = [Block(dims, heads, kv_heads, backend) for _ in range(layers)]
        self.norm = nn.RMSNorm(dims)
        self.head = nn.Linear(dims, vocab, bias=False)

    def set_ring(self, ring):
        for block in self.blocks:
            block.attention.set_ring(ring)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def text_tokens(count: int, offset: int) -> np.ndarray:
    """`count` + 1 bytes of CPython's documentation, from `offset` (wrapping around)."""
    from pydoc_data.topics import topics
    data = np.frombuffer("\n".join(topics[k] for k in sorted(topics)).encode(), dtype=np.uint8)
    index = (offset + np.arange(count + 1)) % data.size
    return data[index].astype(np.int32)


def train(model, batches, steps, loss_fn, grad_transform, lr):
    """(losses, seconds per step, peak bytes) of `steps` AdamW steps; loss_fn(model, x, y) -> loss."""
    optimizer = optim.AdamW(learning_rate=lr)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    losses, times = [], []
    mx.synchronize()
    mx.reset_peak_memory()
    for step in range(steps):
        x, y = batches[step % len(batches)]
        start = time.perf_counter()
        loss, grads = value_and_grad(model, x, y)
        grads = grad_transform(grads)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times, mx.get_peak_memory()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the whole sequence")
    parser.add_argument("--dims", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--backend", default="auto", help="mlx-flash backend: auto, mlx, metal, cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 256 tokens, 3 steps (CI)")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.dims, args.layers, args.steps = 256, 64, 2, 3

    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    mx.random.seed(0)  # the same initial weights on every rank
    model = Model(args.layers, args.dims, args.heads, args.kv_heads, args.backend)
    mx.eval(model.parameters())
    initial = tree_map(lambda p: p, model.parameters())
    batches = [text_tokens(args.seq_len, offset=step * args.seq_len) for step in range(args.steps)]
    batches = [(mx.array(b[None, :-1]), mx.array(b[None, 1:])) for b in batches]
    say(f"{args.layers} layers, dims {args.dims}, heads {args.heads} (kv {args.kv_heads}), "
        f"{args.seq_len} tokens per sequence, {args.steps} steps, {n} ranks, layout {args.layout}")

    # -- the ring: every rank holds 1/n of the tokens ------------------------------------------
    model.set_ring((group, args.layout))
    shard = lambda t: shard_sequence(t, group=group, layout=args.layout, axis=1)  # noqa: E731
    local = [(shard(x), shard(y)) for x, y in batches]

    def ring_loss(model, x, y):  # this rank's tokens' share of the mean over all tokens
        return nn.losses.cross_entropy(model(x), y, reduction="sum") / args.seq_len

    def sum_over_ranks(tree):
        return tree_map(lambda g: mx.distributed.all_sum(g, group=group), tree)

    losses, times, peak = train(model, local, args.steps,
                                ring_loss, sum_over_ranks, args.lr)
    losses = [mx.distributed.all_sum(mx.array(l), group=group).item() for l in losses]
    stats = mx.distributed.all_gather(mx.array([[peak / 2**20, statistics.median(times[1:] or times)]]),
                                      group=group)
    mx.eval(stats)  # every rank takes part in the collective now

    # -- one process holding the whole sequence (rank 0; the others wait) ----------------------
    if rank == 0:
        model.set_ring(None)
        model.update(initial)

        def whole_loss(model, x, y):
            return nn.losses.cross_entropy(model(x), y, reduction="mean")

        base_losses, base_times, base_peak = train(model, batches, args.steps, whole_loss, lambda g: g, args.lr)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # barrier

    say(f"\n{'step':>4} | {'loss, ring over ' + str(n) + ' ranks':>26} | {'loss, one process':>18}")
    for step in range(args.steps):
        say(f"{step:>4} | {losses[step]:>26.4f} | {base_losses[step] if rank == 0 else 0:>18.4f}")
    if rank == 0:
        say(f"\n{'':<28} | {'median s/step':>13} | {'peak MiB':>9}")
        for r, (mib, seconds) in enumerate(stats.tolist()):
            say(f"{'ring over ' + str(n) + ' ranks, rank ' + str(r):<28} | {seconds:>13.3f} | {mib:>9.1f}")
        say(f"{'one process, whole sequence':<28} | {statistics.median(base_times[1:] or base_times):>13.3f} | "
            f"{base_peak / 2**20:>9.1f}")
        parameters = sum(p.size for _, p in tree_flatten(model.parameters()))
        say(f"({parameters / 1e6:.2f} M parameters; peak memory counts everything a rank holds: weights, "
            f"optimizer state, activations)")


if __name__ == "__main__":
    main()
