"""Data plane: everything that runs inside a training worker. Imports torch only: never Ray,
Hydra or MLflow (metrics leave through :class:`trainers.reporter.Reporter`)."""
