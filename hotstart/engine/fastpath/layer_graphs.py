"""Layer graphs: the model's own decoder layer, exported around its paged attention and compiled by
AOTInductor per token bucket (compile_worker.py); and the forward that runs them (LayerGraphForward).

The compiled unit is `mid`: layer i's `finish` (o_proj, residual, MLP) followed by layer i+1's
`attn_inputs` (norm, q/k/v, q/k norm, RoPE): the methods of the family's DecoderLayer itself
(model/layers.py), called through torch.func.functional_call with the layers' parameters as graph
inputs. So there is no second copy of the math, the graph holds no weights, and one graph per bucket
serves every layer pair and every checkpoint of the same shapes. Attention stays eager (paged, any
context). Linear layers run F.linear on the plain [out, in] weights: `--compile auto` builds layer
graphs only where the oneDNN-prepacked weights do not fit in memory (docs/serving.md).

A step of T tokens runs on the smallest loaded bucket >= T: activations are padded to the bucket's
size, the padded rows never reach the KV cache or attention (both see the first T rows only), and are
dropped at the end. Packages are loaded with torch's C++ loader (torch._C._aoti): no inductor import in
the engine, ~3 ms per package.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hotstart.model.attention import AttnMetadata
from hotstart.model.decoder import CausalLM


def layer_inputs(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a layer graph takes for LAYER, in named_parameters() order (the same order for
    every layer of one class: the graph's input order)."""
    return [p for _, p in layer.named_parameters()]


class _Method(nn.Module):
    """Calls one method of LAYER as forward (functional_call runs a module's forward)."""

    def __init__(self, layer: nn.Module, method: str):
        super().__init__()
        self.layer, self.method = layer, method

    def forward(self, *args):
        return getattr(self.layer, self.method)(*args)


class MidGraph(nn.Module):
    """finish(layer i) then attn_inputs(layer i+1) of LAYER's class; the weights of both are inputs.
    LAYER is a template, kept out of this module's parameters (the export lifts none: the graph holds
    no weights) and never read itself (functional_call swaps the inputs in for its parameters)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.template = [layer]  # a list: not a registered submodule
        self.names = [f"layer.{n}" for n, _ in layer.named_parameters()]

    def forward(self, attn, x, cos, sin, *weights):
        # attn: [T, H * D], x: [T, hidden], cos, sin: [T, 1, D]; weights: layer i's, then layer i+1's
        # -> x: [T, hidden] (layer i+1's input), q: [T, H, D], k, v: [T, KVH, D]
        layer, n = self.template[0], len(self.names)
        post = dict(zip(self.names, weights[:n], strict=True))  # layer i's parameters, by name
        pre = dict(zip(self.names, weights[n:], strict=True))  # layer i+1's
        x = functional_call(_Method(layer, "finish"), post, (attn, x))
        rope = SimpleNamespace(cos=cos, sin=sin)  # attn_inputs reads only meta.cos / meta.sin
        q, k, v = functional_call(_Method(layer, "attn_inputs"), pre, (x, rope))
        return x, q, k, v


def example_inputs(graph: MidGraph, tokens: int, q_size: int, head_dim: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random inputs of GRAPH for TOKENS tokens (the shapes matter, not the values)."""
    g = torch.Generator().manual_seed(0)
    layer = graph.template[0]
    hidden = layer.post_attention_layernorm.weight.shape[0]
    shapes = [p.shape for _, p in layer.named_parameters()] * 2
    weights = [(torch.randn(*s, generator=g) * 0.02).to(dtype) for s in shapes]
    act = [torch.randn(*s, generator=g).to(dtype)
           for s in ((tokens, q_size), (tokens, hidden), (tokens, 1, head_dim), (tokens, 1, head_dim))]
    return (*act, *weights)


class LayerGraphForward:
    """CausalLM.forward with the compiled layer graphs between the eager attentions."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.loaders: dict[int, object] = {}  # bucket (tokens) -> AOTIModelPackageLoader
        self.steps: dict[int, int] = {}  # bucket -> steps it ran
        layers = model.model.layers
        weights = [layer_inputs(layer) for layer in layers]
        self.mid_inputs = [weights[i] + weights[i + 1] for i in range(len(layers) - 1)]

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
        backbone, run = self.model.model, self.loaders[bucket].run
        layers = backbone.layers
        t, pad = input_ids.shape[0], bucket - input_ids.shape[0]
        cos, sin = backbone.rotary.lookup(positions)  # [T, 1, D]
        cos_p, sin_p = F.pad(cos, (0, 0, 0, 0, 0, pad)), F.pad(sin, (0, 0, 0, 0, 0, pad))  # [bucket, 1, D]
        x = F.pad(backbone.embed_tokens(input_ids), (0, 0, 0, pad))  # [bucket, hidden]
        q, k, v = layers[0].attn_inputs(x, SimpleNamespace(cos=cos_p, sin=sin_p))  # eager: first layer
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attend(q[:t], k[:t], v[:t], meta)  # [T, H * D]
            attn = F.pad(attn.reshape(t, -1), (0, 0, 0, pad))  # [bucket, H * D]
            if i < last:
                x, q, k, v = run([attn, x, cos_p, sin_p, *self.mid_inputs[i]])
            else:
                x = layer.finish(attn, x)  # eager: the last layer
        self.steps[bucket] += 1
        return backbone.norm(x[:t])
