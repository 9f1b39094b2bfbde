"""Owns the model and the paged KV cache; turns a scheduled batch into one forward pass.

A step's inputs are plain lists (StepInputs): with tensor parallelism rank 0's executor sends them to the
other ranks (engine/executor.py), and every rank builds the same metadata from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotstart.engine.sequence import Sequence
from hotstart.model.attention import AttnMetadata, DecodeGroup, PrefillGroup, chunk_rows, pad_tables
from hotstart.model.decoder import CausalLM


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    cfg = model.cfg  # one rank's share of the KV heads under tensor parallelism
    return 2 * cfg.num_hidden_layers * cfg.kv_size * dtype.itemsize


@dataclass
class StepInputs:
    """What one forward needs, per batch entry (in batch order)."""

    token_ids: list[int]  # [T] the new tokens of every entry, flattened
    starts: list[int]  # [B] tokens already computed (the first new token's position)
    lens: list[int]  # [B] new tokens
    tables: list[list[int]]  # [B] KV block tables
    want_logits: list[bool]  # [B] logits at the entry's last token
    all_logits: list[bool] | None = None  # [B] logits at every new token (prompt logprobs)

    @classmethod
    def of(cls, batch: list[tuple[Sequence, int]], want_logits: list[bool],
           all_logits: list[bool] | None = None) -> StepInputs:
        ids: list[int] = []
        for seq, n in batch:
            tokens = seq.token_ids + seq.draft if seq.draft else seq.token_ids  # speculative: last + draft
            ids += tokens[seq.num_computed_tokens:seq.num_computed_tokens + n]
        return cls(ids, [seq.num_computed_tokens for seq, _ in batch], [n for _, n in batch],
                   [seq.block_table for seq, _ in batch], want_logits, all_logits)


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ):
        cfg = model.cfg
        self.model, self.device, self.block_size = model, device, block_size
        # [layers, 2 (k/v), KVH, slots, D]: head-major, so one index_select over whole blocks gathers a
        # step's keys already laid out for the batched matmuls (model/attention.py). Block 0 is the
        # null block: zeroed, never handed out, read by padded key positions (masked, but must not be NaN:
        # 0 x NaN is NaN). The rest is zeroed block by block before its first use (the unwritten tail of a
        # sequence's last block is read the same way), so allocation is instant and pages are touched only
        # as blocks get used.
        self.kv_cache = torch.empty(
            cfg.num_hidden_layers, 2, cfg.num_key_value_heads, (num_blocks + 1) * block_size, cfg.head_dim,
            device=device, dtype=dtype,
        )
        self.kv_cache[:, :, :, :block_size].zero_()
        self._zeroed = 1  # blocks below this are zeroed (or hold K/V written since)
        self.chunk_rows = chunk_rows(cfg.num_key_value_heads, cfg.head_dim)  # decode attention chunks
        self.compiled = None  # engine/compiled.py CompiledForward, installed between steps by the fast path
        self.eager_steps = 0
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.v_cache = self.kv_cache[i, 1]

    def _metadata(self, s: StepInputs):
        """(input ids [T], positions [T], AttnMetadata, flat index of each entry's last token [B]),
        from Python lists turned into tensors once: no per-token tensor work."""
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        dec: list[int] = []  # batch entries with one new token
        pre: list[int] = []  # batch entries with several
        flat = 0
        for i, (start, n, table) in enumerate(zip(s.starts, s.lens, s.tables)):
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            flat += n
            last.append(flat - 1)
            (dec if n == 1 else pre).append(i)
        offsets = [lst - n + 1 for lst, n in zip(last, s.lens)]  # first flat index of each entry
        all_ = len(dec) == len(s.lens) or len(pre) == len(s.lens)
        meta = AttnMetadata(
            slot_mapping=self._tensor(slots), block_size=bs,
            decode=self._decode_group(s, dec, last, all_) if dec else None,
            prefill=self._prefill_group(s, pre, offsets, all_) if pre else None,
        )
        return self._tensor(s.token_ids), self._tensor(positions), meta, self._tensor(last)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _tables(self, tables: list[list[int]], context: list[int]) -> torch.Tensor:
        # [B, nb] block tables padded with the null block 0 to the longest context of the group
        nb = -(-max(context) // self.block_size)
        return self._tensor(pad_tables(tables, nb))

    def _decode_group(
        self, s: StepInputs, entries: list[int], last: list[int], everything: bool
    ) -> DecodeGroup:
        # sorted longest first, cut into chunks, narrowed per sliding window (model/attention.py)
        return DecodeGroup.build([s.tables[i] for i in entries], [s.starts[i] + 1 for i in entries],
                                 None if everything else [last[i] for i in entries], self.block_size,
                                 self.device, self.chunk_rows)

    def _prefill_group(
        self, s: StepInputs, entries: list[int], offsets: list[int], everything: bool
    ) -> PrefillGroup:
        lens = [s.lens[i] for i in entries]
        starts = [s.starts[i] for i in entries]
        context = [st + n for st, n in zip(starts, lens)]
        tables = self._tables([s.tables[i] for i in entries], context)
        q_max, l_max = max(lens), tables.shape[1] * self.block_size
        group_first = torch.tensor([0] + lens[:-1]).cumsum(0)  # [Bp] first index of each in the group
        qi = torch.arange(q_max)
        len_t = torch.tensor(lens)
        q_valid = qi[None, :] < len_t[:, None]  # [Bp, Qmax]
        q_index = torch.where(q_valid, group_first[:, None] + qi[None, :], 0)
        q_pos = torch.tensor(starts)[:, None] + qi[None, :]  # [Bp, Qmax] position of each query
        mask = (torch.arange(l_max)[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend to one key instead of none (no NaN)
        tokens = None
        if not everything:
            tokens = self._tensor([offsets[i] + j for i, n in zip(entries, lens) for j in range(n)])
        dev = self.device
        spans = None  # for the CPU prefill kernel: each sequence's first token, tokens, first position
        if dev.type == "cpu":
            spans = torch.stack([group_first, len_t, torch.tensor(starts)], 1)
        return PrefillGroup(tokens, q_index.to(dev), q_valid.to(dev), tables, mask[:, None].to(dev),
                            q_pos=q_pos.to(dev), spans=spans, from_zero=not any(starts))  # windows: .window

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]], want_logits: list[bool],
                all_logits: list[bool] | None = None) -> torch.Tensor | None:
        """Run one step; return float32 logits [N, V] for the sequences whose want_logits is True, then,
        for each sequence whose all_logits is True, the logits at every one of its new tokens ([n_i, V]
        each, in batch order; prompt logprobs)."""
        return self.run(StepInputs.of(batch, want_logits, all_logits))

    @torch.inference_mode()
    def run(self, s: StepInputs) -> torch.Tensor | None:
        """forward() on plain inputs (tensor parallel ranks > 0 get them from rank 0; their logits: None)."""
        want_logits, all_logits = s.want_logits, s.all_logits
        self._zero_up_to(max((max(t) for t in s.tables if t), default=0))
        input_ids, positions, meta, last = self._metadata(s)
        bucket = self.compiled.bucket_for(len(input_ids)) if self.compiled is not None else None
        if bucket is not None:
            hidden = self.compiled.forward(input_ids, positions, meta, bucket)
        else:
            hidden = self.model(input_ids, positions, meta)
            self.eager_steps += 1
        rows = [i for i, w in enumerate(want_logits) if w]
        extra = _all_positions(s.lens, all_logits) if all_logits else []
        if not rows and not extra:
            return None
        index = last[rows]
        if extra:
            index = torch.cat([index, torch.tensor(extra, dtype=torch.long, device=self.device)])
        return self.model.compute_logits(hidden[index])

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: the K/V of block src into block dst, in every layer, for each (src, dst)."""
        self._zero_up_to(max(max(pair) for pair in pairs))
        bs = self.block_size
        offsets = torch.arange(bs)
        src = (torch.tensor([s for s, _ in pairs])[:, None] * bs + offsets).flatten().to(self.device)
        dst = (torch.tensor([d for _, d in pairs])[:, None] * bs + offsets).flatten().to(self.device)
        self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]  # kv_cache: [layers, 2, KVH, slots, D]

    @torch.inference_mode()
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A host copy of BLOCKS' K/V: [n, layers, 2, KVH, block size, D] (the prefix cache on disk)."""
        bs = self.block_size
        slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
        kv = self.kv_cache.index_select(3, slots)  # [layers, 2, KVH, n * bs, D]
        kv = kv.view(*kv.shape[:3], len(blocks), bs, kv.shape[-1]).permute(3, 0, 1, 2, 4, 5)
        return kv.contiguous().cpu()

    @torch.inference_mode()
    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write DATA [n, layers, 2, KVH, block size, D] (read_blocks' layout) into BLOCKS."""
        self._zero_up_to(max(blocks))
        bs = self.block_size
        if self.device.type == "cpu":  # straight from DATA, one copy per run of consecutive blocks (a
            i = 0  # preload's or a restore's fresh blocks come in order: one op, not one per block)
            while i < len(blocks):
                j = i + 1
                while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                    j += 1
                b = blocks[i]
                run = data[i:j].permute(1, 2, 3, 0, 4, 5)  # [layers, 2, KVH, n, bs, D]
                self.kv_cache[:, :, :, b * bs:(b + j - i) * bs].unflatten(3, (j - i, bs)).copy_(run)
                i = j
            return
        slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
        kv = data.to(self.device, self.kv_cache.dtype).permute(1, 2, 3, 0, 4, 5)
        self.kv_cache.index_copy_(3, slots, kv.reshape(*kv.shape[:3], -1, kv.shape[-1]))

    def _zero_up_to(self, block: int) -> None:
        """Zero the blocks up to BLOCK never used before (uninitialised memory may hold NaN bit patterns;
        the block manager hands never-used blocks out in increasing order)."""
        if block >= self._zeroed:
            bs = self.block_size
            self.kv_cache[:, :, :, self._zeroed * bs:(block + 1) * bs].zero_()
            self._zeroed = block + 1


def _all_positions(lens: list[int], all_logits: list[bool]) -> list[int]:
    """Flat token indices of every new token of the batch entries flagged in ALL_LOGITS."""
    out: list[int] = []
    flat = 0
    for n, wanted in zip(lens, all_logits, strict=True):
        if wanted:
            out.extend(range(flat, flat + n))
        flat += n
    return out
