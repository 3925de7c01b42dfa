"""Serving and online distillation: the OpenAI-compatible server (server.py), the online learner (online.py) and
the crash-safe traffic log they share (traffic.py). The top of the import graph: nothing in models/, data/,
train/ or eval/ imports this package."""
