"""``python -m kaisa``: the same command as the ``kaisa`` console script."""

from kaisa.cli.main import main

raise SystemExit(main())
