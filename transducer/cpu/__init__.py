"""The CPU backend: the stages of transducer/backend.py's contract in torch (stages.py)."""
