"""Torch-free startup machinery: model resolution, prefetch, pre-spawn, timeline."""
