"""``python -m sp_jax.compat [--markdown] [--coverage PATH] [--cell MODE A [B]]``."""

from sp_jax.compat.printing import main

main()
