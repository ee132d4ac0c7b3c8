"""Tools run by hand or by `make` (not part of the installed package): `python -m
scripts.gpu_check` (`make gpu-check`), `python scripts/make_hf_fixtures.py`, ..."""
