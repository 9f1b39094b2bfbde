"""The warm forkserver: both ends of it.

server.py runs in its own process (`python -m hotstart.forkserver FD`), started by the API process at
t=0: it imports torch and the engine once, then forks engine processes (one per tensor-parallel rank)
on request, and reports their pids and exits. client.py is the API process's side (torch-free): it
starts the server, sends it typed messages (hotstart.messages, framed by hotstart.framing) and turns
what comes back into typed events. zygote.py is the same server outliving its clients (`hotstart
zygote start`): runtime.py finds and vets it, control.py runs the `hotstart zygote` commands, checks.py
and keep.py are what it checks and keeps resident. See docs/design.md.
"""
