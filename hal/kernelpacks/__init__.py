"""Home of the in-tree packs: ``hal.kernelpacks.emu``, ``hal.kernelpacks.cuda``, ``hal.kernelpacks.rocm``.

In an installed wheel the packs' folders are copied here from the repository's ``packs/`` (see
``wheel.packages`` in pyproject.toml). Run from a checkout, that folder is searched directly, so
``tools/probe`` and the tests work without installing.
"""

import pathlib

_checkout = pathlib.Path(__file__).resolve().parents[2] / "packs"
if _checkout.is_dir() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
