"""``hydra/launcher=ray_trials`` (and ``ray`` where Hydra's own Ray launcher is not installed):
the orchestrator's Ray launcher, registered with Hydra (a thin shim; the work is in
``orchestrator.ray_sweep``, imported only when a sweep launches)."""
