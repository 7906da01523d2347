"""Write kv-lifecycle's torchvision stand-in into a site-packages directory (used by .ci/sglang-env).

sglang imports ``torchvision.io`` at import time, and PyPI's torchvision does not install beside
torch 2.13.0 (CPU). transformers, once it finds a ``torchvision``, imports names from
``torchvision.io`` / ``.transforms`` / ``.transforms.functional`` and builds tables of
``InterpolationMode`` members at import time. In the stand-in every name resolves to a placeholder
whose attributes are placeholders and which raises ``NotImplementedError`` when called: nothing in
kv-lifecycle's SGLang tests decodes or transforms an image.

    python .ci/torchvision_stand_in.py SITE_PACKAGES
"""

import sys
from pathlib import Path

ROOT = '''"""kv-lifecycle's torchvision stand-in (.ci/sglang-env): no image is ever decoded here."""
__version__ = "0.0.0+kv-lifecycle-stand-in"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(self._name + "." + attr)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("torchvision stand-in (kv-lifecycle .ci/sglang-env): " + self._name)

    def __repr__(self):
        return "<torchvision stand-in " + self._name + ">"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing("torchvision." + name)
'''

SUB = '''from torchvision import _Missing


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(__name__ + "." + name)
'''

PACKAGES = ("", "io", "transforms", "transforms/functional", "transforms/v2", "transforms/v2/functional")


def main(site: str) -> None:
    base = Path(site) / "torchvision"
    for pkg in PACKAGES:
        directory = base / pkg
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "__init__.py").write_text(ROOT if not pkg else SUB)


if __name__ == "__main__":
    main(sys.argv[1])
