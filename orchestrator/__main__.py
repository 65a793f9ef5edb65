"""python -m orchestrator [+chip=NAME] [group=option ...] [key=value ...] [-m]"""

from orchestrator.app import cli

cli()
