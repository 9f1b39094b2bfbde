"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the top-k of E SiLU-gated expert
MLPs for each token; Qwen2-MoE adds a shared expert behind a sigmoid gate. Names and config facts come
from hotstart/families.py (Family.moe); layers outside cfg.moe_layers keep the dense MLP.

Experts are computed grouped: the T * k (token, expert) pairs are sorted by expert, and each expert that
received tokens runs one matmul over its contiguous rows; experts without tokens cost nothing. Each
expert's weights are separate checkpoint tensors, so on CPU they stay zero-copy views of the file (no
stacked [E, ...] copy: torch._grouped_mm would need one, and in torch 2.13 CPU it refuses bf16 anyway).
They are ordinary Linear modules, so the oneDNN packing of the fast path (engine/fastpath.py) covers
them like any other linear layer.

Tensor parallel: every expert (and the shared one) is split Megatron-style, gate/up by output rows and
down by input columns; the router and the shared-expert gate are replicated (each rank routes the same
way). The partial sums of all experts are combined first, then one all-reduce per MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotstart import families
from hotstart.model.attention import AttnMetadata
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer, FusedLinear, Linear, PackedGroup
from hotstart.model_config import ModelConfig


class Expert(nn.Module):
    """down(silu(gate(x)) * up(x)) under the checkpoint's names (gate/up fused into one matmul on GPUs)."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str], fused: bool):
        super().__init__()
        gate, up, down = names
        self.names, self.fused = names, fused
        if fused:  # the loader fills the shards from the sibling tensors <gate> and <up>
            self.gate_up = FusedLinear(hidden, {gate: inter, up: inter}, bias=False)
        else:
            setattr(self, gate, Linear(hidden, inter, bias=False))
            setattr(self, up, Linear(hidden, inter, bias=False))
        setattr(self, down, Linear(inter, hidden, bias=False))
        self.packed_gate_up: PackedGroup | None = None  # gate/up prepacked as one (fast path), unfused only

    def pack_groups(self) -> dict[str, list[Linear]]:
        gate, up, _ = self.names
        return {} if self.fused else {"packed_gate_up": [getattr(self, gate), getattr(self, up)]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, hidden] -> [N, hidden] (tensor parallel: this rank's partial sum)
        gate, up, down = self.names
        if self.fused:
            g, u = self.gate_up.forward_split(x)
        elif self.packed_gate_up is not None:
            g, u = self.packed_gate_up(x)
        else:
            g, u = getattr(self, gate)(x), getattr(self, up)(x)
        return getattr(self, down)(F.silu(g) * u)

    def shard(self, tp) -> None:
        """Rank tp.rank's share: rows of gate/up, the matching columns of down (no all-reduce here)."""
        from hotstart.model.parallel import Split, _column  # noqa: PLC0415 - parallel imports layers only

        gate, up, down = self.names
        if self.fused:
            self.gate_up.take_rank_rows(tp.rank, tp.world_size)
        else:
            _column(getattr(self, gate), tp)
            _column(getattr(self, up), tp)
        d = getattr(self, down)
        cols = d.weight.shape[1]
        d.splits = {"weight": Split(1, tp.rank * cols, cols, cols * tp.world_size)}


class SparseMoE(nn.Module):
    """The routed experts (and Qwen2-MoE's shared one) of one layer. Parameter names: gate.weight (the
    router, [E, hidden]), experts.N.<gate|up|down>.weight, shared_expert.*, shared_expert_gate.weight."""

    def __init__(self, cfg: ModelConfig, fused: bool, moe: families.Moe):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        names = (moe.gate, moe.up, moe.down)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size, names, fused)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                        ("gate_proj", "up_proj", "down_proj"), fused)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.tp = None  # parallel.TensorParallel once sharded

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> weights [T, k] (x's dtype), expert ids [T, k]: softmax in float32 over all
        experts, top-k, renormalised where the family says (Mixtral always, Qwen: norm_topk_prob)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights, ids = self.route(x)
        flat = ids.flatten()  # [T * k]: pair j is token j // k
        order = torch.argsort(flat, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one sync per layer
        tokens = order // self.top_k  # [T * k]: the token of each sorted pair
        rows = x[tokens]  # [T * k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:  # one matmul per active expert over its contiguous rows
                out[start:start + n] = expert(rows[start:start + n])
                start += n
        out *= weights.flatten()[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_add_(0, tokens, out)  # [T, hidden]: each token's k experts summed
        if self.shared_expert is not None:
            # the gate reads the (replicated) input: scaling a rank's partial sum by it is exact
            y += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp is not None:
            self.tp.all_reduce(y)  # one all-reduce for the whole layer
        return y

    def shard(self, tp) -> None:
        self.tp = tp
        for e in [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]:
            e.shard(tp)


class MoEDecoderLayer(DecoderLayer):
    """The pre-norm layer with a mixture of experts in place of the MLP (layers in cfg.moe_layers), under
    the checkpoint's name (`mlp`, Mixtral: `block_sparse_moe`); other layers keep the dense MLP."""

    def __init__(self, cfg: ModelConfig, fused: bool, index: int, moe: families.Moe):
        super().__init__(cfg, fused)
        self.ffn_name = "mlp"
        if index in cfg.moe_layers:
            del self.mlp
            setattr(self, moe.block, SparseMoE(cfg, fused, moe))
            self.ffn_name = moe.block

    def ffn(self) -> nn.Module:
        """The MLP: dense (layers.GatedMLP) or SparseMoE (parallel.shard reads it)."""
        return getattr(self, self.ffn_name)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # o: [T, H * D], x: [T, hidden] -> the next layer's input
        x = x + self.self_attn.o_proj(o)
        return x + self.ffn()(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        q, k, v = self.attn_inputs(x, meta)
        return self.finish(self.self_attn.attend(q, k, v, meta), x)


class _NoLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__()


class MoECausalLM(CausalLM):
    """A family with experts: its layers need their index (cfg.moe_layers), which the shared Backbone does
    not pass, so they are built here, once, in place of empty placeholders."""

    layer_class = _NoLayer

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, fused: bool = True):
        super().__init__(cfg, max_positions, fused)
        moe = families.by_name(cfg.family).moe
        self.model.layers = nn.ModuleList(MoEDecoderLayer(cfg, fused, i, moe)
                                          for i in range(cfg.num_hidden_layers))
        self.model.set_windows(cfg)
