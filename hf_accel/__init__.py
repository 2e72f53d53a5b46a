from ._compat import check_transformers_version as _check

_check()
