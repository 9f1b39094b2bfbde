"""The compiled forward: AOTInductor layer graphs per token bucket, attention eager in between.

A step of T tokens runs on the smallest loaded bucket >= T: activations are padded to the bucket's
size, the padded rows never reach the KV cache or attention (both see the first T rows only), and are
dropped at the end. Packages are loaded with torch's C++ loader (torch._C._aoti): no inductor import
in the engine, ~3 ms per package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotstart.model import graphs
from hotstart.model.attention import AttnMetadata
from hotstart.model.decoder import CausalLM


class CompiledForward:
    def __init__(self, model: CausalLM, spec: graphs.LayerSpec):
        self.model, self.spec = model, spec
        self.loaders: dict[int, object] = {}  # bucket (tokens) -> AOTIModelPackageLoader
        self.steps: dict[int, int] = {}  # bucket -> steps it ran
        layers = model.model.layers
        post = [graphs.layer_inputs(layer, spec.post_names()) for layer in layers]
        pre = [graphs.layer_inputs(layer, spec.pre_names()) for layer in layers]
        self.first_pre = pre[0]
        self.last_post = post[-1]
        self.mid_weights = [
            post[i] + pre[i + 1] for i in range(len(layers) - 1)
        ]  # graph inputs after activations

    def load(self, tokens: int, path: str) -> None:
        """Load the package for TOKENS; from the next step on, steps of <= TOKENS tokens may use it."""
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        self.loaders[tokens] = loader
        self.steps.setdefault(tokens, 0)

    def bucket_for(self, tokens: int) -> int | None:
        fits = [b for b in self.loaders if b >= tokens]
        return min(fits) if fits else None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, bucket: int
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden], as CausalLM.forward
        spec, backbone, run = self.spec, self.model.model, self.loaders[bucket].run
        t, pad = input_ids.shape[0], bucket - input_ids.shape[0]
        cos, sin = backbone.rotary.lookup(positions)  # [T, 1, D]
        cos_p, sin_p = F.pad(cos, (0, 0, 0, 0, 0, pad)), F.pad(sin, (0, 0, 0, 0, 0, pad))
        x = F.pad(backbone.embed_tokens(input_ids), (0, 0, 0, pad))  # [bucket, hidden]
        q, k, v = graphs.pre(spec, x, cos_p, sin_p, self.first_pre)
        last = len(backbone.layers) - 1
        for i, layer in enumerate(backbone.layers):
            attn = layer.self_attn.attend(q[:t], k[:t], v[:t], meta)  # [T, H, D]
            attn = F.pad(attn.reshape(t, -1), (0, 0, 0, pad))
            if i < last:
                x, q, k, v = run([attn, x, cos_p, sin_p, *self.mid_weights[i]])
            else:
                x = graphs.post(spec, attn, x, self.last_post)
        self.steps[bucket] += 1
        return backbone.norm(x[:t])
