"""The one compiled module: federation/_gmac.c (AES-256-GMAC for ring frames on a reusable OpenSSL
context). Optional: without a C compiler or OpenSSL's headers the install still succeeds and
federation/ringmac.py uses cryptography's AESGCM (same tags, more time per frame). Everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("federation._gmac", ["federation/_gmac.c"], libraries=["crypto"],
                             extra_compile_args=["-O2"], optional=True)])
