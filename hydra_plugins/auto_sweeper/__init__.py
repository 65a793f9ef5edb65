"""``hydra/sweeper=auto``: the automatic layout search, registered with Hydra (a thin shim; the
study runs in ``sweeps.auto_study``, imported only when a sweep starts)."""
