"""``hydra/launcher=ray``: the orchestrator's Ray launcher, registered with Hydra (a thin shim;
the work is in ``orchestrator.ray_sweep``, imported only when a sweep launches)."""
