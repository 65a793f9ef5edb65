"""Control plane: config, validation, chips, launch and MLflow tracking."""

from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> Path:
    """The ``conf/`` tree: inside the package when installed, at the repository top otherwise."""
    here = Path(__file__).resolve().parent
    installed = here / "conf"
    if (installed / "config.yaml").is_file():
        return installed
    return here.parent / "conf"
