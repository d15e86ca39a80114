"""``python -m glm5serve``: the ``glm5serve`` command (:func:`glm5serve.cli.main`)."""
import sys

from glm5serve.cli import main

sys.exit(main())
