"""amber.__version__ is the installed distribution's version, and the library's."""
from importlib import metadata

import amber


def test_version_is_the_distributions_and_the_librarys():
    assert amber.__version__ == metadata.version("amber-ckpt") == amber.version()
