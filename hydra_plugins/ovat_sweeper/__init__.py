"""``hydra/sweeper=ovat``: one-variable-at-a-time tuning, registered with Hydra (a thin shim; the
study runs in ``sweeps.ovat``, imported only when a sweep starts)."""
