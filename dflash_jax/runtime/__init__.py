"""What every command shares, below everything else (design §17): processes and `jax.distributed`
(distributed.py), stop requests (stop.py), the workdir's lock and files (workdir.py), storage paths (paths.py)
and the user's errors (errors.py)."""
