"""``python -m kaisa``: the ``kaisa`` command, which the experiment harness provides.

The command (``train``, ``compare``, ``plan``), its tasks and model zoo live in
the separate distribution kaisa-lab (``lab/`` in kaisa's repository), so that
``pip install kaisa`` is the preconditioner alone.  This module is the one place
the library names kaisa_lab, and only when run: importing kaisa never does.
"""

import sys

try:
    from kaisa_lab.cli.main import main
except ModuleNotFoundError as error:
    if error.name != "kaisa_lab":
        raise
    sys.exit(
        "python -m kaisa runs the kaisa command, which kaisa-lab provides and "
        "which is not installed; from a clone of kaisa's repository: "
        "pip install -e ./lab (or make venv)"
    )

raise SystemExit(main())
