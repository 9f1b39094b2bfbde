"""Owns the model and the paged KV cache; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import torch

from hotstart.engine.sequence import Sequence
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import AttnMetadata


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.num_hidden_layers * cfg.kv_size * dtype.itemsize


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        cfg = model.cfg
        self.model, self.device, self.block_size = model, device, block_size
        # [layers, 2 (k/v), slots, KVH, D]; each layer's attention gets views into it. Block 0 is the
        # null block: zeroed, never handed out, read by padded key positions (masked, but must not be NaN).
        # The rest stays uninitialised: pages are touched only as blocks get used, so allocation is instant.
        self.kv_cache = torch.empty(
            cfg.num_hidden_layers, 2, (num_blocks + 1) * block_size, cfg.num_key_value_heads, cfg.head_dim,
            device=device, dtype=dtype,
        )
        self.kv_cache[:, :, :block_size].zero_()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.v_cache = self.kv_cache[i, 1]

    def _metadata(self, batch: list[tuple[Sequence, int]]):
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        starts, lens = [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            lens.append(n)
        b = len(batch)
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        tables = torch.tensor([seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in batch],
                              dtype=torch.long)  # [B, max_blocks]
        start_t = torch.tensor(starts, dtype=torch.long)  # [B]
        len_t = torch.tensor(lens, dtype=torch.long)  # [B]
        ctx_t = start_t + len_t  # [B] tokens in cache after this step
        q_max, l_max = int(len_t.max()), int(ctx_t.max())

        qi = torch.arange(q_max)  # [Qmax]
        q_valid = qi[None, :] < len_t[:, None]  # [B, Qmax]
        offsets = torch.cumsum(len_t, 0) - len_t  # [B] first flat index of each sequence
        q_index = torch.where(q_valid, offsets[:, None] + qi[None, :], 0)
        q_pos = start_t[:, None] + qi[None, :]  # [B, Qmax] position of each query

        seq_of_token = torch.repeat_interleave(torch.arange(b), len_t)  # [T]
        positions = q_pos[q_valid]  # [T]
        slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs

        kj = torch.arange(l_max)  # [Lmax]
        kv_index = tables[:, (kj // bs).clamp(max=max_blocks - 1)] * bs + kj % bs  # [B, Lmax]
        kv_index = torch.where(kj[None, :] < ctx_t[:, None], kv_index, 0)  # past the context: null block
        mask = (kj[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]  # [B, Qmax, Lmax]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend to one key instead of none (no NaN)
        meta = AttnMetadata(
            slot_mapping=slot_mapping.to(dev), q_index=q_index.to(dev), q_valid=q_valid.to(dev),
            kv_index=kv_index.to(dev), mask=mask[:, None].to(dev),
        )
        last = (offsets + len_t - 1).to(dev)  # [B] flat index of each sequence's last new token
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta, last

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]], want_logits: list[bool],
                all_logits: list[bool] | None = None) -> torch.Tensor | None:
        """Run one step; return float32 logits [N, V] for the sequences whose want_logits is True, then,
        for each sequence whose all_logits is True, the logits at every one of its new tokens ([n_i, V]
        each, in batch order; prompt logprobs)."""
        input_ids, positions, meta, last = self._metadata(batch)
        hidden = self.model(input_ids, positions, meta)
        rows = [i for i, w in enumerate(want_logits) if w]
        extra = _all_positions(batch, all_logits) if all_logits else []
        if not rows and not extra:
            return None
        index = last[rows]
        if extra:
            index = torch.cat([index, torch.tensor(extra, dtype=torch.long, device=self.device)])
        return self.model.compute_logits(hidden[index])

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: the K/V of block src into block dst, in every layer, for each (src, dst)."""
        bs = self.block_size
        offsets = torch.arange(bs)
        src = (torch.tensor([s for s, _ in pairs])[:, None] * bs + offsets).flatten().to(self.device)
        dst = (torch.tensor([d for _, d in pairs])[:, None] * bs + offsets).flatten().to(self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # kv_cache: [layers, 2, slots, KVH, D]


def _all_positions(batch: list[tuple[Sequence, int]], all_logits: list[bool]) -> list[int]:
    """Flat token indices of every new token of the batch entries flagged in ALL_LOGITS."""
    out: list[int] = []
    flat = 0
    for (_, n), wanted in zip(batch, all_logits, strict=True):
        if wanted:
            out.extend(range(flat, flat + n))
        flat += n
    return out
