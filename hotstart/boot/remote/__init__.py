"""Models in object storage: `hotstart serve s3://BUCKET/PREFIX` (or `NAME=s3://...`).

At t=0 the API process lists the prefix (one request), fetches config.json, the tokenizer and the
other sidecars (it needs them to go on), and starts daemon threads that download the weights in the
engine's load order into the local cache ($HOTSTART_HOME/s3/, snapshot.py) while the forkserver
imports torch; the engine's loader maps each file as it arrives and waits only for the bytes it needs
next (hotstart/model/arrival.py). A complete snapshot is served after the one listing; with the store
unreachable, the last complete snapshot is served with a warning. docs/remote.md has the design.
"""

from hotstart.boot.remote.url import RemoteSpec, is_remote, parse_remote

__all__ = ["RemoteSpec", "is_remote", "parse_remote"]
