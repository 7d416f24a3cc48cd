"""memx's Lightning callback, installed as the package ``memx_callbacks`` (setup.cfg maps this folder
to that name, so that it cannot clash with another installed package called ``callbacks``)."""

from memx_callbacks.memx import MemxCallback

__all__ = ["MemxCallback"]
