"""An EAGLE-3 drafter's serving-time forward on a CPU kernel, in few operations.

:class:`~triton_backend.speculation.drafters.eagle3_model.Eagle3Net` is the reference (training
runs it, and a drafter without a CPU kernel serves it). A draft step at one or a few rows is
short (~0.3 ms), so what it spends outside its products counts: this step runs the same math in
about half the operations:

- q, k and v are one product (their weights stacked), gate and up another;
- the rotary angles come from a table grown with the cache, not computed per call, and q and k
  are rotated in one expression (the halves swapped by one roll, the sign carried by the table);
- one row drafting a chain writes and reads its cache entries by slicing (no gather copy).

The products run on the compact-weight kernel in the precision ``runtime.drafter_weights`` names
(int8 by default, a quarter of float32's bytes; or the file's own 16-bit values) or on the
target's float32 row kernel. The values are the reference net's up to the weights' rounding and
the kernels' (draft quality only: exactness is the verifier's).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.nn import functional as F

from triton_backend.speculation.drafters.eagle3_model import Eagle3Net
from triton_backend.speculation.drafters.eagle_model import EagleKV, TreeStep


class Gemm(Protocol):
    n: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, k] float32 -> [M, n] float32
        ...


Bind = Callable[[torch.Tensor], Gemm]  # a float32 weight [n, k] -> a bound product on a kernel


class Eagle3Step:
    """The drafter's ``fc``, layer and head with its weights bound to a kernel (copies made here:
    later changes to the net's weights are not seen)."""

    def __init__(self, net: Eagle3Net, bind: Bind, name: str) -> None:
        info = net.info
        self.name = name  # the kernel the products run on (part of the drafter's cost identity)
        self.hidden, self.heads, self.kv_heads, self.head_dim = info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim
        self.eps = float(info.rms_norm_eps)
        layer, attn = net.midlayer, net.midlayer.self_attn

        def weight(*linears: torch.nn.Module) -> torch.Tensor:
            return torch.cat([lin.weight.detach().float() for lin in linears]).contiguous()

        self._fc = bind(weight(net.fc))
        self._qkv = bind(weight(attn.q_proj, attn.k_proj, attn.v_proj))
        self._o = bind(weight(attn.o_proj))
        self._gate_up = bind(weight(layer.mlp.gate_proj, layer.mlp.up_proj))
        self._down = bind(weight(layer.mlp.down_proj))
        self._head = bind(weight(net.lm_head))
        self._intermediate = int(layer.mlp.down_proj.weight.shape[1])
        norm = lambda m: m.weight.detach().float().clone()  # noqa: E731
        self._w_embed, self._w_hidden = norm(layer.input_layernorm), norm(layer.hidden_norm)
        self._w_post, self._w_final = norm(layer.post_attention_layernorm), norm(net.norm)
        self._inv_freq = attn.inv_freq.detach().float().clone()
        self._cos = self._sin = torch.empty(0, self.head_dim)

    def fc(self, features: torch.Tensor) -> torch.Tensor:  # [B, T, 3H] -> [B, T, H]
        lead = features.shape[:-1]
        return self._fc(features.reshape(-1, features.shape[-1]).float()).view(*lead, self.hidden)

    def logits(self, g: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, draft_vocab]
        return self._head(F.rms_norm(g.float(), (self.hidden,), self._w_final, self.eps))

    def _rope(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-carrying sin tables ``[>= end, head_dim]`` (grown by doubling): row ``p``
        is what the reference computes at position ``p``, value for value."""
        if self._cos.shape[0] < end:
            size = max(end, 2 * self._cos.shape[0], 256)
            angles = torch.arange(size, dtype=torch.float32)[:, None] * self._inv_freq
            emb = torch.cat((angles, angles), -1)
            half = self.head_dim // 2
            sin = emb.sin()
            self._cos, self._sin = emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), -1)
        return self._cos, self._sin

    def __call__(self, hidden: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                 tree: TreeStep | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Eagle3Net.forward`'s contract: ``hidden``/``embeds`` ``[B, T, H]`` at positions
        ``starts[b] + t`` (or placed by ``tree``), row ``b`` in cache row ``slots[b]``; returns ``g`` ``[B, T, H]``."""
        b, t, h = hidden.shape
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        x = torch.cat((F.rms_norm(embeds.float(), (h,), self._w_embed, self.eps),
                       F.rms_norm(hidden.float(), (h,), self._w_hidden, self.eps)), -1).view(b * t, 2 * h)
        alone = tree is None and b == 1  # one row's chain: its entries are one slice of its cache row
        if tree is None:
            start = int(starts[0]) if alone else 0
            end = (start if alone else int(starts.max())) + t
            positions = index = None if alone else starts[:, None] + torch.arange(t)
            visible = None
        else:
            positions, index, end, visible = tree.positions, tree.index, tree.end, tree.visible
        y = self._qkv(x)  # [B*T, (heads + 2 kv_heads) * d]
        qk_width = (heads + kv_heads) * d
        cos, sin = self._rope(end)
        if alone:
            c, s = cos[start:start + t, None], sin[start:start + t, None]  # [T, 1, d]
        else:
            c, s = cos[positions].view(b * t, 1, d), sin[positions].view(b * t, 1, d)
        qk = y[:, :qk_width].view(b * t, heads + kv_heads, d)
        qk = qk * c + torch.roll(qk, d // 2, -1) * s
        q = qk[:, :heads].view(b, t, heads, d).transpose(1, 2)  # [B, heads, T, d]
        k = qk[:, heads:].view(b, t, kv_heads, d)
        v = y[:, qk_width:].view(b, t, kv_heads, d)
        kv.reserve(end)
        if alone:
            row = 0 if slots is None else int(slots[0])
            kv.k[row, :, start:end] = k[0].transpose(0, 1)
            kv.v[row, :, start:end] = v[0].transpose(0, 1)
            keys, values = kv.k[row:row + 1, :, :end], kv.v[row:row + 1, :, :end]
            mask = None if t == 1 else torch.ones(t, end, dtype=torch.bool).tril_(start)[None, None]
        else:
            slots = torch.arange(b) if slots is None else slots
            kv.k[slots[:, None], :, index] = k  # each row at its own entries
            kv.v[slots[:, None], :, index] = v
            keys, values = kv.k[slots, :, :end], kv.v[slots, :, :end]
            if visible is None:
                visible = torch.arange(end)[None, None, :] <= positions[..., None]
            mask = visible[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
        x = hidden.reshape(b * t, h).float() + self._o(out.transpose(1, 2).reshape(b * t, heads * d))
        gate_up = self._gate_up(F.rms_norm(x, (h,), self._w_post, self.eps))
        inner = self._intermediate
        x = x + self._down(F.silu(gate_up[:, :inner]) * gate_up[:, inner:])
        return x.view(b, t, h)


__all__ = ["Eagle3Step"]
