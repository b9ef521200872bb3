"""Side-by-side measurements and the projection tooling they feed (``benchmarks.sim``): not engine code,
and not shipped in the ds_odc wheel. Scripts here run from a checkout (``python benchmarks/<name>.py``)."""
