"""Code the tests share (importable as ``helpers``: ``pythonpath = ["tests"]`` in pyproject's
pytest section; the processes the tests start get the same path from :func:`paths.env`).

* ``paths``: the repository's folders and the environment of a test's subprocess.
* ``stores``: the backends under test (``BACKENDS``, ``make_store``) over ``registry``, the one
  list of stores every parametrized suite reads; ``simstore``: a simulated disk store.
* ``ckpt``, ``faults``, ``interrupts``: set-ups of the checkpoint, fault and interrupt suites
  and the zygote processes that run their child jobs.
* ``integration``: the framework integrations' tiny models and optimizers.
* ``deferred_lane``: the CUDA staging path's logic on CPU parameters.
* ``fuzz_targets``: the checkpoint reader's fuzz targets (also run by ``fuzz/``).
* ``*_worker``: code that runs in the ranks or processes a test starts.
"""
