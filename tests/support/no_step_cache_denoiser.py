"""`python -m tests.support.no_step_cache_denoiser FLAGS`: the real denoiser server, as it runs where its diffusers
has no TaylorSeer cache (an older image in a rolling upgrade): its probe of the step cache answers no, so it
advertises step_cache false over GetLimits and refuses the cached levels itself. No flag of the denoiser turns step
caching off (it is what the model and diffusers support), so the tests of mixed pools start this one instead."""
from __future__ import annotations

import runpy

from services.denoiser import engine

engine.supported = lambda transformer: False  # what step_cache.supported says without TaylorSeer
runpy.run_module("services.denoiser", run_name="__main__", alter_sys=True)
