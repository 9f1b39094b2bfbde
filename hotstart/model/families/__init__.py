"""The families whose decoder layer differs from the shared one (Gemma 2 / 3, OLMo 2, Phi-3's fused
checkpoint), one module each, built from the blocks of hotstart/model/layers.py and imported only when a
checkpoint of its family is loaded (hotstart/model/registry.py). The others are the shared CausalLM
(model/decoder.py, model/moe.py) as their Family in hotstart/families.py configures it."""
