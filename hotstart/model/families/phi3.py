"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer whose checkpoint ships q/k/v fused as `qkv_proj`
([(H + 2 * KVH) * D, hidden]) and gate/up as `gate_up_proj` ([2 * intermediate, hidden]). Each maps whole
into a FusedLinear (zero-copy on CPU); with tensor parallelism a rank takes its q, k, v (gate, up) row
ranges out of the fused tensor (model/parallel.py). LongRoPE and partial rotary (Phi-4-mini: 0.75) are
model/rope.py's; no biases; a `sliding_window` is served only where it masks nothing (hotstart/families.py).
"""

from __future__ import annotations

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer
from hotstart.model_config import ModelConfig


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__(cfg, fused=True)  # the checkpoint's own layout, on every device
        self.self_attn.qkv_proj.whole = True
        self.mlp.gate_up_proj.whole = True


class Phi3ForCausalLM(CausalLM):
    layer_class = Phi3DecoderLayer
