"""The combination harness (issue 50): a set of sp_jax.compat features in a mode, run on
the smallest mesh they need and compared with the same model unsharded
(``harness.run``), and the covering array of feature sets it runs (``covering``)."""
