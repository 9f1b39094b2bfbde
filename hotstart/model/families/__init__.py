"""One module per model family, each built from the shared blocks of hotstart/model/layers.py and
imported only when a checkpoint of its family is loaded (hotstart/model/registry.py). What a family's
config.json means (biases, q/k norms, defaults, windows) is written in hotstart/families.py."""
