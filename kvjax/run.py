"""`python -m kvjax.run`: evaluate methods x budgets x tasks x contexts on a model.

The command's code is the `kvjax.cli` package (`kvjax.cli.main`); this module is its name
on the command line.
"""

from kvjax.cli.main import main
from kvjax.cli.signals import exit_now

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
