"""Load clients: ``sloserve bench-serve`` replays a trace or workload against any OpenAI-compatible
server (client.py) and summarizes it as the simulator does."""
