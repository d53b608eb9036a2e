"""Code that users write (reward functions, tools, environments, agents): loading it from a file (loader.py), and
running it in worker processes that may hang or crash without touching the generator (pool.py, pool_worker.py).
"""
