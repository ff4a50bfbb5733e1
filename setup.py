# The C data path (shim/) is compiled by cffi at install time; setuptools needs this hook.
from setuptools import setup

setup(cffi_modules=["rdmasock/_build_native.py:ffibuilder"])
