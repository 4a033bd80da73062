"""The test suite. Imported before conftest and every test module, in each pytest-xdist worker too.

One OpenMP thread per process, set before anything imports torch: `make test` runs three workers on CI's two cores,
each with in-process engines and server processes of its own, and torch's default of one thread per core makes their
threads spin against each other (test_denoiser_compile, measured alone on a loaded 2-core machine: its set-up 292 s
and one comparison 47 s with two threads, 125 s and 2 s with one). Every process a test starts inherits it; the
servers the tests start take --torch-threads 1 besides, as the launcher's default does.
"""
import os

for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
