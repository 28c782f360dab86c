"""Build hook for the one optional C extension (everything else is in pyproject.toml).

``rlinf.util._fastcopy`` copies large buffers with streaming stores (see its source);
``optional=True``: where no C compiler is found the install goes on without it and
rlinf copies with numpy instead (slower for large copies, same results).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rlinf.util._fastcopy", ["rlinf/util/_fastcopy.c"], optional=True)])
