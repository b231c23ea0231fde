"""A stand-in for SGLang's `python -m sglang.launch_server` (tests only; see
launch_server.py). Put its parent folder on PYTHONPATH."""
