"""``python -m kaisa_lab``: the same command as the ``kaisa`` console script."""

from kaisa_lab.cli.main import main

raise SystemExit(main())
