"""``dcp_compile.hf``: the public name of the Hugging Face frontend.

Everything Hugging Face lives in :mod:`dcp_compile.frontends.huggingface` (one room); this
module keeps the short import users write (``from dcp_compile.hf import prepare``).
"""

from .frontends.huggingface import *  # noqa: F401,F403  (the frontend's __all__)
from .frontends.huggingface import __all__  # noqa: F401
