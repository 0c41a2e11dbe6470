"""The pipeline benchmark program moved: it is ``prefire.pipeline_bench``
(``python -m prefire.pipeline_bench``, ``... .sweep``, ``... .simulate``),
named apart from the integration ``prefire.pipelining``."""

raise ImportError(
    "prefire.pipeline was renamed prefire.pipeline_bench (the benchmark program; the pipelining integration is "
    "prefire.pipelining): run python -m prefire.pipeline_bench [flags], python -m prefire.pipeline_bench.sweep or "
    "python -m prefire.pipeline_bench.simulate")
