"""Real kernels for the tests: Debian's kernel under QEMU, with cgroup v2 or v1 and NUMA nodes.

``python -m tests.vm`` runs one command in a guest (:mod:`tests.vm.machine`); the ``vm`` pytest
marker sends a test into a guest (:mod:`tests.vm.tier`). What a guest boots is built and cached
by :mod:`tests.vm.image`.
"""
